"""The wkv backward's tuning workload (codegen/tune/workloads/__init__.py says the contract):
RWKV6's gradients of r, k, w, u and the initial state from the forward's checkpoints (made here
by the reference scan in fp32: the kernel's work does not depend on their values, its check
compares against the reference on the same checkpoints)."""
from __future__ import annotations

from ...families.rwkv import CHECKPOINT_EVERY

AXES: dict = {}


def runtime(shape: dict, dtype_bytes: int, sm_count: int) -> dict:
    return {"N": shape["N"], "T": shape["T"], "BH": shape["B"] * shape["H"], "sm_count": sm_count}


def check_shape(shape: dict) -> dict:
    return {**shape, "B": 1, "H": 2, "T": min(shape["T"], 200)}


def inputs(torch, shape: dict, dtype, seed: int) -> tuple:
    from attngen import reference
    B, T, H, N = (shape[d] for d in ("B", "T", "H", "N"))
    g = torch.Generator(device="cuda").manual_seed(seed)
    r, k, v, d_o = (torch.randn(B, T, H, N, device="cuda", generator=g).to(dtype) for _ in range(4))
    w = (-torch.exp(torch.randn(B, T, H, N, device="cuda", generator=g) - 2)).to(dtype)  # decays ~0.87
    u = (torch.randn(H, N, device="cuda", generator=g) * 0.1).to(dtype)
    d_state = torch.randn(B, H, N, N, device="cuda", generator=g) * 0.1
    checkpoints = torch.empty(B, H, -(-T // CHECKPOINT_EVERY), N, N, device="cuda")
    reference.wkv_scan(r, k, v, w, u, checkpoints=checkpoints, every=CHECKPOINT_EVERY, dtype=torch.float32)
    return r, k, v, w, u, d_o, checkpoints, d_state


def as_tensor(outs):
    """The five gradients as one float64 vector, for the check (not timed)."""
    import torch
    return torch.cat([x.double().flatten() for x in outs])


def run(ops, instance: str, args: tuple):
    return ops.wkv_grad_rkwu_with(*args, True, instance)


def reference(args: tuple):
    from attngen import reference
    return as_tensor(reference.wkv_grad_rkwu(*args, want_d_state0=True, every=CHECKPOINT_EVERY))
