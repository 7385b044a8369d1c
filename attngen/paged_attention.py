"""Attention over a paged KV cache for any number of query tokens per sequence: prefill,
chunked prefill onto a cached context, and batches mixing them with decode tokens.

The generated `flash_attention` kernels read k and v from the cache's pages (a block_table and
the keys of each sequence, as FlashAttention-3's page_table and seqused_k), so every forward
kind serves it: the Hopper warp-specialized kernels load each key tile inside a context as TMA
boxes of whole pages, and the tile where a context ends with cp.async (its rows past the end
zero-filled, so nothing outside the context reaches the output); the other kinds copy with
cp.async. q is packed [total_q, Hq, D] with cu_seqlens_q; the cache is what
`paged_decode` takes (NHD [blocks, block_size, Hkv, D] or HND [blocks, Hkv, block_size, D],
viewed as NHD without a copy), in q's dtype or in fp8 (float8_e4m3fn or float8_e5m2, with
k_scale / v_scale as vLLM's kv_cache_dtype="fp8"): an fp8 cache runs on the mma_sync_fp8_cache
kind, which widens each tile to q's dtype in shared memory. Query token i of sequence s sits at position
context_lens[s] - q_len[s] + i of its context and, with causal, sees the cache up to it.
Nothing on the launch path reads device memory (a call can be captured in a CUDA graph);
validate=True adds the checks that read cu_seqlens_q, context_lens and the block table.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import paged
from ._checks import check_tensor
from .flash_attention import SUPPORTED_DTYPES, _aligned, _call, _extras, _register, _window

NAME = "paged_attention"


def _fail(msg: str):
    raise ValueError(f"{NAME}: {msg}")


def _check(q, k, v, block_table, cu_seqlens_q, context_lens, max_seqlen_q, max_context_len, k_scale, v_scale) -> None:
    check_tensor(NAME, "q", q, None)
    for name, t in (("k_cache", k), ("v_cache", v), ("block_table", block_table), ("cu_seqlens_q", cu_seqlens_q),
                    ("context_lens", context_lens)):
        check_tensor(NAME, name, t, q)
    if q.dim() != 3:
        _fail(f"q must be packed [total_q, Hq, D], got shape {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        _fail(f"q has dtype {q.dtype}; supported: float16, bfloat16 (fp32 softmax and accumulation inside)")
    fp8 = k.dtype in paged.FP8_CACHE_DTYPES
    for name, t in (("k_cache", k), ("v_cache", v)):
        if t.dtype != (k.dtype if fp8 else q.dtype):
            _fail(f"{name} has dtype {t.dtype} but {'k_cache' if fp8 else 'q'} has {k.dtype if fp8 else q.dtype} (the "
                  "cache holds q's dtype, or float8_e4m3fn / float8_e5m2 for both K and V)")
        if t.shape[-1] != q.shape[-1]:
            _fail(f"{name} has head size {t.shape[-1]} but q has D={q.shape[-1]}")
    if k.shape != v.shape:
        _fail(f"k_cache has shape {tuple(k.shape)} but v_cache has {tuple(v.shape)}")
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None:
            continue
        if not fp8:
            _fail(f"{name} is given but the cache is {k.dtype}; scales go with an fp8 cache")
        check_tensor(NAME, name, x, q)
        if x.dtype != torch.float32 or x.dim() != 1 or x.shape[0] not in (1, k.shape[2]):
            _fail(f"{name} must be a float32 [1] or [Hkv={k.shape[2]}], got {x.dtype} {tuple(x.shape)}")
    block_size = k.shape[1]
    if block_size < 8 or block_size & (block_size - 1):
        _fail(f"block_size must be a power of two, at least 8, got {block_size}")
    S = block_table.shape[0] if block_table.dim() == 2 else -1
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        _fail(f"block_table must be int32 [S, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}")
    for name, t, n in (("cu_seqlens_q", cu_seqlens_q, S + 1), ("context_lens", context_lens, S)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != n:
            _fail(f"{name} must be int32 [{n}] (block_table holds {S} sequences), got {t.dtype} {tuple(t.shape)}")
    if not isinstance(max_seqlen_q, int) or not 0 <= max_seqlen_q <= q.shape[0]:
        _fail(f"max_seqlen_q must be an int in [0, {q.shape[0]}] (the packed rows), got {max_seqlen_q!r}")
    if not isinstance(max_context_len, int) or not 0 <= max_context_len <= block_table.shape[1] * block_size:
        _fail(f"max_context_len must be an int in [0, {block_table.shape[1] * block_size}] (block_table's "
              f"{block_table.shape[1]} pages of {block_size}), got {max_context_len!r}")


def _validate(q, k, block_table, cu_seqlens_q, context_lens, max_seqlen_q, max_context_len) -> None:
    """The checks that read the index tensors (they synchronize)."""
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    if cu[0] != 0 or cu[-1] != q.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
        _fail(f"cu_seqlens_q must start at 0, never decrease and end at the {q.shape[0]} rows of q, got "
              f"{cu[:4]}{'...' if len(cu) > 4 else ''}{cu[-1:]}")
    for s, (q_len, n) in enumerate(zip((b - a for a, b in zip(cu, cu[1:])), lens)):
        if q_len > max_seqlen_q:
            _fail(f"sequence {s} has {q_len} query tokens, more than max_seqlen_q={max_seqlen_q}")
        if not q_len <= n <= max_context_len:
            _fail(f"context_lens[{s}] = {n}: it must hold the sequence's {q_len} query tokens (they are its last) and "
                  f"be at most max_context_len={max_context_len}")
    paged.validate_block_table(k, block_table, context_lens, NAME)   # every used entry names a block


def _decode_shaped(q, block_table, max_seqlen_q, causal, window, return_lse) -> bool:
    """A batch whose sequences all have the same Q query tokens, no more than the decode kinds
    take (total_q == S * max_seqlen_q says so without reading cu_seqlens_q), causal, with no
    window and no lse asked: paged_decode's kinds serve it. On the H100 they read the cache at
    2.54-2.62 TB/s where the prefill kernels read 0.71-0.73 (S 32-128, Q 1 and 4, D128 GQA 32/8;
    1.57x at S 4, Q 16: bench/results/h100/paged_attention.md, f0b5422): the prefill kernels
    read each kv head's pages once per query head of its group."""
    Q = max_seqlen_q
    return (causal and window is None and not return_lse and 0 < Q <= paged.max_query_tokens()
            and q.shape[0] == block_table.shape[0] * Q)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, max_seqlen_q: int,
                    max_context_len: int, causal: bool = True, scale: Optional[float] = None,
                    window: Optional[Sequence[int]] = None, alibi_slopes: Optional[torch.Tensor] = None,
                    soft_cap: Optional[float] = None, return_lse: bool = False, kv_layout: str = "NHD", *,
                    validate: bool = True, instance: Optional[str] = None, k_scale: Optional[torch.Tensor] = None,
                    v_scale: Optional[torch.Tensor] = None, num_decodes: int = 0, decode_query_tokens: int = 1):
    """Attention of packed query tokens over a paged KV cache.

    q [total_q, Hq, D] (sequence s holds rows cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1, int32
    [S + 1]); k_cache, v_cache in kv_layout (NHD [num_blocks, block_size, Hkv, D] or HND
    [num_blocks, Hkv, block_size, D]), fp16 or bf16 like q, or fp8 (float8_e4m3fn or float8_e5m2
    for both, holding K / k_scale and V / v_scale: k_scale, v_scale float32 [1] per tensor or [Hkv]
    per kv head, 1 when omitted), block_size a power of two from 8;
    block_table int32 [S, max_blocks]; context_lens int32 [S]: the tokens of each sequence in the
    cache, its new query tokens (the last q_len of them) included. max_seqlen_q and
    max_context_len bound the lengths (they size the grid). causal (default) lets query token i
    of sequence s see positions up to context_lens[s] - q_len + i; window, alibi_slopes, soft_cap
    and scale as flash_attention's. Returns out [total_q, Hq, D], and with return_lse the
    natural-log log-sum-exp [Hq, total_q] fp32, to merge with attention over other keys (cascade).
    A decode-shaped batch (every sequence the same number of query tokens, at most
    paged.max_query_tokens(), causal, no window, no lse) runs on paged_decode's kinds.
    num_decodes > 0 says that the first num_decodes sequences have decode_query_tokens query
    tokens each (at most paged.max_query_tokens()): the order serving engines keep a mixed batch
    in, decodes first, known on the host. Those run on paged_decode's kinds and the rest on the
    prefill kernels, two launches (causal, no window, no lse; otherwise the whole batch runs on
    the prefill kernels). validate=True checks the claim against cu_seqlens_q. No gradient: the
    cache is inference state."""
    k, v = (paged.cache_view(c, kv_layout, name, NAME) for c, name in ((k_cache, "k_cache"), (v_cache, "v_cache")))
    _check(q, k, v, block_table, cu_seqlens_q, context_lens, max_seqlen_q, max_context_len, k_scale, v_scale)
    _check_decodes(q, block_table, num_decodes, decode_query_tokens)
    if validate:
        _validate(q, k, block_table, cu_seqlens_q, context_lens, max_seqlen_q, max_context_len)
        _validate_decodes(cu_seqlens_q, num_decodes, decode_query_tokens)
    cache = dict(k_cache=k_cache, v_cache=v_cache, kv_layout=kv_layout, k_scale=k_scale, v_scale=v_scale)
    if instance is None and _decode_shaped(q, block_table, max_seqlen_q, causal, window, return_lse):
        return _decode(q, block_table, context_lens, max_seqlen_q, scale, alibi_slopes, soft_cap, cache)
    S = block_table.shape[0]
    if instance is None and num_decodes > 0 and causal and window is None and not return_lse:
        n, rows = num_decodes, num_decodes * decode_query_tokens
        head = _decode(q[:rows], block_table[:n], context_lens[:n], decode_query_tokens, scale, alibi_slopes, soft_cap,
                       cache)
        if n == S:   # every sequence a decode (where max_seqlen_q bounds more than their tokens)
            return head
        tail = _prefill(q[rows:], k, v, block_table[n:], cu_seqlens_q[n:] - rows, context_lens[n:],
                        min(max_seqlen_q, q.shape[0] - rows), max_context_len, causal, scale, window, alibi_slopes,
                        soft_cap, k_scale, v_scale, None)[0]
        return torch.cat([head, tail])
    out, lse = _prefill(q, k, v, block_table, cu_seqlens_q, context_lens, max_seqlen_q, max_context_len, causal, scale,
                        window, alibi_slopes, soft_cap, k_scale, v_scale, instance)
    return (out, lse) if return_lse else out


