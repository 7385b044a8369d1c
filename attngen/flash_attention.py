"""Softmax attention forward (FlashAttention-2 on tensor cores): the generated `flash_attention`
kernels as a torch custom op, in flash-attn's layouts.

q [B, Lq, Hq, D], k and v [B, Lk, Hkv, D] (or packed [tokens, H, D] with cu_seqlens, as
flash-attn's varlen API); any strides with a contiguous last dim; fp16 or bf16 with fp32
softmax and accumulation. Query head h reads kv head h // (Hq // Hkv). Causal masks and
windows align the last query row with the last key row (flash-attn >= 2.1). Differentiable in
q, k and v (and through the returned lse): the backward is the generated
`flash_attention_grad` op (specs/flash_attention_grad.yaml), which recomputes the weights from
the saved log-sum-exp. FP8 inference: float8_e4m3fn q, k, v with descale factors give a bf16
output (fixed or packed lengths, head sizes 64, 128 and 256; no gradient).
"""
from __future__ import annotations

import math
import re
from typing import Optional, Sequence

import torch

from ._checks import check_tensor
from ._ops import Op, constant_result

OP = Op("flash_attention")
GRAD = Op("flash_attention_grad")
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn,)   # the forward only, a bf16 output


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, left, right, alibi_slopes, soft_cap, deterministic,
     block_table, _seqused_k) = inputs[:15]   # then the fp8 descales
    ctx.paged = block_table is not None
    ctx.fp8 = q.dtype in FP8_DTYPES
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    ctx.options = (max_q, max_k, scale, left, right, soft_cap, deterministic)
    # An output the loss does not read gets None, not zeros: lse's zeros cost a fill kernel and its
    # host time each step (aten::zeros was the largest op of the backward's host time on the H200,
    # bench/results/h200/flash_grad_host_probe_0713d74e.txt), and the backward then read them.
    ctx.set_materialize_grads(False)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A gradient as the kernels read it: rows with a contiguous last dim, 16-byte aligned."""
    return _aligned(t if t.stride(-1) == 1 else t.contiguous())


def _backward(ctx, d_out, d_lse):
    """dq, dk, dv from the generated backward (P recomputed from the saved lse); d_lse, where
    the caller used the returned lse, folds into the row sums (d lse_i / d s_ij = P_ij)."""
    if ctx.paged:
        raise NotImplementedError("paged_attention has no gradient: a paged KV cache is inference state (use "
                                  "flash_attention_varlen on the sequences' own rows to train)")
    if ctx.fp8:
        raise NotImplementedError("flash_attention on float8 q, k, v has no gradient (an inference forward): "
                                  "train in bf16 or fp16")
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
    max_q, max_k, scale, left, right, soft_cap, deterministic = ctx.options
    if d_out is None:
        d_out = torch.zeros_like(out)
    d_lse = None if d_lse is None else d_lse.contiguous()
    dq, dk, dv = GRAD(q, k, v, out, _rows(d_out), lse, d_lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale,
                      left, right, alibi_slopes, soft_cap, deterministic)
    return (dq, dk, dv) + (None,) * 15   # no gradient for the lengths, options, block_table, seqused_k, descales


@constant_result
def _register() -> bool:
    """The autograd formula; the ops and their Meta kernels come with the extension. A constant
    to torch.compile: a registration runs eagerly where the first call of a process is traced."""
    OP.register_autograd(_backward, _setup_context)
    return True


PADDED, VARLEN = "flash_attention", "flash_attention_varlen"  # the entry points' names, which errors start with


def _fail(msg: str, op: str = PADDED):
    raise ValueError(f"{op}: {msg}")


def _check_tensor(name: str, t, q: Optional[torch.Tensor], op: str = PADDED) -> None:
    check_tensor(op, name, t, q)


def _check_qkv(q, k, v, rank: int, layout: str, op: str = PADDED) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, q if name != "q" else None, op)
        if t.dtype not in SUPPORTED_DTYPES + FP8_DTYPES:
            _fail(op=op, msg=f"{name} has dtype {t.dtype}; supported: float16, bfloat16 (fp32 softmax and accumulation "
                  f"inside; fp32 inputs are not supported by the tensor-core kernels), and float8_e4m3fn for the "
                  f"forward")
        if t.dtype != q.dtype:
            _fail(op=op, msg=f"{name} has dtype {t.dtype} but q has {q.dtype}")
        if t.dim() != rank:
            _fail(op=op, msg=f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            _fail(op=op, msg=f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    if k.shape[-1] != q.shape[-1]:
        _fail(op=op, msg=f"k has head size {k.shape[-1]} but q has D={q.shape[-1]}")
    if k.shape != v.shape:
        _fail(op=op, msg=f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}")
    Hq, Hkv = q.shape[-2], k.shape[-2]
    if Hkv < 1 or Hq % Hkv:
        _fail(op=op, msg=f"Hq={Hq} is not a multiple of Hkv={Hkv} (q {tuple(q.shape)}, k {tuple(k.shape)})")


def _window(causal: bool, window, op: str = PADDED) -> tuple[int, int]:
    """(left, right) with -1 for an unbounded side; causal caps right at 0."""
    if window is None:
        left, right = -1, -1
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            _fail(op=op, msg=f"window must be a (left, right) pair of ints (-1: unbounded), got {window!r}")
        left, right = (int(w) for w in window)
        if left < -1 or right < -1:
            _fail(op=op, msg=f"window sizes must be >= 0, or -1 for unbounded, got {window!r}")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _extras(q, alibi_slopes, soft_cap, scale, op: str = PADDED):
    Hq, D = q.shape[-2], q.shape[-1]
    scale = D ** -0.5 if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        _fail(op=op, msg=f"scale must be finite and > 0, got {scale}")
    soft_cap = 0.0 if soft_cap is None else float(soft_cap)
    if not (math.isfinite(soft_cap) and soft_cap >= 0):
        _fail(op=op, msg=f"soft_cap must be a finite number >= 0 (0 or None: no cap), got {soft_cap}")
    if alibi_slopes is not None:
        _check_tensor("alibi_slopes", alibi_slopes, q, op)
        if alibi_slopes.shape != (Hq,) or not alibi_slopes.is_floating_point():
            _fail(op=op, msg=f"alibi_slopes must be a float [Hq={Hq}], got {alibi_slopes.dtype} {tuple(alibi_slopes.shape)}")
        alibi_slopes = alibi_slopes.to(torch.float32).contiguous()
    return scale, alibi_slopes, soft_cap


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """The kernels move 16-byte rows: t itself when its pointer and strides allow that, else a
    contiguous copy (a rare layout, e.g. a view starting mid-row)."""
    if t.device.type == "meta" or torch.compiler.is_compiling():  # data pointers do not trace; the op checks
        return t
    try:
        pointer = t.data_ptr()
    except RuntimeError:   # a fake or functional tensor (a traced backward); the op checks when it runs
        return t
    elems = 16 // t.element_size()
    ok = pointer % 16 == 0 and all(s % elems == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
    return t if ok else t.clone(memory_format=torch.contiguous_format)  # a fresh, aligned allocation


def _descales(q, B: int, Hkv: int, q_descale, k_descale, v_descale, op: str = PADDED) -> tuple:
    """The fp8 descale factors as the op takes them: None, or float32 tensors on q's device of one
    element or [B, Hkv] (B sequences); a Python number becomes a one-element tensor."""
    if q.dtype not in FP8_DTYPES:
        if any(f is not None for f in (q_descale, k_descale, v_descale)):
            _fail(op=op, msg=f"q_descale, k_descale and v_descale are taken with float8_e4m3fn q, k, v only; q is "
                  f"{q.dtype}")
        return None, None, None
    out = []
    for name, f in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if f is not None and not isinstance(f, torch.Tensor):
            f = torch.tensor([float(f)], dtype=torch.float32, device=q.device)
        if f is not None:
            _check_tensor(name, f, q, op)
            if f.dtype != torch.float32 or not (f.numel() == 1 or tuple(f.shape) == (B, Hkv)):
                _fail(op=op, msg=f"{name} must be float32 with one element or [B={B}, Hkv={Hkv}], got {f.dtype} "
                      f"{tuple(f.shape)}")
        out.append(f)
    return tuple(out)


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k) -> None:
    """The checks that read cu_seqlens (they synchronize): starts at 0, never decreasing, ends
    at the packed row count, and no sequence longer than the max it is launched for."""
    for name, cu, total, longest in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                     ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
        host = cu.tolist()
        if host[0] != 0:
            _fail(op=VARLEN, msg=f"{name}[0] = {host[0]}; it must be 0")
        lengths = [b - a for a, b in zip(host, host[1:])]
        bad = [i for i, n in enumerate(lengths) if n < 0]
        if bad:
            _fail(op=VARLEN, msg=f"{name} decreases at index {bad[0] + 1} ({host[bad[0]]} -> {host[bad[0] + 1]})")
        if host[-1] != total:
            _fail(op=VARLEN, msg=f"{name}[-1] = {host[-1]} does not match the {total} packed rows of "
                  f"{'q' if name.endswith('q') else 'k'}")
        if lengths and max(lengths) > longest:
            _fail(op=VARLEN, msg=f"{name} holds a sequence of {max(lengths)} rows, longer than max_seqlen "
                  f"{'q' if name.endswith('q') else 'k'} = {longest}")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: Optional[float] = None, window: Optional[Sequence[int]] = None,
                    alibi_slopes: Optional[torch.Tensor] = None, soft_cap: Optional[float] = None,
                    return_lse: bool = False, *, deterministic: bool = False, instance: Optional[str] = None,
                    q_descale=None, k_descale=None, v_descale=None):
    """Softmax attention, out = softmax(scale * q k^T + mask) v, per (batch, query head).

    q [B, Lq, Hq, D]; k, v [B, Lk, Hkv, D] with Hq a multiple of Hkv; fp16 or bf16. causal
    masks keys past each row's diagonal, aligned to the bottom-right corner when Lq != Lk;
    window=(left, right) keeps keys j with i + Lk - Lq - left <= j <= i + Lk - Lq + right
    (-1: unbounded side); alibi_slopes [Hq] subtracts slope * |i + Lk - Lq - j|; soft_cap
    applies cap * tanh(s / cap) before ALiBi. scale defaults to D ** -0.5. Returns out
    [B, Lq, Hq, D] in q's dtype, and with return_lse the natural-log log-sum-exp
    [B, Hq, Lq] fp32 (-inf for a row that sees no key; its output is zeros). Differentiable in
    q, k, v (and through lse); deterministic=True makes the backward add dq's parts in a fixed
    order, so gradients are bit-identical from run to run (at a cost, about 1.1-1.4x the backward
    below d256 on the H100: bench/flash_grad_deterministic.py).
    `instance` forces a compiled forward instance by name (benchmarks, tests).

    FP8: with float8_e4m3fn q, k, v the products run on fp8 tensor cores (fp32 accumulation, the
    softmax weights quantized to e4m3) and out is bfloat16. q_descale, k_descale, v_descale
    (float32, one element or [B, Hkv]; a number; None: 1) multiply q, k and v back to their
    values: scores are scale * q_descale * k_descale * (q . k), out is v_descale * (P v). No
    gradient; the lse is returned as for 16-bit inputs."""
    _check_qkv(q, k, v, 4, "[B, L, H, D]")
    if k.shape[0] != q.shape[0]:
        _fail(f"k has batch {k.shape[0]} but q has {q.shape[0]}")
    left, right = _window(causal, window)
    scale, alibi_slopes, soft_cap = _extras(q, alibi_slopes, soft_cap, scale)
    descales = _descales(q, q.shape[0], k.shape[2], q_descale, k_descale, v_descale)
    _register()
    args = (_aligned(q), _aligned(k), _aligned(v), None, None, q.shape[1], k.shape[1], scale, left, right,
            alibi_slopes, soft_cap, bool(deterministic), None, None, *descales)   # no block_table, seqused_k
    out, lse = _call(args, instance)
    return (out, lse) if return_lse else out


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           causal: bool = False, scale: Optional[float] = None,
                           window: Optional[Sequence[int]] = None, alibi_slopes: Optional[torch.Tensor] = None,
                           soft_cap: Optional[float] = None, return_lse: bool = False, *,
                           validate: bool = True, deterministic: bool = False, instance: Optional[str] = None,
                           q_descale=None, k_descale=None, v_descale=None):
    """flash_attention over packed sequences (flash-attn's varlen API): q [Tq, Hq, D], k, v
    [Tk, Hkv, D]; sequence b holds rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q (int32
    [B + 1]) and the matching rows of k, v; lengths 0 and 1 are legal. Returns out [Tq, Hq, D]
    and with return_lse the log-sum-exp [Hq, Tq]. validate=True reads cu_seqlens to check them
    (this synchronizes; pass False inside CUDA graphs). deterministic as flash_attention's; float8
    q, k, v and their descales ([B, Hkv]: one per sequence and kv head) as flash_attention's."""
    _check_qkv(q, k, v, 3, "[tokens, H, D]", VARLEN)
    B = None
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_tensor(name, cu, q, VARLEN)
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
            _fail(op=VARLEN, msg=f"{name} must be int32 [B + 1], got {cu.dtype} {tuple(cu.shape)}")
        if B is not None and cu.shape[0] - 1 != B:
            _fail(op=VARLEN, msg=f"cu_seqlens_q holds {B} sequences but cu_seqlens_k holds {cu.shape[0] - 1}")
        B = cu.shape[0] - 1
    for name, value, total in (("max_seqlen_q", max_seqlen_q, q.shape[0]), ("max_seqlen_k", max_seqlen_k, k.shape[0])):
        if not isinstance(value, int) or value < 0 or value > total:
            _fail(op=VARLEN, msg=f"{name} must be an int in [0, {total}] (the packed rows), got {value!r}")
    if validate:
        check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k)
    left, right = _window(causal, window, VARLEN)
    scale, alibi_slopes, soft_cap = _extras(q, alibi_slopes, soft_cap, scale, VARLEN)
    descales = _descales(q, B, k.shape[1], q_descale, k_descale, v_descale, VARLEN)
    _register()
    args = (_aligned(q), _aligned(k), _aligned(v), cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
            max_seqlen_q, max_seqlen_k, scale, left, right, alibi_slopes, soft_cap, bool(deterministic), None, None,
            *descales)
    out, lse = _call(args, instance)
    return (out, lse) if return_lse else out


def _call(args, instance: Optional[str]):
    return OP(*args) if instance is None else OP.forced(instance, *args)


def selected_instance(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The instance dispatch picks for [B, L, H, D] tensors ('' if none covers them)."""
    _check_qkv(q, k, v, 4, "[B, L, H, D]")
    _register()
    return OP.select(_aligned(q), _aligned(k), _aligned(v), None, None, q.shape[1], k.shape[1], q.shape[-1] ** -0.5,
                     -1, -1, None, 0.0, False, None, None, None, None, None)


def instance_head_size(name: str) -> int:
    """The head size an instance is built for, read from its name (codegen/instance.py)."""
    match = re.search(r"_d(\d+)_", name)
    if match is None or not name.startswith("flash_attention_"):
        raise ValueError(f"{name!r} is not a flash_attention instance name")
    return int(match.group(1))


def cache_exponent_bits(name: str) -> int:
    """The exponent bits of the fp8 paged cache an instance reads (4 e4m3, 5 e5m2), read from its
    name; 0 for the instances that read k and v in q's dtype."""
    match = re.search(r"_kv_e(\d)_", name)
    return int(match.group(1)) if match else 0


def instances() -> list[str]:
    return OP.instances()
