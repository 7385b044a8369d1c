"""Where the flash attention backward's time goes: torch.profiler's CUDA time per kernel (the
pre-pass, the backward kernel, the dQ conversion) for one backward call on a saved bf16 forward,
averaged over a few calls, at a few of the benchmark's shapes, by default and deterministic;
TFLOP/s of the backward kernel alone (2.5 x the forward's 4 B Hq N^2 D, half when causal).

  python -m bench.flash_grad_profile
  ncu ... python -m bench.flash_grad_profile --once   # one backward at each shape, no profiler
  python -m bench.flash_grad_profile --d=256            # one head size's shapes only
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attngen  # noqa: E402

# B, H, N, D, causal, deterministic
SHAPES = [(4, 24, 4096, 128, False, False), (4, 48, 4096, 64, False, False), (4, 24, 4096, 128, True, False),
          (4, 24, 4096, 128, False, True), (4, 48, 4096, 64, False, True), (2, 16, 4096, 256, False, False),
          (2, 16, 4096, 256, False, True)]
CALLS = 5


def saved_forward(B, H, N, D, causal, deterministic):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, N, H, D, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    out = attngen.flash_attention(q, k, v, causal=causal, deterministic=deterministic)
    return (q, k, v), out, torch.randn_like(out)


def main():
    once = "--once" in sys.argv   # for ncu: each kernel launched once per shape
    only = [int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--d=")]  # --d=256: that head size's shapes
    for B, H, N, D, causal, deterministic in SHAPES:
        if only and D not in only:
            continue
        inputs, out, d_out = saved_forward(B, H, N, D, causal, deterministic)
        call = lambda: torch.autograd.grad(out, inputs, d_out, retain_graph=True)  # noqa: E731
        call()
        torch.cuda.synchronize()
        if once:
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(CALLS):
                call()
            torch.cuda.synchronize()
        flops = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
        mode = ", deterministic" if deterministic else ""
        print(f"B{B} H{H} N{N} D{D} {'causal' if causal else 'full'}{mode}, bf16, backward per call:")
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
            if e.device_time_total > 0:
                ms = e.device_time_total / CALLS / 1000
                rate = f"  {flops / ms / 1e9:6.0f} TFLOP/s" if "backward_kernel" in e.key else ""
                print(f"  {ms:8.3f} ms  {e.count // CALLS} x  {e.key[:80]}{rate}")


if __name__ == "__main__":
    main()
