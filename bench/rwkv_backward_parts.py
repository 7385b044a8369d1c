"""Where the wkv backward's time goes: each of its kernels timed alone on one shape, beside the
forward with and without the checkpoints a gradient needs. Prints a table.

  python -m bench.rwkv_backward_parts [--shape B T H N]
  ncu -k regex:grad_rkwu -c 1 python -m bench.rwkv_backward_parts --once grad_rkwu   (one call, for a profiler)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attngen import rwkv  # noqa: E402
from bench.causal_linear import do_bench  # noqa: E402
from bench.rwkv import make_inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=4, default=[8, 4096, 32, 64])
    ap.add_argument("--once", metavar="PART", help="call the first part whose name starts with PART once, untimed")
    args = ap.parse_args()
    B, T, H, N = args.shape
    r, k, v, w, u, s0 = make_inputs(B, T, H, N, torch.bfloat16, seed=0)
    r, k, v, w = (x.unflatten(-1, (H, N)) for x in (r, k, v, w))
    rwkv._register()
    d_o, d_state = torch.randn_like(r), torch.randn_like(s0)
    ck = r.new_empty(rwkv.checkpoint_shape(B, T, H, N), dtype=torch.float32)
    rwkv._scan(r, k, v, w, u, s0, False, False, True, False, ck)
    parts = {
        "forward": lambda: rwkv._scan(r, k, v, w, u, s0, False, False, True, False),
        "forward + checkpoints": lambda: rwkv._scan(r, k, v, w, u, s0, False, False, True, False, ck),
        "grad_rkwu (dr, dk, dw, du, dS0)": lambda: rwkv._grad_rkwu(r, k, v, w, u, d_o, ck, d_state, True),
        "dv scan": lambda: rwkv._scan(k, r, d_o, w, u, d_state, True, False, False, False),
    }
    if args.once:
        fn = next(fn for name, fn in parts.items() if name.startswith(args.once))
        fn()
        torch.cuda.synchronize()
        return
    print(f"| B T H N = {B} {T} {H} {N}, bf16 | ms |\n|---|---|")
    for name, fn in parts.items():
        print(f"| {name} | {do_bench(fn):.3f} |")


if __name__ == "__main__":
    main()
