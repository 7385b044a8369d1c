"""Where RWKV-7's training step goes: torch.profiler's CUDA time per kernel of one forward +
backward through attngen.rwkv7 (bf16, every input and the initial state differentiable, the
gradients of o and of the final state given), averaged over a few steps, on the issue's shapes,
and the whole step's time as bench.delta_rule measures forward + backward.

  python -m bench.rwkv7_profile
  ncu ... python -m bench.rwkv7_profile --once   # one dispatched backward (delta_rule_grad) at the first shape, on records
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attngen  # noqa: E402
from attngen import delta_rule  # noqa: E402
from bench.causal_linear import do_bench  # noqa: E402
from bench.delta_rule import make_inputs  # noqa: E402
from bench.gated_delta_profile import per_kernel  # noqa: E402

SHAPES = [(8, 4096, 64, 64), (1, 54, 32, 64)]


def main():
    once = "--once" in sys.argv  # for ncu: the backward kernel launched once, no profiler
    for B, T, H, K in SHAPES[:1] if once else SHAPES:
        r, w, k, v, a, b, s = make_inputs("rwkv7", B, T, H, K, torch.bfloat16)
        if once:
            # As a training step runs it: on the records the forward saves (each chunk's start state).
            ckpt = torch.empty(delta_rule.checkpoint_shape(B, T, H, K, K), device="cuda")
            records = torch.empty(delta_rule.records_numel(B, T, H, K, K, rwkv7=True), dtype=torch.uint8, device="cuda")
            delta_rule.OP(r, k, v, w, a, b, s, delta_rule.variant("rwkv7"), 1.0, True, ckpt, False, records)
            d_o = torch.randn_like(v)
            delta_rule.GRAD(r, k, v, w, a, b, d_o, ckpt, torch.randn_like(s), 1.0, True, records)
            torch.cuda.synchronize()
            continue
        leaves = [x.detach().clone().requires_grad_() for x in (r, w, k, v, a, b, s)]
        d_o, d_s = torch.randn_like(v), torch.randn_like(s)

        def step():
            for x in leaves:
                x.grad = None
            o, final = attngen.rwkv7(*leaves[:6], state=leaves[6])
            torch.autograd.backward([o, final], [d_o, d_s])
        per_kernel(f"B{B} T{T} H{H} K=V={K}, bf16, forward + backward", step)
        # The whole step as bench.delta_rule times forward + backward (issue 31's figure), in the
        # listing's format so that bench.ab_table puts it beside the kernels.
        print(f"  {do_bench(step):8.3f} ms  1 x  whole step: triton do_bench of forward + backward, host included")


if __name__ == "__main__":
    main()
