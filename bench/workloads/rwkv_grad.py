"""The wkv backward's tuning workload (bench/workloads/__init__.py says the contract): RWKV6's
gradients of r, k, w, u and the initial state from the forward's checkpoints (made here by the
reference scan in fp32: the kernel's work does not depend on their values, its check compares
against the reference on the same checkpoints). The checkpoint interval is the extension's
(the op wkv_grad_checkpoint_every)."""
from __future__ import annotations

from attngen import reference as ref


def check_shape(shape: dict) -> dict:
    return {**shape, "B": 1, "H": 2, "T": min(shape["T"], 200)}


def inputs(torch, ops, shape: dict, dtype, seed: int) -> tuple:
    B, T, H, N = (shape[d] for d in ("B", "T", "H", "N"))
    every = int(ops.wkv_grad_checkpoint_every())
    g = torch.Generator(device="cuda").manual_seed(seed)
    r, k, v, d_o = (torch.randn(B, T, H, N, device="cuda", generator=g).to(dtype) for _ in range(4))
    w = (-torch.exp(torch.randn(B, T, H, N, device="cuda", generator=g) - 2)).to(dtype)  # decays ~0.87
    u = (torch.randn(H, N, device="cuda", generator=g) * 0.1).to(dtype)
    d_state = torch.randn(B, H, N, N, device="cuda", generator=g) * 0.1
    checkpoints = torch.empty(B, H, -(-T // every), N, N, device="cuda")
    ref.wkv_scan(r, k, v, w, u, checkpoints=checkpoints, every=every, dtype=torch.float32)
    return r, k, v, w, u, d_o, checkpoints, d_state


def as_tensor(outs):
    """The five gradients as one float64 vector, for the check (not timed)."""
    import torch
    return torch.cat([x.double().flatten() for x in outs])


def run(ops, instance: str, args: tuple):
    return ops.wkv_grad_rkwu_with(*args, True, instance)


def reference(args: tuple):
    import torch
    every = int(torch.ops.attngen_tune.wkv_grad_checkpoint_every())
    return as_tensor(ref.wkv_grad_rkwu(*args, want_d_state0=True, every=every))
