"""FlashAttention backward's tuning workload (bench/workloads/__init__.py says the contract):
the forward flash_attention's workload inputs (contiguous [B, L, H, D], causal where the
bucket's `causal` is 1), its output and log-sum-exp made by torch in float32, a random output
gradient; the instance's dq, dk, dv are checked against float64 autograd of the reference."""
from __future__ import annotations

import torch

from attngen import reference as ref

from .flash_attention import check_shape  # noqa: F401  (the same small shape of the same coverage)


def inputs(_torch, ops, shape: dict, dtype, seed: int) -> tuple:
    B, Hq, Hkv, Lq, Lk, D = (shape[d] for d in ("B", "Hq", "Hkv", "Lq", "Lk", "D"))
    causal = bool(shape["causal"])
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Lq, Hq, D, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(B, Lk, Hkv, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    out, lse = _forward(q, k, v, causal)
    d_out = torch.randn(B, Lq, Hq, D, device="cuda", generator=g).to(dtype)
    return q, k, v, out.to(dtype).contiguous(), d_out, lse.float().contiguous(), causal


def _forward(q, k, v, causal: bool, budget: int = 1 << 30):
    """The forward's out and lse in float32, a slab of query heads at a time (the scores of a
    whole B4 H24 L4096 call would take gigabytes), kv heads sliced to the slab's groups."""
    B, Lq, Hq, D = q.shape
    Lk, G = k.shape[1], Hq // k.shape[2]
    per_head = B * Lq * Lk * 4 * 3                       # scores, weights and a temporary in float32
    step = max(G, budget // per_head // G * G)           # whole groups, about `budget` bytes of scores a slab
    outs, lses = [], []
    for h in range(0, Hq, step):
        kv = slice(h // G, (h + step) // G)
        out, lse = ref.flash_attention(q[:, :, h:h + step], k[:, :, kv], v[:, :, kv], causal=causal,
                                       dtype=torch.float32)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 1)


def run(ops, instance: str, args: tuple):
    q, k, v, out, d_out, lse, causal = args
    return ops.flash_attention_grad_with(q, k, v, out, d_out, lse, None, None, None, q.shape[1], k.shape[1],
                                         q.shape[-1] ** -0.5, -1, 0 if causal else -1, None, 0.0, False, instance)


def as_tensor(grads):
    """dq, dk, dv as one tensor for the check."""
    return torch.cat([g.flatten().float() for g in grads])


def reference(args: tuple):
    q, k, v, _out, d_out, _lse, causal = args
    return torch.cat([g.flatten() for g in ref.flash_attention_grad(q, k, v, d_out, causal=causal)])
