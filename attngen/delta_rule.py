"""The delta-rule recurrences, RWKV-7 and Gated DeltaNet: the generated `delta_rule` kernels
(specs/delta_rule.yaml) as a torch custom op, forward only for now.

Both keep a decayed fp32 state S[key, value] per (batch, head), [B, H, K, V] as
flash-linear-attention's `fused_recurrent_rwkv7` / `fused_recurrent_gated_delta_rule` take and
return it, and correct it by a rank-one term each step:
    rwkv7:             sa = S^T a_t;  S <- diag(exp(w_t)) S + b_t sa^T + k_t v_t^T;    o_t = scale S^T r_t
    gated_delta_rule:  S <- exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = scale S^T q_t
(o_t reads the state after step t's update). In the value-major orientation of the RWKV-7 and
Gated DeltaNet papers, S' = S^T: S'_t = S'_{t-1} diag(w_t) + (S'_{t-1} a_t) b_t^T + v_t k_t^T and
S'_t = alpha_t S'_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._checks import check_tensor
from ._ops import Op

OP = Op("delta_rule")


def variant(name: str) -> int:
    """The op's `variant` argument for `name` (the spec's axis order, read from the extension)."""
    return OP.axis_index("variant", name)


def _no_backward(ctx, grad_o, grad_state):
    raise NotImplementedError("delta_rule: the backward pass is not implemented yet (forward only); "
                              "call it under torch.no_grad() or detach the inputs")


def _no_context(ctx, inputs, output) -> None:
    pass


def _run(op_name: str, tensors: dict, variant_name: str, *args):
    """Every tensor on a CUDA device (what needs no extension to say), then the op, whose
    generated checks name anything else. The op's arguments are q, k, v, w, a, b, state, then
    the variant's number, then `args`."""
    first = next(iter(tensors.values()))
    for name, t in tensors.items():
        if t is not None:
            check_tensor(op_name, name, t, first if t is not first else None)
    OP.register_autograd(_no_backward, _no_context)
    q, k, v, w, a, b, state = tensors.values()
    return OP(q, k, v, w, a, b, state, variant(variant_name), *args)


def rwkv7(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
          b: torch.Tensor, state: Optional[torch.Tensor] = None, scale: float = 1.0,
          return_state: bool = True):
    """RWKV-7's wkv: (o [B, T, H, V], final state [B, H, K, V] float32, or None).

    r, w, k, a, b: [B, T, H, K]; v: [B, T, H, V]; all of one dtype (fp32, fp16 or bf16; the
    state and the arithmetic are fp32). w is the log of the decay (w <= 0); as RWKV-LM passes
    them, a = -kk and b = kk * iclr. state: [B, H, K, V] float32 (default zeros). Any strides
    with a contiguous last dim.
    """
    o, s = _run("rwkv7", {"r": r, "k": k, "v": v, "w": w, "a": a, "b": b, "state": state}, "rwkv7",
                float(scale), bool(return_state))
    return o, (s if return_state else None)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                     use_qk_l2norm: bool = False, return_state: bool = True):
    """Gated DeltaNet: (o [B, T, H, V], final state [B, H, K, V] float32, or None).

    q, k: [B, T, H, K]; v: [B, T, H, V] (K and V may differ); one dtype (fp32, fp16, bf16).
    g (log alpha, <= 0) and beta: [B, T, H], taken as float32. scale defaults to K^-0.5.
    use_qk_l2norm normalises q and k over K first (done by torch before the kernel, in fp32).
    """
    if use_qk_l2norm:
        q, k = (torch.nn.functional.normalize(x.float(), dim=-1).to(x.dtype) for x in (q, k))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = g.float() if isinstance(g, torch.Tensor) else g
    beta = beta.float() if isinstance(beta, torch.Tensor) else beta
    o, s = _run("gated_delta_rule", {"q": q, "k": k, "v": v, "g": g, "beta": beta, "b": None, "state": state},
                "gated_delta", float(scale), bool(return_state))
    return o, (s if return_state else None)


def instances() -> list[str]:
    return OP.instances()


def delta_rule_with(instance: str, *args):
    """Run one named instance with the op's own arguments (tests, benchmarks)."""
    return OP.forced(instance, *args)
