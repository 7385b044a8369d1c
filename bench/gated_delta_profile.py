"""Where Gated DeltaNet's time goes: torch.profiler's CUDA time per kernel for one dispatched
forward (bf16, state in and out), one backward call (the tensor-core gated_delta_grad op on
the forward's checkpoints, the final state's gradient given) and one training step through
attngen.gated_delta_rule (every input and the state differentiable), averaged over a few
calls, on the issue's shapes.

  python -m bench.gated_delta_profile
  ncu ... python -m bench.gated_delta_profile --once   # one forward and one backward at the first shape
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attngen  # noqa: E402
from attngen import delta_rule  # noqa: E402
from bench.delta_rule import make_inputs  # noqa: E402

SHAPES = [(8, 4096, 16, 128), (4, 8192, 32, 128), (1, 4096, 8, 128)]
CALLS = 5


def per_kernel(title: str, call) -> None:
    """Prints the CUDA time per kernel of `call`, averaged over CALLS calls."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
    print(f"{title}, per call:")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total > 0:
            print(f"  {e.device_time_total / CALLS / 1000:8.3f} ms  {e.count // CALLS} x  {e.key[:90]}")


def main():
    once = "--once" in sys.argv  # for ncu: each kernel launched once, no profiler
    for B, T, H, K in SHAPES[:1] if once else SHAPES:
        q, k, v, g, beta, s = make_inputs("gated_delta", B, T, H, K, torch.bfloat16)
        if not once:
            per_kernel(f"B{B} T{T} H{H} K=V={K}, bf16, forward", lambda: attngen.gated_delta_rule(q, k, v, g, beta, state=s))
        ckpt = torch.empty(delta_rule.checkpoint_shape(B, T, H, K, K), device="cuda")
        delta_rule.OP(q, k, v, g, beta, None, s, delta_rule.variant("gated_delta"), K ** -0.5, True, ckpt)
        d_o, d_s = torch.randn_like(v), torch.randn_like(s)
        args = (q, k, v, g, beta, d_o, ckpt, d_s, K ** -0.5, True)
        if once:
            delta_rule.GATED_GRAD(*args)
            torch.cuda.synchronize()
            continue
        per_kernel(f"B{B} T{T} H{H} K=V={K}, bf16, backward ({delta_rule.GATED_GRAD.select(*args)})",
                   lambda: delta_rule.GATED_GRAD(*args))
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta, s)]

        def step():  # a training step: the forward saves its checkpoints and chunk records
            for x in leaves:
                x.grad = None
            o, final = attngen.gated_delta_rule(*leaves[:5], state=leaves[5])
            torch.autograd.backward([o, final], [d_o, d_s])
        per_kernel(f"B{B} T{T} H{H} K=V={K}, bf16, forward + backward", step)


if __name__ == "__main__":
    main()
