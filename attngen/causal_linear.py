"""Causal linear attention: the generated `causal_dot_product` kernels as a torch custom op
(fake implementation and autograd registered, so torch.compile(fullgraph=True) traces it),
and the attention layers of fast-transformers built on it."""
from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import is_fake

from . import _jit
from ._ops import Op, constant_result

OP = Op("causal_dot_product")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, op: str = "causal_dot_product"):
    """Raise ValueError naming the argument for anything no kernel accepts."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cuda" and t.device.type != "meta":
            raise ValueError(f"{op}: {name} must be a CUDA tensor, got device {t.device}")
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device} but q is on {q.device}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{op}: {name} has dtype {t.dtype}; supported: float32, float16, bfloat16")
        if t.dtype != q.dtype:
            raise ValueError(f"{op}: {name} has dtype {t.dtype} but q has {q.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D [B, H, L, features], got shape {tuple(t.shape)}")
        if t.shape[:3] != q.shape[:3]:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)} but q has {tuple(q.shape)}; "
                             f"B, H, L must agree")
        if t.shape[3] > 1 and t.stride(3) != 1:
            raise ValueError(f"{op}: {name} must have a contiguous last dim (stride 1), got strides "
                             f"{t.stride()}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"{op}: k has last dim {k.shape[3]} but q has {q.shape[3]}")


def _setup_context(ctx, inputs, output):
    q, k, v, reverse = inputs
    ctx.save_for_backward(q, k, v)
    ctx.reverse = reverse


def _backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    grad = grad if grad.stride(-1) == 1 else grad.contiguous()
    rev = ctx.reverse
    # o_t = sum_s (q_t . k_s) v_s over s <= t (s >= t if reverse):
    #   dq_t = sum_s (g_t . v_s) k_s, same direction;
    #   dk_s = sum_t (v_s . g_t) q_t and dv_s = sum_t (k_s . q_t) g_t, the other direction.
    for args in ((grad, v, k, rev), (v, grad, q, not rev), (k, q, grad, not rev)):
        _build_past_the_buckets(*args)
    dq = OP(grad, v, k, rev) if ctx.needs_input_grad[0] else None
    dk = OP(v, grad, q, not rev) if ctx.needs_input_grad[1] else None
    dv = OP(k, q, grad, not rev) if ctx.needs_input_grad[2] else None
    return dq, dk, dv, None


@constant_result
def _register() -> bool:
    """The autograd formula; the op and its Meta kernel (the fake implementation torch.compile
    uses) come with the extension. A constant to torch.compile: a registration runs eagerly
    where the first call of a process is traced."""
    OP.register_autograd(_backward, _setup_context)
    return True


def causal_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reverse: bool = False):
    """o[b,h,t] = q[b,h,t] . sum_{s<=t} k[b,h,s]^T v[b,h,s]  (s >= t when reverse).

    q, k: [B, H, L, E]; v: [B, H, L, M]; fp32, fp16 or bf16 (accumulation is fp32). Any strides
    with a contiguous last dim: a [B, L, H, E] tensor permuted to [B, H, L, E] runs without a copy.
    """
    check_inputs(q, k, v)
    _register()
    _build_past_the_buckets(q, k, v, reverse)
    return OP(q, k, v, reverse)


_decided: set = set()  # (E, M, dtype, reverse) already looked at in this process


def _build_past_the_buckets(q, k, v, reverse: bool) -> None:
    """E or M past the recurrent kinds' buckets (E = 256 in fp32) sends a call to the spec's
    fallback-role kind; the first such call builds a recurrent instance for it (attngen/_jit.py),
    which the dispatch then tries before the fallback. Looked at once per (E, M, dtype, direction)."""
    if torch.compiler.is_compiling() or not _jit.enabled() or is_fake(q):
        return  # traced (the backward of a compiled graph is traced with fake tensors): nothing to build
    seen = (q.shape[3], v.shape[3], q.dtype, bool(reverse))
    if seen in _decided:
        return
    _decided.add(seen)
    if OP.select(q, k, v, reverse) not in _fallbacks():
        return
    jit = _jit._generator()
    if jit is None:
        return  # no source tree: the generic kind serves the call
    try:
        _jit.ensure(OP.name, OP.key(q, k, v, reverse))
    except (jit.SizeIsBuilt, jit.Unbuildable):
        pass  # misaligned, or no recurrent instance fits: the generic kind serves the call


@functools.cache
def _fallbacks() -> frozenset:
    return frozenset(OP.instances("fallback"))


def instances() -> list[str]:
    return OP.instances()


def selected_instance(q, k, v, reverse: bool = False) -> str:
    """Name of the instance the generated dispatch picks for these inputs ('' if none)."""
    check_inputs(q, k, v)
    return OP.select(q, k, v, reverse)


def causal_dot_product_with(instance: str, q, k, v, reverse: bool = False):
    """Run one named instance (tests and tuning); errors if it does not cover the inputs."""
    check_inputs(q, k, v)
    return OP.forced(instance, q, k, v, reverse)


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.elu(x) + 1


def causal_linear_attention(q, k, v, eps: float = 1e-6, feature_map=elu_feature_map):
    """fast-transformers' CausalLinearAttention: q, k [B, L, H, E], v [B, L, H, M] -> [B, L, H, M].

    V_t = phi(q_t) . sum_{s<=t} phi(k_s)^T v_s / (phi(q_t) . sum_{s<=t} phi(k_s) + eps)
    """
    Q, K = feature_map(q), feature_map(k)
    Z = 1 / (torch.einsum("nlhi,nlhi->nlh", Q, K.cumsum(1)) + eps)
    V = causal_dot_product(Q.permute(0, 2, 1, 3), K.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
    return V.permute(0, 2, 1, 3) * Z[..., None]


def linear_attention(q, k, v, eps: float = 1e-6, feature_map=elu_feature_map):
    """fast-transformers' LinearAttention (no mask): q, k [B, L, H, E], v [B, L, H, M]."""
    Q, K = feature_map(q), feature_map(k)
    KV = torch.einsum("nshd,nshm->nhmd", K, v)
    Z = 1 / (torch.einsum("nlhd,nhd->nlh", Q, K.sum(dim=1)) + eps)
    return torch.einsum("nlhd,nhmd,nlh->nlhm", Q, KV, Z.to(Q.dtype))
