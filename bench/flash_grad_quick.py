"""The flash attention backward alone, dispatched, at a few shapes: for A/B runs of one change
inside a device call (build, time, take the change back, rebuild, time again). Backward alone is
`torch.autograd.grad` of a saved bf16 forward (retain_graph), timed by triton's do_bench (median,
rep 300); TFLOP/s = 2.5 x 4 B Hq N^2 D / time, half when causal (as FlashAttention counts it).
Each shape is one JSON line appended to --out, tagged with --tag, and printed. --forced also
times every shipped bf16 instance of the shape's head size through the op's forced path (the op
alone on the saved out and lse, no autograd), with the shape's deterministic flag: what a
dispatch rule for that mode would choose from.

  python -m bench.flash_grad_quick --tag after --out ab.jsonl [--shapes 0 3 ...] [--forced]
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attngen  # noqa: E402

fa = importlib.import_module("attngen.flash_attention")  # the module (attngen.flash_attention is also the op)

# B, Hq, Hkv, N, D, causal, deterministic: issue 29's head sizes, long and short, a GQA row, and
# the deterministic mode at d128 and d64 (d256 causal last).
SHAPES = [(4, 24, 24, 4096, 128, False, False), (4, 24, 24, 4096, 128, True, False),
          (1, 24, 24, 16384, 128, False, False), (1, 32, 8, 8192, 128, False, False),
          (4, 48, 48, 4096, 64, False, False), (4, 48, 48, 4096, 64, True, False),
          (4, 32, 32, 2048, 96, False, False), (2, 16, 16, 4096, 256, False, False),
          (4, 24, 24, 4096, 128, False, True), (4, 48, 48, 4096, 64, False, True),
          (1, 48, 48, 16384, 64, False, True), (4, 48, 48, 4096, 64, True, True),
          (2, 16, 16, 4096, 256, False, True), (1, 24, 24, 16384, 128, False, True),
          (2, 16, 16, 4096, 256, True, False), (2, 16, 16, 4096, 256, True, True)]


def time_backward(B, Hq, Hkv, N, D, causal, deterministic):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, N, Hq, D, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(B, N, Hkv, D, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
            for _ in range(2))
    out = attngen.flash_attention(q, k, v, causal=causal, deterministic=deterministic)
    grad = torch.randn_like(out)
    ms = do_bench(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), rep=300)
    flops = 2.5 * 4 * B * Hq * N * N * D / (2 if causal else 1)
    return ms, flops / ms / 1e9


def time_forced(B, Hq, Hkv, N, D, causal, deterministic):
    """{instance: ms} for every shipped bf16 instance of head size D, backward alone on the saved forward."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, N, Hq, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(B, N, Hkv, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    out, lse = fa.flash_attention(q, k, v, causal=causal, return_lse=True)
    d_out = torch.randn_like(out)
    args = (q, k, v, out, d_out, lse, None, None, None, N, N, D ** -0.5, -1, 0 if causal else -1, None, 0.0,
            deterministic)
    names = [n for n in fa.GRAD.instances() if f"_d{D}_" in n and n.endswith("_bf16_sm90a")]
    return {n: do_bench(lambda: fa.GRAD.forced(n, *args), rep=300) for n in names}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", required=True, help="the side of the A/B these timings are")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines file to append to")
    parser.add_argument("--shapes", type=int, nargs="*", help="indices into SHAPES (default: all)")
    parser.add_argument("--forced", action="store_true", help="also every shipped instance of the head size, forced")
    args = parser.parse_args()
    for i in args.shapes if args.shapes else range(len(SHAPES)):
        B, Hq, Hkv, N, D, causal, det = SHAPES[i]
        ms, tflops = time_backward(B, Hq, Hkv, N, D, causal, det)
        row = {"tag": args.tag, "shape": i, "B": B, "Hq": Hq, "Hkv": Hkv, "N": N, "D": D, "causal": causal,
               "deterministic": det, "ms": round(ms, 4), "tflops": round(tflops, 1)}
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{args.tag}: B{B} H{Hq}/{Hkv} N{N} D{D} causal={int(causal)} det={int(det)}: {ms:.3f} ms "
              f"{tflops:.0f} TFLOP/s", flush=True)
        if args.forced:
            flops = tflops * ms * 1e9
            for name, fms in time_forced(B, Hq, Hkv, N, D, causal, det).items():
                with args.out.open("a") as f:
                    f.write(json.dumps({**row, "instance": name, "ms": round(fms, 4),
                                        "tflops": round(flops / fms / 1e9, 1)}) + "\n")
                print(f"  forced {name}: {fms:.3f} ms {flops / fms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
