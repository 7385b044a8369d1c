"""Every Gated DeltaNet forward instance of a shape's key bucket (shipped, and the bench-role
ones where `python -m codegen build --bench` built them), forced, beside
flash-linear-attention 0.6's chunk kernel (bf16, state in and out); prints ms, the ratio and the
instance the dispatch picks. What the chunked kinds' grids and dispatch rules are chosen from.

  python -m bench.gated_delta_kinds
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attngen import delta_rule  # noqa: E402
from bench.causal_linear import do_bench  # noqa: E402
from bench.delta_rule import impl_fn, make_inputs, time_candidates  # noqa: E402

SHAPES = [(8, 4096, 16, 128), (4, 8192, 32, 128), (1, 4096, 8, 128), (8, 2048, 16, 64)]


def main():
    for B, T, H, K in SHAPES:
        inputs = make_inputs("gated_delta", B, T, H, K, torch.bfloat16)
        q, k, v, g, beta, s = inputs
        fla = impl_fn("fla_chunk", "gated_delta")
        fla_ms = do_bench(lambda: fla(*inputs))
        ours, theirs = impl_fn("attngen", "gated_delta")(*inputs)[0].float(), fla(*inputs)[0].float()
        pick = delta_rule.OP.select(q, k, v, g, beta, None, s, delta_rule.variant("gated_delta"), K ** -0.5, True, None)
        print(f"B{B} T{T} H{H} K{K}: fla chunk {fla_ms:.3f} ms; dispatch {pick}; "
              f"rel diff vs fla {((ours - theirs).norm() / theirs.norm()).item():.2e}")
        for name, ms in sorted(time_candidates("gated_delta", K, inputs).items(), key=lambda x: x[1]):
            print(f"   {name.replace('delta_rule_gated_delta_', '').replace('_bf16_sm90a', ''):45s} {ms:.3f} ms  "
                  f"{fla_ms / ms:.2f}x fla")


if __name__ == "__main__":
    main()
