"""The delta_rule_grad family: the delta-rule backward in RWKV-7's form
(templates/delta_rule_grad/recurrent_grad.cu.j2, specs/delta_rule_grad.yaml).

The kernel keeps the forward's layout (`cols` value columns per CTA, `tph` lanes per column,
k / tph of a column's keys per lane as float4 groups) for the state and its adjoint, stages the
key-side vectors of `sub` steps as floats, keeps those steps' states in shared memory, and
meets the per-column terms of the key-side gradients in a warp reduce-scatter and per-warp rows.
"""
from __future__ import annotations

from ..arch import MAX_REGS, Arch
from ..instance import KernelInstance
from ..passes import Rejected, banks, is_pow2
from ..passes import tiles as shared_tiles
from . import Family, Lowering, TunePlan
from .delta_rule import (RECORD_CONSTANTS, CHECKPOINT_EVERY, RWKV7_CHUNK, RWKV7_PRODUCT_SPREAD, _renamed,
                         rwkv7_fp32_pitches, value_row_copy)

GRAD = "delta_rule_grad/recurrent_grad.cu.j2"
CHUNKED_GRAD = "delta_rule_grad/chunked_rwkv7_grad.cu.j2"
VECTORS = 5  # q, exp(w), k, a, b staged; dq, dw, dk, da, db reduced
# Registers per thread besides the state, its adjoint and one gradient's terms (3 k / tph):
# the step's scalars, addresses and staged operands in flight.
REG_OVERHEAD = 48


