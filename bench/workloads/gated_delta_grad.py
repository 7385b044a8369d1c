"""Gated DeltaNet's tensor-core backward's tuning workload (bench/workloads/__init__.py says the
contract): the gradients of q, k, v, g, beta and the initial state from the forward's
checkpoints and the output's and final state's gradients. The checkpoints are random states
here (the kernels' work does not depend on their values; the check runs the float64 chunked
backward, attngen/gated_delta_chunked_grad.py, on the same ones). Inputs as the models make
them: unit-norm keys, log alpha -exp(x - 3), beta in (0, 1)."""
from __future__ import annotations

import torch

from attngen.gated_delta_chunked_grad import gated_delta_chunked_backward

def check_shape(shape: dict) -> dict:
    """Two heads over 300 steps: chunk boundaries and a partial last chunk."""
    return {**shape, "B": 1, "H": 2, "T": min(shape["T"], 300)}


def inputs(_torch, ops, shape: dict, dtype, seed: int) -> tuple:
    B, T, H, K, V = (shape[d] for d in ("B", "T", "H", "K", "V"))
    every = int(ops.gated_delta_grad_checkpoint_every())   # a chunk: the extension's checkpoint interval
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, device="cuda", generator=g)
    q, v, d_o = rand(B, T, H, K).to(dtype), rand(B, T, H, V).to(dtype), rand(B, T, H, V).to(dtype)
    k = torch.nn.functional.normalize(rand(B, T, H, K), dim=-1).to(dtype)
    gate, beta = -torch.exp(rand(B, T, H) - 3), torch.rand(B, T, H, device="cuda", generator=g)
    checkpoints = rand(B, H, -(-T // every), K, V) * 0.1
    d_state = rand(B, H, K, V) * 0.1
    return q, k, v, gate, beta, d_o, checkpoints, d_state, K ** -0.5, True


def run(ops, instance: str, args: tuple):
    return ops.gated_delta_grad_with(*args, None, instance)  # no saved chunk records


def as_tensor(outs):
    """The six gradients as one float64 vector, for the check (not timed)."""
    return torch.cat([x.double().flatten() for x in outs])


def reference(args: tuple):
    q, k, v, gate, beta, d_o, checkpoints, d_state, scale, want_d_state0 = args
    wide = [x.double() for x in (q, k, v, gate, beta, d_o, checkpoints, d_state)]
    every = int(torch.ops.attngen_tune.gated_delta_grad_checkpoint_every())   # as inputs() made them
    return as_tensor(gated_delta_chunked_backward(*wide, scale, want_d_state0, every, torch.float64))
