"""Where a Gated DeltaNet forward's time goes: torch.profiler's CUDA time per kernel for one
dispatched call (bf16, state in and out), averaged over a few calls, on the issue's shapes.

  python -m bench.gated_delta_profile
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attngen  # noqa: E402
from bench.delta_rule import make_inputs  # noqa: E402

SHAPES = [(8, 4096, 16, 128), (4, 8192, 32, 128), (1, 4096, 8, 128)]
CALLS = 5


def main():
    for B, T, H, K in SHAPES:
        q, k, v, g, beta, s = make_inputs("gated_delta", B, T, H, K, torch.bfloat16)
        attngen.gated_delta_rule(q, k, v, g, beta, state=s)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(CALLS):
                attngen.gated_delta_rule(q, k, v, g, beta, state=s)
            torch.cuda.synchronize()
        print(f"B{B} T{T} H{H} K=V={K}, bf16, per call:")
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
            if e.device_time_total > 0:
                print(f"  {e.device_time_total / CALLS / 1000:8.3f} ms  {e.count // CALLS} x  {e.key[:90]}")


if __name__ == "__main__":
    main()
