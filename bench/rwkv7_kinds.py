"""Every RWKV-7 forward instance of the 64-key bucket (bf16: the shipped ones, and the bench-role
chunked_rwkv7_candidates at 16 and 32 value columns where `python -m codegen build --bench`
built them), forced on the issue's shapes as a training step calls it (checkpoints and records
saved) and as inference does (neither), beside the instance the dispatch picks; each one's
output against the dispatched one's (a bench-role point has no GPU tier of its own). What the
chunked kind's knobs (value columns a CTA, stages) are chosen from.

  python -m bench.rwkv7_kinds [--shape B,T,H]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attngen import delta_rule  # noqa: E402
from bench.causal_linear import do_bench  # noqa: E402
from bench.delta_rule import make_inputs  # noqa: E402

SHAPES = [(8, 4096, 64), (1, 54, 32), (2, 4096, 32)]
K = 64


def op_args(inputs, training: bool):
    r, w, k, v, a, b, s = inputs
    B, T, H, _ = r.shape
    ckpt = torch.empty(delta_rule.checkpoint_shape(B, T, H, K, K), device="cuda") if training else None
    records = (torch.empty(delta_rule.records_numel(B, T, H, K, K, rwkv7=True), dtype=torch.uint8, device="cuda")
               if training else None)
    return (r, k, v, w, a, b, s, delta_rule.variant("rwkv7"), 1.0, True, ckpt, False, records)


def main():
    shapes = SHAPES
    if "--shape" in sys.argv:
        shapes = [tuple(int(x) for x in sys.argv[sys.argv.index("--shape") + 1].split(","))]
    names = sorted(n for n in delta_rule.OP.instances() + delta_rule.OP.bench_instances()
                   if n.startswith("delta_rule_rwkv7_") and f"_k{K}_" in n and n.endswith("_bf16_sm90a"))
    for B, T, H in shapes:
        inputs = make_inputs("rwkv7", B, T, H, K, torch.bfloat16)
        train, infer = op_args(inputs, True), op_args(inputs, False)
        pick = delta_rule.OP.select(*train)
        want = delta_rule.OP(*infer)[0].double()
        print(f"B{B} T{T} H{H} K=V={K} bf16: dispatch {pick}")
        rows = []
        for n in names:
            try:
                got = delta_rule.delta_rule_with(n, *infer)[0].double()
            except (RuntimeError, ValueError) as e:  # an instance that does not cover the shape
                print(f"   {n}: {str(e).splitlines()[0][:100]}")
                continue
            diff = ((got - want).norm() / want.norm()).item()
            if not diff <= 1e-2:  # bf16 outputs of the same recurrence agree to a few 1e-3
                print(f"   {n}: output differs from the dispatched instance's by {diff:.1e}; not timed")
                continue
            rows.append((do_bench(lambda: delta_rule.delta_rule_with(n, *train)),
                         do_bench(lambda: delta_rule.delta_rule_with(n, *infer)), diff, n))
        for t_ms, i_ms, diff, n in sorted(rows):
            short = n.replace("delta_rule_rwkv7_", "").replace("_bf16_sm90a", "")
            print(f"   {short:45s} training {t_ms:.3f} ms  inference {i_ms:.3f} ms  rel diff {diff:.1e}")


if __name__ == "__main__":
    main()
