"""FlashAttention forward's tuning workload (bench/workloads/__init__.py says the contract):
contiguous [B, L, H, D] inputs of the bucket's shape, causal (bottom-right aligned) where the
bucket's `causal` is 1, the default scale, no window, ALiBi or soft cap; the output is checked
(the log-sum-exp is a by-product)."""
from __future__ import annotations

from attngen import reference as ref


def check_shape(shape: dict) -> dict:
    """One sequence, one kv head with its group of query heads, 300 rows: partial tiles."""
    return {**shape, "B": 1, "Hq": shape["Hq"] // shape["Hkv"], "Hkv": 1, "Lq": min(shape["Lq"], 300),
            "Lk": min(shape["Lk"], 300)}


def inputs(torch, ops, shape: dict, dtype, seed: int) -> tuple:
    B, Hq, Hkv, Lq, Lk, D = (shape[d] for d in ("B", "Hq", "Hkv", "Lq", "Lk", "D"))
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Lq, Hq, D, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(B, Lk, Hkv, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    return q, k, v, bool(shape["causal"])


def run(ops, instance: str, args: tuple):
    q, k, v, causal = args
    return ops.flash_attention_with(q, k, v, None, None, q.shape[1], k.shape[1], q.shape[-1] ** -0.5, -1,
                                    0 if causal else -1, None, 0.0, False, None, None, None, None, None, instance)


def as_tensor(out):
    """The attention output (the first of out, lse)."""
    return out[0]


def reference(args: tuple):
    q, k, v, causal = args
    return ref.flash_attention(q, k, v, causal=causal)[0]