def _check_decodes(q, block_table, num_decodes, decode_query_tokens) -> None:
    S = block_table.shape[0]
    if not isinstance(num_decodes, int) or not 0 <= num_decodes <= S:
        _fail(f"num_decodes must be an int in [0, {S}] (the sequences of block_table), got {num_decodes!r}")
    if num_decodes == 0:
        return
    limit = paged.max_query_tokens()
    if not isinstance(decode_query_tokens, int) or not 1 <= decode_query_tokens <= limit:
        _fail(f"decode_query_tokens must be an int in [1, {limit}] (the decode kinds' most), got {decode_query_tokens!r}")
    rows = num_decodes * decode_query_tokens
    if rows > q.shape[0]:
        _fail(f"num_decodes={num_decodes} sequences of {decode_query_tokens} query tokens exceed q's {q.shape[0]} rows")
    if num_decodes == S and rows != q.shape[0]:
        _fail(f"num_decodes={num_decodes} is every sequence, but its {decode_query_tokens} query tokens each make {rows} "
              f"of q's {q.shape[0]} rows")


def _validate_decodes(cu_seqlens_q, num_decodes, decode_query_tokens) -> None:
    """num_decodes against the lengths (reads cu_seqlens_q: it synchronizes)."""
    if num_decodes == 0:
        return
    lens = (cu_seqlens_q[1:num_decodes + 1] - cu_seqlens_q[:num_decodes]).tolist()
    bad = next((s for s, n in enumerate(lens) if n != decode_query_tokens), None)
    if bad is not None:
        _fail(f"num_decodes={num_decodes} says sequences 0..{num_decodes - 1} have {decode_query_tokens} query tokens "
              f"each, but sequence {bad} has {lens[bad]}")


