"""The RWKV wkv scan's tuning workload (codegen/tune/workloads/__init__.py says the contract):
RWKV6's forward (keys contracted, u and an initial state). The backward's scans are the same
kinds walking in reverse or with the keys as the output axis, and take the same winners."""
from __future__ import annotations

from ...dispatch import contiguous_align

AXES = {"direction": "fwd", "keys": "contracted"}


def runtime(shape: dict, dtype_bytes: int, sm_count: int) -> dict:
    return {"N": shape["N"], "T": shape["T"], "BH": shape["B"] * shape["H"],
            "align": contiguous_align(dtype_bytes, shape["N"]), "sm_count": sm_count}


def check_shape(shape: dict) -> dict:
    return {**shape, "B": 1, "H": 2, "T": min(shape["T"], 200)}


def inputs(torch, shape: dict, dtype, seed: int) -> tuple:
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
    from attngen import reference
    return reference.wkv_scan(*args)[0]
