"""The flash attention backward alone, dispatched, at a few shapes: for A/B runs of one change
inside a device call (build, time, take the change back, rebuild, time again). Backward alone is
`torch.autograd.grad` of a saved bf16 forward (retain_graph), timed by triton's do_bench (median,
rep 300); TFLOP/s = 2.5 x 4 B Hq N^2 D / time, half when causal (as FlashAttention counts it).
Each shape is one JSON line appended to --out, tagged with --tag, and printed.

  python -m bench.flash_grad_quick --tag after --out ab.jsonl [--shapes 0 3 ...]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attngen  # noqa: E402

# B, Hq, Hkv, N, D, causal, deterministic: issue 29's head sizes, long and short, a GQA row, and
# the deterministic mode at d128 and d64.
SHAPES = [(4, 24, 24, 4096, 128, False, False), (4, 24, 24, 4096, 128, True, False),
          (1, 24, 24, 16384, 128, False, False), (1, 32, 8, 8192, 128, False, False),
          (4, 48, 48, 4096, 64, False, False), (4, 48, 48, 4096, 64, True, False),
          (4, 32, 32, 2048, 96, False, False), (2, 16, 16, 4096, 256, False, False),
          (4, 24, 24, 4096, 128, False, True), (4, 48, 48, 4096, 64, False, True)]


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", required=True, help="the side of the A/B these timings are")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines file to append to")
    parser.add_argument("--shapes", type=int, nargs="*", help="indices into SHAPES (default: all)")
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


if __name__ == "__main__":
    main()