def _lower_grad(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p = inst.p
    k, cols, tph, sub = (p[name] for name in ("k", "cols", "tph", "sub"))
    if not is_pow2(tph) or tph > 32:
        raise Rejected("tph", f"tph={tph} must be a power of two <= 32 (a column's lanes reduce by warp shuffles)")
    if k % (4 * tph):
        raise Rejected("tph", f"k={k} is not a multiple of 4 * tph = {4 * tph} (each lane holds float4 groups)")
    ept = k // tph
    warp_cols = 32 // tph
    groups = ept // 4
    # The reduce-scatter halves a lane's entries per column bit down to one float4 group
    # (templates/delta_rule_grad/recurrent_grad.cu.j2, reduce_scatter), then sums the rest.
    halvings = min(warp_cols.bit_length() - 1, groups.bit_length() - 1)
    repeats = warp_cols.bit_length() - 1 - halvings
    if not is_pow2(groups):
        raise Rejected("tph", f"k / tph = {ept} entries per lane: the float4 groups ({groups}) must be a power of two "
                              f"(the reduce-scatter halves them)")
    regs = 3 * ept + REG_OVERHEAD
    if regs > MAX_REGS:
        raise Rejected("tph", f"about {regs} registers per thread (3 x {ept} floats) exceed {MAX_REGS}")
    threads = cols * tph
    if threads % 32:
        raise Rejected("cols", f"cols={cols} x tph={tph} = {threads} threads must be whole warps")
    if not is_pow2(sub) or CHECKPOINT_EVERY % sub:
        raise Rejected("sub", f"sub={sub} must be a power of two dividing the checkpoint interval {CHECKPOINT_EVERY}")
    warps = threads // 32
    floats = sub * (VECTORS * k + 2 * cols + k * cols + warps * VECTORS * k)
    smem = 4 * floats
    if smem > arch.max_smem_per_block:
        raise Rejected("sub", f"{smem} bytes of shared memory exceed the {arch.max_smem_per_block} of a block")
    # Shared memory: staging by consecutive threads; key vectors read as float4, a column's lanes
    # at consecutive words, the warp's other columns at the same ones (a broadcast); a thread's
    # own float4 of a state; the reduce-scatter's survivors of lane (c, l) at the keys of entries
    # c * share .. of lane l.
    kept = ept >> halvings

    def partial_write(lane, _pad):  # a writing lane's first kept entry (Lane::key)
        c, l = lane // tph, lane % tph
        if c % (1 << repeats):
            return None
        gmask = (c >> repeats) * (groups >> halvings)
        return 4 * (4 * (gmask * tph + l))
    accesses = [
        banks.contiguous("key_fill", 4, ("keys",)), banks.contiguous("value_fill", 4, ("values",)),
        banks.Access("key_read", 16, lambda lane, _pad: (lane % tph) * 16, ("keys",)),
        banks.Access("value_read", 4, lambda lane, _pad: (lane // tph) * 4, ("values",)),
        banks.contiguous("state_write", 16, ("states",)), banks.contiguous("state_read", 16, ("states",)),
        banks.Access("partial_write", 4, partial_write, ("partial",)),
        banks.contiguous("partial_read", 4, ("partial",)),
    ]
    return inst.with_derived({
        "threads": threads, "smem_bytes": smem, "ept": ept, "groups": ept // 4,
        "log_warp_cols": warp_cols.bit_length() - 1, "halvings": halvings, "kept": kept, "bank": banks.model(accesses),
        "threads_param": "tph", "smem_param": "sub",
    })


def chunked_grad_bank(k: int, cols: int, threads: int) -> dict:
    """The chunked backward's shared-memory accesses: ldmatrix over its padded 16-bit tiles,
    cp.async fills, a lane per two adjacent key channels (step 1, and the row gradients' finish
    over the fragments' channel pairs), fp32 fragments, and a thread per value column over the
    scratch and the pair matrices (which every lane reads at once)."""
    chunk = RWKV7_CHUNK
    mat_pitch, xp, kp = rwkv7_fp32_pitches(k, cols)
    pk, pc, pd = shared_tiles.pitch(k, 0), shared_tiles.pitch(cols, 0), shared_tiles.pitch(4 * chunk, 0)
    layout_k, layout_c = shared_tiles.layout(k, 0), shared_tiles.layout(cols, 0)
    fragment = banks.fragment
    accesses = (
        _renamed(shared_tiles.bank_accesses(k, threads, layout_k),
                 {"ldmatrix": "row_ldmatrix", "cp_async_fill": "row_fill"}, ("raw", "decayed"))
        + _renamed(shared_tiles.bank_accesses(k, threads, layout_k), {"ldmatrix": "pair_ldmatrix"}, ("decayed",))
        + _renamed(shared_tiles.bank_accesses(cols, threads, layout_c),
                   {"ldmatrix": "state_ldmatrix", "cp_async_fill": "state_fill"}, ("states",))
        + _renamed(shared_tiles.bank_accesses(cols, threads, layout_c),
                   {"ldmatrix": "mix_ldmatrix", "cp_async_fill": "z_fill"}, ("mix",))
        + _renamed(shared_tiles.bank_accesses(4 * chunk, threads, shared_tiles.layout(4 * chunk, 0)),
                   {"ldmatrix": "dm_ldmatrix"}, ("dm",))
        + [# step 1 (rwkv7_chunk.cuh) and the key-side finish: a C fragment's channel pairs
           banks.Access("raw_pair_read", 4, fragment(pk, 2), ("raw",)),
           banks.Access("lc_pair_read", 8, fragment(kp, 4), ("scalars",)),
           banks.Access("dend_pair_read", 8, lambda lane, _pad: 2 * (lane % 4) * 4, ("scalars",)),
           banks.Access("drows_pair_access", 8, fragment(kp, 4), ("drows",)),
           banks.Access("dlc_pair_access", 8, fragment(xp, 4), ("scratch",)),
           banks.Access("decayed_pair_write", 4, fragment(pk, 2), ("decayed",)),
           banks.contiguous("dend_write", 8, ("scalars",)),
           banks.contiguous("key_write", 4, ("scalars",)),
           banks.Access("key_read", 4, lambda lane, _pad: (lane // 4) * 4, ("scalars",)),
           banks.Access("lc_pair_write", 8, fragment(kp, 4), ("scalars",)),
           banks.Access("lc_read", 4, lambda lane, _pad: (lane % 16) * kp * 4, ("scalars",)),
           banks.Access("raw_term_read", 2, lambda lane, _pad: (lane % 16) * pk * 2, ("raw",)),
           *value_row_copy(cols, "raw", "mix"),
           banks.Access("z_write", 2, lambda lane, _pad: lane * 2, ("mix",)),
           banks.Access("dy_write", 2, lambda lane, _pad: lane * 2, ("mix",)),
           banks.Access("mat_fragment_write", 8, fragment(mat_pitch, 4), ("mats",)),
           # a pair matrix (or its transpose) read as an A operand: a fragment's float2s
           banks.Access("mat_a_read", 8, fragment(mat_pitch, 4), ("mats",)),
           banks.Access("mat_term_write", 4, lambda lane, _pad: ((lane // 16) * mat_pitch + lane % 16) * 4, ("mats",)),
           banks.broadcast("mat_broadcast", 4, ("mats",)),
           # The transposed copies: lane (g, t) of a fragment writes [2t][g] (and [2t + 1][g]); a
           # lane per (t, j) pair past the spread, 16 j and 2 t a warp; every lane reads one row.
           banks.Access("mat_t_fragment_write", 4, lambda lane, _pad: (2 * (lane % 4) * mat_pitch + lane // 4) * 4,
                        ("mats",)),
           banks.Access("mat_t_term_write", 4, lambda lane, _pad: ((lane % 16) * mat_pitch + lane // 16) * 4, ("mats",)),
           banks.broadcast("mat_t_row_read", 16, ("mats",)),
           banks.broadcast("dmat_broadcast", 4, ("mats",)),
           banks.Access("scratch_fragment_write", 8, fragment(xp, 4), ("scratch",)),
           banks.Access("scratch_fragment_read", 8, fragment(xp, 4), ("scratch",)),
           banks.contiguous("scratch_column_read", 4, ("scratch",)),
           banks.Access("drows_fragment_write", 8, fragment(kp, 4), ("drows",)),
           # the row gradients out: 8 floats (two float4s) a lane, a quarter-warp's lanes 8 steps
           # of one 8-key piece
           banks.Access("drows_piece_read", 16, lambda lane, _pad: ((lane % 8) * kp + lane // 8 * 8) * 4, ("drows",)),
           banks.Access("dm_fragment_write", 4, fragment(pd, 2), ("dm",)),
           banks.Access("state_fragment_write", 4, fragment(pc, 2), ("states",)),
           banks.Access("state_fragment_read", 4, fragment(pc, 2), ("states",)),
           banks.contiguous("stash_access", 4, ("drows",)),
           # dw: a lane per key pair and quarter of the steps, the quarters 8 lanes apart
           banks.Access("dlc_quarter_read", 8, lambda lane, _pad: ((lane // 8) * 4 * xp + 2 * (lane % 8)) * 4, ("scratch",)),
           banks.Access("ddecay_pair_read", 8, lambda lane, _pad: 2 * (lane % 8) * 4, ("scalars",))])
    return banks.model(accesses)


def _lower_chunked_grad(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p = inst.p
    k, cols = p["k"], p["cols"]
    if inst.dtype_bytes != 2:
        raise Rejected("k", f"the chunked backward runs on tensor cores from 16-bit storage, not {inst.a['dtype']}")
    if k != 64 or cols != 64:
        raise Rejected("k", f"k={k}, cols={cols}: the template's four warps take 16 keys and 16 columns each (64, 64)")
    warps, chunk = k // 16, RWKV7_CHUNK
    if CHECKPOINT_EVERY % chunk:
        raise Rejected("k", f"checkpoints every {CHECKPOINT_EVERY} steps must fall on {chunk}-step chunks")
    pk, pc = shared_tiles.pitch(k, 0), shared_tiles.pitch(cols, 0)
    window = CHECKPOINT_EVERY // chunk
    raw = chunk * (5 * pk + 2 * pc)
    dm = chunk * shared_tiles.pitch(4 * chunk, 0)  # the pair matrices' gradients, bf16 side by side
    # The chunk's start state and G in shared memory; the window's other start states in a
    # global workspace, the fp32 stash of G over the row gradients: two CTAs per SM.
    mat_pitch, xp, kp = rwkv7_fp32_pitches(k, cols)
    smem = (2 * (raw + 3 * 2 * chunk * pk + 2 * 2 * chunk * pc + 2 * k * pc + dm)
            + 4 * (chunk * kp + 2 * k + 12 * chunk * mat_pitch + 3 * chunk * xp + 4 * chunk * kp))
    if smem > arch.max_smem_per_block:
        raise Rejected("k", f"{smem} bytes of shared memory exceed a CTA's {arch.max_smem_per_block}")
    return inst.with_derived({
        "threads": 32 * warps, "warps": warps, "chunk": chunk, "smem_bytes": smem,
        "mat_pitch": mat_pitch, "xp": xp, "kp": kp,
        "ctas_per_sm": min(2, arch.smem_per_sm // (smem + arch.smem_reserved_per_cta)),
        "product_spread": RWKV7_PRODUCT_SPREAD,
        "product_spread_why": "codegen/families/delta_rule.py RWKV7_PRODUCT_SPREAD says why",
        "bank": chunked_grad_bank(k, cols, 32 * warps), "threads_param": "k", "smem_param": "k",
    })


FAMILY = Family(
    name="delta_rule_grad",
    axes={"dtype": ("fp32", "fp16", "bf16")},
    lowerings={GRAD: Lowering({"k": "int", "cols": "int", "tph": "int", "sub": "int"}, _lower_grad),
               CHUNKED_GRAD: Lowering({"k": "int", "cols": "int"}, _lower_chunked_grad)},
    support_files={"delta_rule_grad/params.cuh.j2": "delta_rule_grad/params.cuh",
                   "delta_rule/column.cuh.j2": "delta_rule_grad/column.cuh",   # the forward's, in this namespace
                   "delta_rule/rwkv7_chunk.cuh.j2": "delta_rule_grad/rwkv7_chunk.cuh",  # the same
                   "delta_rule_grad/op_impl.h.j2": "delta_rule_grad/op_impl.h"},
    tune=TunePlan(("B", "H", "T", "K", "V"), None),
    jit_params={"K": "k"},
    support_constants=RECORD_CONSTANTS,
)
