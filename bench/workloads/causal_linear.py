"""Causal linear attention's tuning workload (bench/workloads/__init__.py says the contract):
forward only, the reverse kernel is the same code walking time backwards."""
from __future__ import annotations

import math


def check_shape(shape: dict) -> dict:
    return {**shape, "B": 1, "H": 2, "L": min(shape["L"], 300)}


def inputs(torch, ops, shape: dict, dtype, seed: int) -> tuple:
    B, H, L, E, M = (shape[d] for d in ("B", "H", "L", "E", "M"))
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, L, E, device="cuda", generator=g).to(dtype) / math.sqrt(E)
    k = torch.randn(B, H, L, E, device="cuda", generator=g).to(dtype) / math.sqrt(L)
    v = torch.randn(B, H, L, M, device="cuda", generator=g).to(dtype)
    return q, k, v


def run(ops, instance: str, args: tuple):
    return ops.causal_dot_product_with(*args, False, instance)


def reference(args: tuple):
    q, k, v = (x.double() for x in args)
    return (q @ k.transpose(-1, -2)).tril() @ v
