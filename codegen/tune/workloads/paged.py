"""Paged decode's tuning workload (codegen/tune/workloads/__init__.py says the contract): one
query token per sequence, every sequence at the bucket's context L, pages of BLOCK tokens
shuffled through the cache (NHD), the cache in q's dtype."""
from __future__ import annotations

from . import contiguous_align

AXES: dict = {}
BLOCK = 16


def runtime(shape: dict, dtype_bytes: int, sm_count: int) -> dict:
    return {"D": shape["D"], "G": shape["Hq"] // shape["Hkv"], "S": shape["S"], "Q": 1, "KVE": 0,
            "Hq": shape["Hq"], "Hkv": shape["Hkv"], "L": -(-shape["L"] // BLOCK) * BLOCK,
            "align": contiguous_align(dtype_bytes, shape["D"]), "sm_count": sm_count}


def check_shape(shape: dict) -> dict:
    return {**shape, "S": 3, "L": min(shape["L"], 1000)}


def inputs(torch, shape: dict, dtype, seed: int) -> tuple:
    S, Hq, Hkv, D, L = (shape[d] for d in ("S", "Hq", "Hkv", "D", "L"))
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-L // BLOCK)
    order = torch.randperm(S * pages, device="cuda", generator=g).to(torch.int32)
    q = torch.randn(S, Hq, D, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(S * pages, BLOCK, Hkv, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    lens = torch.full((S,), L, dtype=torch.int32, device="cuda")
    return q, k, v, order.view(S, pages), lens


def run(ops, instance: str, args: tuple):
    q = args[0]
    return ops.paged_decode_with(*args, q.shape[-1] ** -0.5, None, 0.0, None, None, instance)


def reference(args: tuple):
    from attngen import reference
    return reference.paged_decode(*args)
