"""Paged decode attention (vLLM paged_attention v1/v2, with GQA): the generated `paged_decode`
kernels as a torch op.

One query token per sequence (or Q <= 16 of them: speculative decoding, prefill tails) attends
over the first context_lens[s] tokens of its key/value cache, stored in pages of block_size
tokens that block_table[s] lists in order; the Q query tokens are the last Q of the context,
causal among themselves. The kernels
read the cache through the strides of its [blocks, block_size, Hkv, D] view, so both layouts
(NHD: that view; HND: [blocks, Hkv, block_size, D], transposed here without a copy) use the
same instances. Nothing on the launch path reads device memory, so a call can be captured in
a CUDA graph; `validate=True` adds the checks that must read the block table (they synchronize).
"""
from __future__ import annotations

import math
import re
from typing import Optional

import torch

from ._checks import check_tensor
from ._ops import Op, exported_constant

OP = Op("paged_decode")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
LAYOUTS = ("NHD", "HND")


def _fail(msg: str, op: str = "paged_decode"):
    raise ValueError(f"{op}: {msg}")


def _check_tensor(name: str, t, q: Optional[torch.Tensor]) -> None:
    check_tensor("paged_decode", name, t, q)


def cache_view(k_cache: torch.Tensor, kv_layout: str, name: str = "k_cache", op: str = "paged_decode") -> torch.Tensor:
    """The [blocks, block_size, Hkv, D] view of a cache held in `kv_layout` (no copy); errors
    name `op`, the entry point that was called (paged_decode or paged_attention)."""
    if kv_layout not in LAYOUTS:
        _fail(f"kv_layout must be one of {LAYOUTS}, got {kv_layout!r}", op)
    if k_cache.dim() != 4:
        shape = "[num_blocks, block_size, Hkv, D]" if kv_layout == "NHD" else "[num_blocks, Hkv, block_size, D]"
        _fail(f"{name} must be 4-D {shape} (kv_layout={kv_layout}), got shape {tuple(k_cache.shape)}", op)
    return k_cache if kv_layout == "NHD" else k_cache.transpose(1, 2)


