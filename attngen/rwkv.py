"""RWKV5/6 wkv: the generated `wkv_scan` kernels as a differentiable torch custom op.

The forward is one scan of the N x N state, which also saves the state every
`wkv_checkpoint_every()` steps when a gradient is wanted. The backward is one dv scan (time
reversed) and one pass for r, k, w, u and the initial state (templates/rwkv_grad/grad_rkwu.cu.j2) that
rebuilds the states between checkpoints, so the decay gradient is taken directly:
    dw_t[j] = exp(w_t[j]) sum_i dS_t[j, i] S_{t-1}[j, i]
(accurate for decays near 0, where a cumulative identity's O(1) terms cancel to O(decay)).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ._ops import Op, constant_result

SCAN = Op("wkv_scan")
GRAD_RKWU = Op("wkv_grad_rkwu")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_registered = False


def _vector_ready(t: torch.Tensor) -> torch.Tensor:
    """The kernels read 16 bytes at a time: a view whose address or strides break that is
    copied (contiguous, aligned) rather than refused."""
    if torch.compiler.is_compiling():
        return t  # data pointers are not traceable; a misaligned view meets the dispatch's error
    step = 16
    if t.data_ptr() % step == 0 and all(s * t.element_size() % step == 0
                                        for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _scan(q, kc, vo, w, u, state, reverse, keys_output, return_state, float_out, checkpoints=None):
    return SCAN(q, kc, vo, w, u, state, reverse, keys_output, return_state, float_out, checkpoints)


def _grad_rkwu(r, k, v, w, u, d_o, checkpoints, d_state, want_d_state0):
    return GRAD_RKWU(r, k, v, w, u, d_o, checkpoints, d_state, want_d_state0)


def checkpoint_shape(B, T, H, N) -> tuple:
    """The forward's state checkpoints: [B, H, ceil(T / every), N, N] float32."""
    every = checkpoint_every()
    return (B, H, (T + every - 1) // every, N, N)


@functools.cache
def checkpoint_every() -> int:
    """Steps between the forward's state checkpoints (codegen/families/rwkv.py CHECKPOINT_EVERY),
    as the extension was built with it."""
    SCAN.packet()
    return int(torch.ops.attngen.wkv_checkpoint_every())


@constant_result
def _register() -> bool:
    """attngen::wkv with its fake implementation and autograd formula, once per process. A constant
    to torch.compile: a registration runs eagerly where the first call of a process is traced."""
    global _registered
    if _registered:
        return True
    SCAN.packet()  # loads the extension: wkv_scan and wkv_grad_rkwu with their Meta kernels (fake implementations)

    @torch.library.custom_op("attngen::wkv", mutates_args=())
    def wkv_op(r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
               state: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        checkpoints = r.new_empty(checkpoint_shape(*r.shape), dtype=torch.float32)
        o, final = _scan(r, k, v, w, u, state, False, False, True, False, checkpoints)
        return o, final, checkpoints

    @wkv_op.register_fake
    def _wkv_fake(r, k, v, w, u, state):
        B, T, H, N = r.shape
        return (r.new_empty(r.shape), r.new_empty((B, H, N, N), dtype=torch.float32),
                r.new_empty(checkpoint_shape(B, T, H, N), dtype=torch.float32))

    def setup_context(ctx, inputs, output):
        r, k, v, w, u, state = inputs
        ctx.has_state = state is not None
        ctx.save_for_backward(r, k, v, w, u, output[2])

    wkv_op.register_autograd(_backward, setup_context=setup_context)
    _registered = True
    return True


def _backward(ctx, d_o, d_state, _d_checkpoints):
    r, k, v, w, u, checkpoints = ctx.saved_tensors
    d_o = (d_o if d_o is not None else torch.zeros_like(r)).contiguous()
    d_state = d_state.contiguous() if d_state is not None else None
    r, k, v = (x.contiguous() for x in (r, k, v))
    return wkv_backward(_scan, _grad_rkwu, r, k, v, w, u, ctx.has_state, checkpoints, d_o, d_state)


def wkv_backward(scan, grad_rkwu, r, k, v, w, u, has_state, checkpoints, d_o, d_state):
    """Gradients of wkv6 for (r, k, v, w, u, state) from the dv scan and the r, k, w, u pass.
    `scan` and `grad_rkwu` have the signatures of the CUDA ops wkv_scan and wkv_grad_rkwu (or
    their float64 references, for the CPU test of this algebra); `checkpoints` are the
    forward's. dv: sum_j dS_t[j, i] k_t[j] plus its bonus, a scan in reverse with dS as X."""
    dr, dk, dw, du_part, d_s0 = grad_rkwu(r, k, v, w, u, d_o, checkpoints, d_state, has_state)
    dv, _ = scan(k, r, d_o, w, u, d_state, True, False, False, False)
    return dr, dk, dv, dw.to(w.dtype), du_part.sum(0).to(u.dtype), (d_s0 if has_state else None)


def _as_heads(name: str, x: torch.Tensor, H: int, op: str) -> torch.Tensor:
    """[B, T, H*N] (as Hugging Face's RWKV layers hold it) -> a [B, T, H, N] view, no copy."""
    if x.dim() == 3:
        if x.shape[-1] % H:
            raise ValueError(f"{op}: {name} has shape {tuple(x.shape)}; its last dim is not a multiple of "
                             f"H={H} (u's first dim)")
        return x.unflatten(-1, (H, x.shape[-1] // H))
    return x


def _check(op: str, r, k, v, w, u, state, check: bool, w_per_head: bool):
    for name, t in (("r", r), ("k", k), ("v", v), ("w", w), ("u", u)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type not in ("cuda", "meta"):
            raise ValueError(f"{op}: {name} must be a CUDA tensor, got device {t.device}")
        if t.device != r.device:
            raise ValueError(f"{op}: {name} is on {t.device} but r is on {r.device}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{op}: {name} has dtype {t.dtype}; supported: float32, float16, bfloat16")
    for name, t in (("k", k), ("v", v)) + (() if w_per_head else (("w", w),)):
        if t.dtype != r.dtype:
            raise ValueError(f"{op}: {name} has dtype {t.dtype} but r has {r.dtype}")
    if r.dim() != 4:
        raise ValueError(f"{op}: r must be [B, T, H, N] or [B, T, H*N], got shape {tuple(r.shape)}")
    B, T, H, N = r.shape
    for name, t in (("k", k), ("v", v)) + (() if w_per_head else (("w", w),)):
        if t.shape != r.shape:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)} but r has {tuple(r.shape)}")
    want = (H, N)
    if w_per_head and tuple(w.shape) != want:
        raise ValueError(f"{op}: w must be [H, N] = [{H}, {N}] (one decay per head and channel), got shape "
                         f"{tuple(w.shape)}")
    if tuple(u.shape) != want:
        raise ValueError(f"{op}: u must be [H, N] = [{H}, {N}], got shape {tuple(u.shape)}")
    if state is not None:
        if not isinstance(state, torch.Tensor) or state.dtype != torch.float32:
            got = state.dtype if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(f"{op}: state must be a float32 tensor [B, H, N, N], got {got}")
        if tuple(state.shape) != (B, H, N, N):
            raise ValueError(f"{op}: state must be [B, H, N, N] = [{B}, {H}, {N}, {N}], got shape "
                             f"{tuple(state.shape)}")
        if state.device != r.device:
            raise ValueError(f"{op}: state is on {state.device} but r is on {r.device}")
    if check and w.numel() and bool((w > 0).any()):
        raise ValueError(f"{op}: w must be <= 0 (it is the log of the decay, which must not exceed 1); "
                         f"max w = {w.max().item():g}")


def _run(op, r, k, v, w, u, state, check, w_per_head):
    if not isinstance(u, torch.Tensor) or u.dim() != 2:
        raise ValueError(f"{op}: u must be a [H, N] tensor, got "
                         f"{tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__}")
    H = u.shape[0]
    flat = isinstance(r, torch.Tensor) and r.dim() == 3
    r, k, v = (_as_heads(n, x, H, op) if isinstance(x, torch.Tensor) else x for n, x in (("r", r), ("k", k), ("v", v)))
    if not w_per_head and isinstance(w, torch.Tensor):
        w = _as_heads("w", w, H, op)
    _check(op, r, k, v, w, u, state, check, w_per_head)
    if w_per_head:  # one decay per head: a stride-0 view over B and T, no copy
        w = w.to(r.dtype).view(1, 1, *w.shape).expand(r.shape)
    _register()
    u = u.to(r.dtype)
    r, k, v, w, u = (_vector_ready(x) for x in (r, k, v, w, u))
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (r, k, v, w, u, state)):
        o, final, _ = torch.ops.attngen.wkv(r, k, v, w, u, state)
    else:  # inference: straight to the C++ op, without the Python custom op's dispatch cost
        o, final = _scan(r, k, v, w, u, state, False, False, True, False)
    return (o.flatten(-2) if flat else o), final


def wkv6(r, k, v, w, u, state=None, check: bool = False):
    """RWKV6 wkv with a data-dependent decay.

    r, k, v, w: [B, T, H, N] or [B, T, H*N] (H from u); w is the log decay (decay = exp(w) <= 1).
    u: [H, N] bonus (cast to r's dtype). state: optional [B, H, N(key), N(value)] float32.
    Returns o (r's shape and dtype) and the final state [B, H, N, N] float32. fp32, fp16, bf16;
    the state and every sum are fp32. Differentiable in all of r, k, v, w, u and state, and
    through the returned state (so chunked training can feed it to the next call).
    check=True verifies w <= 0 first (a device-to-host sync).
    """
    return _run("wkv6", r, k, v, w, u, state, check, w_per_head=False)


def wkv5(r, k, v, w, u, state=None, check: bool = False):
    """RWKV5 wkv: as wkv6 with one decay per head and channel, w [H, N] (log decay), constant
    over time."""
    return _run("wkv5", r, k, v, w, u, state, check, w_per_head=True)


def wkv_instances() -> list[str]:
    return SCAN.instances()


def wkv_scan_with(instance: str, q, kc, vo, w, u=None, state=None, reverse=False, keys_output=False,
                  return_state=True, float_out=False, checkpoints=None):
    """One named scan instance (tests): errors if it does not cover the inputs."""
    return SCAN.forced(instance, q, kc, vo, w, u, state, reverse, keys_output, return_state, float_out, checkpoints)


def selected_scan(q, kc, vo, w, reverse=False, keys_output=False) -> str:
    """The scan instance the generated dispatch picks for these inputs ('' if none)."""
    return SCAN.select(q, kc, vo, w, None, None, reverse, keys_output, True, False, None)
