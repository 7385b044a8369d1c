"""Paged decode calls for Nsight Compute: each case runs the dispatched instance (or --instance)
at one shape, twice (the first call loads the module), with the cache in bf16 or fp8.

  ncu --section WarpStateStats -k regex:decode_kernel --launch-skip 1 --launch-count 1 \
      python -m bench.profile_paged 8,8,64,4096,bf16 8,8,64,4096,e4m3
  (each case is G,Hkv,sequences,context,cache)
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
paged = importlib.import_module("attngen.paged")
from bench.paged import make_case  # noqa: E402

CACHES = {"bf16": None, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="+", help="G,Hkv,sequences,context,cache (cache: bf16, e4m3, e5m2)")
    ap.add_argument("--instance", default=None, help="force a compiled instance by name")
    args = ap.parse_args()
    for case in args.cases:
        G, Hkv, S, ctx, cache = case.split(",")
        G, Hkv, S, ctx = int(G), int(Hkv), int(S), int(ctx)
        q, k, v, bt, lens = make_case(S, G * Hkv, Hkv, ctx, seed=G)
        extra = {}
        if CACHES[cache] is not None:
            scale = torch.full((Hkv,), 0.05, device="cuda")
            k, v = (x.float().div_(0.05).to(CACHES[cache]) for x in (k, v))
            extra = {"k_scale": scale, "v_scale": scale}
        for _ in range(2):
            if args.instance:
                paged.paged_decode_with(args.instance, q, k, v, bt, lens, **extra)
            else:
                paged.paged_decode(q, k, v, bt, lens, **extra)
        torch.cuda.synchronize()
        print(case, args.instance or paged.selected_instance(q, k, v, bt, lens), flush=True)


if __name__ == "__main__":
    main()