def check_inputs(q, k_cache, v_cache, block_table, context_lens, alibi_slopes, soft_cap, scale,
                 kv_layout: str, k_scale=None, v_scale=None):
    """Shape, dtype and device checks that need no device memory; returns the NHD views."""
    _check_tensor("q", q, None)
    if q.dim() not in (3, 4):
        _fail(f"q must be [S, Hq, D] or [S, Q, Hq, D], got shape {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        _fail(f"q has dtype {q.dtype}; supported: float32, float16, bfloat16")
    S, Hq, D = q.shape[0], q.shape[-2], q.shape[-1]   # the op checks the number of query tokens
    views = []
    fp8 = isinstance(k_cache, torch.Tensor) and k_cache.dtype in FP8_CACHE_DTYPES
    if fp8 and q.dtype == torch.float32:
        _fail(f"an fp8 cache (k_cache {k_cache.dtype}) needs a float16 or bfloat16 q, got {q.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, cache, q)
        if cache.dtype != (k_cache.dtype if fp8 else q.dtype):
            _fail(f"{name} has dtype {cache.dtype} but {'k_cache' if fp8 else 'q'} has "
                  f"{k_cache.dtype if fp8 else q.dtype} (the cache holds q's dtype, or float8_e4m3fn / float8_e5m2 "
                  "for both K and V)")
        view = cache_view(cache, kv_layout, name)
        if view.shape[3] != D:
            _fail(f"{name} has head size {view.shape[3]} (shape {tuple(cache.shape)}, kv_layout={kv_layout}) "
                  f"but q has D={D}")
        views.append(view)
    k, v = views
    if k.shape != v.shape:
        _fail(f"k_cache has shape {tuple(k_cache.shape)} but v_cache has {tuple(v_cache.shape)}")
    block_size, Hkv = k.shape[1], k.shape[2]
    if block_size < 1 or block_size & (block_size - 1):
        _fail(f"block_size {block_size} is not a power of two (k_cache shape {tuple(k_cache.shape)}, "
              f"kv_layout={kv_layout})")
    if Hkv < 1 or Hq % Hkv:
        _fail(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    _check_tensor("block_table", block_table, q)
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != S:
        _fail(f"block_table must be int32 [S={S}, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    _check_tensor("context_lens", context_lens, q)
    if context_lens.dtype != torch.int32 or context_lens.shape != (S,):
        _fail(f"context_lens must be int32 [S={S}], got {context_lens.dtype} {tuple(context_lens.shape)}")
    if alibi_slopes is not None:
        _check_tensor("alibi_slopes", alibi_slopes, q)
        if alibi_slopes.shape != (Hq,) or not alibi_slopes.is_floating_point():
            _fail(f"alibi_slopes must be a float [Hq={Hq}], got {alibi_slopes.dtype} {tuple(alibi_slopes.shape)}")
    if not (soft_cap >= 0 and math.isfinite(soft_cap)):
        _fail(f"soft_cap must be a finite number >= 0 (0 or None: no cap), got {soft_cap}")
    if not math.isfinite(scale):
        _fail(f"scale must be finite, got {scale}")
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None:
            continue
        if not fp8:
            _fail(f"{name} is given but the cache is {k_cache.dtype}; scales go with an fp8 cache")
        _check_tensor(name, x, q)
        if x.dtype != torch.float32 or x.dim() != 1 or x.shape[0] not in (1, Hkv):
            _fail(f"{name} must be a float32 [1] or [Hkv={Hkv}], got {x.dtype} {tuple(x.shape)}")
    return k, v


def validate_block_table(k: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                         op: str = "paged_decode") -> None:
    """The checks that read device memory (they synchronize): every context fits the block
    table, and every block-table entry a context uses names a block of the cache."""
    num_blocks, block_size = k.shape[0], k.shape[1]
    capacity = block_table.shape[1] * block_size
    lens = context_lens.long()
    bad_len = (lens < 0) | (lens > capacity)
    if bad_len.any():
        s = int(bad_len.nonzero()[0, 0])
        _fail(f"context_lens[{s}] = {int(lens[s])} is outside [0, {capacity}] (the block table holds "
              f"{block_table.shape[1]} blocks of {block_size} tokens)", op)
    used = torch.arange(block_table.shape[1], device=block_table.device) < ((lens + block_size - 1) // block_size)[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bad.any():
        s, j = (int(i) for i in bad.nonzero()[0])
        _fail(f"block_table[{s}, {j}] = {int(block_table[s, j])} is outside [0, {num_blocks}) "
              f"(used by context_lens[{s}] = {int(lens[s])})", op)


def _prepare(q, k_cache, v_cache, block_table, context_lens, scale, alibi_slopes, soft_cap, kv_layout, validate,
             k_scale=None, v_scale=None, checked=True):
    """The op's arguments. checked=False leaves the checks to the op (its bindings make the same
    ones on the NHD views); the caller runs check_inputs if the op then raises (_run)."""
    soft_cap = 0.0 if soft_cap is None else float(soft_cap)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if checked or validate:
        k, v = check_inputs(q, k_cache, v_cache, block_table, context_lens, alibi_slopes, soft_cap, scale, kv_layout,
                            k_scale, v_scale)
    else:
        k, v = (cache_view(c, kv_layout, name) for c, name in ((k_cache, "k_cache"), (v_cache, "v_cache")))
    if validate:
        validate_block_table(k, block_table, context_lens)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(torch.float32).contiguous()
    k_scale, v_scale = (None if x is None else x.contiguous() for x in (k_scale, v_scale))
    return (q, k, v, block_table, context_lens, scale, alibi_slopes, soft_cap, k_scale, v_scale)


def _run(op, q, k_cache, v_cache, block_table, context_lens, scale, alibi_slopes, soft_cap, kv_layout, validate,
         k_scale, v_scale):
    """op(*args): eagerly, the op's own checks first and the layout-aware Python ones only when it
    raises (they named the problem in the caller's terms, and cost about a quarter of an eager
    call's host time: bench/results/h100/paged_host.md); while tracing, the Python checks first."""
    raw = (q, k_cache, v_cache, block_table, context_lens, scale, alibi_slopes, soft_cap, kv_layout, validate,
           k_scale, v_scale)
    if torch.compiler.is_compiling():
        return op(*_prepare(*raw))
    try:
        return op(*_prepare(*raw, checked=False))
    except Exception:
        _prepare(*raw)   # raises the Python checks' message where they find the problem
        raise


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: Optional[float] = None, *,
                 alibi_slopes: Optional[torch.Tensor] = None, soft_cap: Optional[float] = None,
                 kv_layout: str = "NHD", validate: bool = False, k_scale: Optional[torch.Tensor] = None,
                 v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode attention over a paged KV cache.

    q [S, Hq, D], or [S, Q, Hq, D] for Q <= 16 query tokens per sequence: token i sits at
    position context_lens[s] - Q + i and sees the cache up to it (causal); k_cache, v_cache [num_blocks, block_size, Hkv, D] (kv_layout="NHD") or
    [num_blocks, Hkv, block_size, D] ("HND"); block_table [S, max_blocks] int32;
    context_lens [S] int32. Query head h reads kv head h // (Hq // Hkv). scale defaults to
    D ** -0.5; soft_cap applies cap * tanh(score / cap); alibi_slopes [Hq] adds
    slope * (t - position). An fp8 cache (float8_e4m3fn or float8_e5m2, with a float16 or
    bfloat16 q, as vLLM's kv_cache_dtype="fp8") holds K / k_scale and V / v_scale: k_scale and
    v_scale are float32 [1] (per tensor) or [Hkv] (per kv head), 1 when omitted. Returns out
    shaped as q, in q's dtype (zeros where a query sees no token). validate=True checks the block table's entries and the context
    lengths first (this synchronizes; leave it off inside CUDA graphs)."""
    return _run(OP, q, k_cache, v_cache, block_table, context_lens, scale, alibi_slopes, soft_cap, kv_layout, validate,
                k_scale, v_scale)


def paged_decode_with(instance: str, q, k_cache, v_cache, block_table, context_lens, scale=None, *,
                      alibi_slopes=None, soft_cap=None, kv_layout="NHD", k_scale=None, v_scale=None):
    """paged_decode through the named instance (benchmarks, tests); an error if it does not cover the call."""
    return _run(lambda *args: OP.forced(instance, *args), q, k_cache, v_cache, block_table, context_lens, scale,
                alibi_slopes, soft_cap, kv_layout, False, k_scale, v_scale)


def selected_instance(q, k_cache, v_cache, block_table, context_lens, kv_layout="NHD") -> str:
    """The instance dispatch picks for these tensors ('' if none covers them)."""
    return OP.select(*_prepare(q, k_cache, v_cache, block_table, context_lens, None, None, None, kv_layout, False))


def max_query_tokens() -> int:
    """The most query tokens per sequence the decode kinds take, as the extension was built."""
    return exported_constant("paged_decode_max_query_tokens")


def instance_heads(name: str) -> int:
    """Query rows one CTA of instance `name` serves, read from the name, which spells every
    compile-time parameter (codegen/instance.py): the GQA packing `heads` of the CUDA-core
    kinds, 16 * mt (query token, head) rows of grouped_mma."""
    match = re.search(r"_heads(\d+)_", name) or re.search(r"_grouped_mma_.*_mt(\d+)_", name)
    if match is None:
        raise ValueError(f"{name!r} is not a paged_decode instance name")
    return int(match.group(1)) * (16 if "_grouped_mma_" in name else 1)


def instances() -> list[str]:
    return OP.instances()
