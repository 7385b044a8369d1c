"""The RWKV wkv scan's tuning workload (bench/workloads/__init__.py says the contract): RWKV6's
forward (keys contracted, u and an initial state)."""
from __future__ import annotations

from attngen import reference as ref


def check_shape(shape: dict) -> dict:
    return {**shape, "B": 1, "H": 2, "T": min(shape["T"], 200)}


def inputs(torch, ops, shape: dict, dtype, seed: int) -> tuple:
    B, T, H, N = (shape[d] for d in ("B", "T", "H", "N"))
    g = torch.Generator(device="cuda").manual_seed(seed)
    r, k, v = (torch.randn(B, T, H, N, device="cuda", generator=g).to(dtype) for _ in range(3))
    w = (-torch.exp(torch.randn(B, T, H, N, device="cuda", generator=g) - 2)).to(dtype)  # decays ~0.87
    u = (torch.randn(H, N, device="cuda", generator=g) * 0.1).to(dtype)
    state = torch.randn(B, H, N, N, device="cuda", generator=g) * 0.1
    return r, k, v, w, u, state


def run(ops, instance: str, args: tuple):
    return ops.wkv_scan_with(*args, False, False, True, False, None, instance)[0]


def reference(args: tuple):
    return ref.wkv_scan(*args)[0]
