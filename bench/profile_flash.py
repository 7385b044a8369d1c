"""One flash attention call per case, for Nsight Compute: each case runs an instance (the dispatched
one unless --instance) at one shape, twice (the first call loads the module; profile with
`-k regex:forward_kernel --launch-skip 1 --launch-count 1` per case, or all with a filter).

  ncu --set full -k regex:forward_kernel python -m bench.profile_flash 1,48,16384,64,0 4,48,1024,64,1
  (each case is B,H,N,D,causal)
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
fa = importlib.import_module("attngen.flash_attention")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+", help="B,H,N,D,causal")
    ap.add_argument("--instance", default=None, help="force a compiled instance by name")
    args = ap.parse_args()
    for case in args.cases:
        B, H, N, D, causal = (int(x) for x in case.split(","))
        q, k, v = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for _ in range(2):
            fa.flash_attention(q, k, v, causal=bool(causal), instance=args.instance)
        torch.cuda.synchronize()
        print(case, fa.selected_instance(q, k, v) if args.instance is None else args.instance, flush=True)


if __name__ == "__main__":
    main()