def _decode(q, block_table, context_lens, Q, scale, alibi_slopes, soft_cap, cache) -> torch.Tensor:
    """Sequences of Q query tokens each (q's rows in order) on paged_decode's kinds."""
    S = block_table.shape[0]
    out = paged.paged_decode(q.view(S, Q, *q.shape[1:]), cache["k_cache"], cache["v_cache"], block_table, context_lens,
                             scale, alibi_slopes=alibi_slopes, soft_cap=soft_cap, kv_layout=cache["kv_layout"],
                             k_scale=cache["k_scale"], v_scale=cache["v_scale"])
    return out.view(q.shape)


def _prefill(q, k, v, block_table, cu_seqlens_q, context_lens, max_seqlen_q, max_context_len, causal, scale, window,
             alibi_slopes, soft_cap, k_scale, v_scale, instance):
    """The batch on the flash_attention op's prefill kernels (k, v the caches' NHD views): (out, lse)."""
    left, right = _window(causal, window, NAME)
    scale, alibi_slopes, soft_cap = _extras(q, alibi_slopes, soft_cap, scale, NAME)
    _register()
    # The op takes descale factors of one element or [S, Hkv] (per sequence and kv head).
    S, Hkv = block_table.shape[0], k.shape[2]
    k_scale, v_scale = (x if x is None or x.numel() == 1 else x.view(1, Hkv).expand(S, Hkv) for x in (k_scale, v_scale))
    args = (_aligned(q), k, v, cu_seqlens_q.contiguous(), None, max_seqlen_q, max_context_len, scale, left, right,
            alibi_slopes, soft_cap, False, block_table, context_lens.contiguous(), None, k_scale, v_scale)
    return _call(args, instance)
