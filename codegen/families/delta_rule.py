"""The delta-rule family (RWKV-7, Gated DeltaNet): lowering of its kernels.

The recurrent template splits the state's value axis: `cols` value columns per CTA, `tph`
threads per column, each holding k / tph of the column's key entries in registers as float4
groups interleaved over the column's lanes (lane l holds keys 4 (g tph + l) .. + 3 of group g),
so the lanes of a column read consecutive 16-byte words of a staged key vector. The key-side
vectors of `chunk` steps (rwkv7: q, exp(w), k, a, b; gated_delta: q, k and the two per-step
scalars) and the CTA's value slice are staged in shared memory as floats.
"""
from __future__ import annotations

from ..arch import MAX_REGS, Arch
from ..instance import KernelInstance
from ..passes import Rejected, banks, is_pow2
from ..passes import tiles as shared_tiles
from ..passes.resources import smem_carveout
from . import Family, Lowering, TunePlan

RECURRENT = "delta_rule/recurrent.cu.j2"
CHUNKED = "delta_rule/chunked.cu.j2"
CHUNKED_RWKV7 = "delta_rule/chunked_rwkv7.cu.j2"
# With a gradient wanted, the forward saves its state every CHECKPOINT_EVERY steps: K*V fp32 per
# (b, h) per window, a third of what bf16 r, w, k, v, a, b of the window take at K = V = 64 (as
# flash-linear-attention's chunk kernels keep a state per 64 steps). The backward
# (specs/delta_rule_grad.yaml) rebuilds the states inside a window from it.
CHECKPOINT_EVERY = 64
CHECKPOINT_CONSTANTS = {"checkpoint_every": CHECKPOINT_EVERY,
                        "checkpoint_every_why": "codegen/families/delta_rule.py CHECKPOINT_EVERY says why"}
# Gated DeltaNet's chunk records (templates/delta_rule/chunk_prepare.cuh.j2: M, W, gc and the
# inverse T of each 64-step chunk, 16-bit matrices) as a training forward saves them for the
# backward, which then skips solving every chunk's system again (Params::records): a header
# word that says they are whole, then a record per (b, h, chunk).
SAVED_RECORD_BYTES = 3 * CHECKPOINT_EVERY * CHECKPOINT_EVERY * 2 + CHECKPOINT_EVERY * 4
# RWKV-7's chunked kind (templates/delta_rule/chunked_rwkv7.cu.j2): chunks of 16 steps, one
# m-tile; a warp per pair matrix, per 16 keys of the state and per 16 value columns: four warps,
# 64 keys (smaller heads are padded to them: its covers take K <= 64).
RWKV7_CHUNK = 16
RWKV7_CHUNK_KEYS = 64
RWKV7_CTAS_PER_SM = 2  # the forward's residency: _lower_chunked_rwkv7 says why
# RWKV-7's records (16-bit, the chunked_rwkv7 kinds): the header, then the state before every
# RWKV7_CHUNK-step chunk in bf16, [K, V] per (b, h, chunk). The backward then reads each chunk's
# start state instead of rebuilding a window's from its fp32 checkpoint (a quarter of its
# stall samples on the H200 at B8 T4096 H64 K=V=64, Nsight Compute at 0e9daa1); the fp32
# checkpoints are still written, for the backward kinds that read them. Only heads of at most
# RWKV7_CHUNK_KEYS keys get them (attngen.delta_rule.saves_records): no kind fills them past it.
RECORD_CONSTANTS = {**CHECKPOINT_CONSTANTS, "saved_record_bytes": SAVED_RECORD_BYTES, "records_header_bytes": 16,
                    "records_valid": "0x01010101u", "rwkv7_record_chunk": RWKV7_CHUNK,
                    "rwkv7_record_keys": RWKV7_CHUNK_KEYS}

# Per variant: the C++ step struct of templates/delta_rule/recurrent.cu.j2, the key-side
# vectors staged per step (K floats each) and the per-step scalars.
VARIANTS = {
    "rwkv7": {"struct": "Rwkv7", "vectors": 5, "scalars": 0},
    "gated_delta": {"struct": "GatedDelta", "vectors": 2, "scalars": 2},
}
# Registers per thread besides the state: the reduction, addresses, the loop and the staged
# operands in flight (ptxas has the last word; the compile tier checks its report for spills).
REG_OVERHEAD = 48


def _lower_recurrent(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p = inst.p
    k, cols, tph, chunk = (p[name] for name in ("k", "cols", "tph", "chunk"))
    variant = VARIANTS[inst.a["variant"]]
    if not is_pow2(tph) or tph > 32:
        raise Rejected("tph", f"tph={tph} must be a power of two <= 32 (a column's lanes reduce by warp shuffles)")
    if k % (4 * tph):
        raise Rejected("tph", f"k={k} is not a multiple of 4 * tph = {4 * tph} (each lane holds float4 groups)")
    if CHECKPOINT_EVERY % chunk:
        raise Rejected("chunk", f"chunk={chunk} must divide the checkpoint interval {CHECKPOINT_EVERY}")
    ept = k // tph
    regs = ept + REG_OVERHEAD
    if regs > MAX_REGS:
        raise Rejected("tph", f"about {regs} registers per thread ({ept} state floats) exceed {MAX_REGS}")
    threads = cols * tph
    if threads % 32 or 32 % tph:
        raise Rejected("cols", f"cols={cols} x tph={tph} = {threads} threads must be whole warps")
    # The scalars padded to a float4, so every staged step (and its key vectors) stays 16-byte aligned.
    stage_floats = variant["vectors"] * k + -(-variant["scalars"] // 4) * 4
    smem = chunk * (stage_floats + cols) * 4
    # Shared memory: staging writes by consecutive threads; key vectors read as float4, a
    # column's lanes at consecutive 16-byte words and the warp's other columns at the same ones
    # (a broadcast); the value tile read per column (a warp's columns at consecutive floats).
    key_read = banks.Access("key_read", 16, lambda lane, _pad: (lane % tph) * 16, ("keys",))
    value_read = banks.Access("value_read", 4, lambda lane, _pad: (lane // tph) * 4, ("values",))
    accesses = [banks.contiguous("key_fill", 4, ("keys",)), banks.contiguous("value_fill", 4, ("values",)),
                key_read, value_read,
                banks.contiguous("norm_read", 4, ("keys",)), banks.contiguous("norm_write", 4, ("keys",))]
    if variant["scalars"]:
        accesses.append(banks.broadcast("scalar_read", 4, ("keys",)))
    return inst.with_derived({
        "threads": threads, "smem_bytes": smem, "ept": ept, "groups": ept // 4, "stage_floats": stage_floats,
        "variant_struct": variant["struct"], "bank": banks.model(accesses),
        "threads_param": "tph", "smem_param": "chunk",
    })


# The chunked kind (templates/delta_rule/chunked.cu.j2): chunks of CHUNKED_STEPS steps, one
# 16-step m-tile per row warp; a chunk's first state is a checkpoint (the same interval).
CHUNKED_STEPS = 64
ROW_WARPS = CHUNKED_STEPS // 16
PREP_THREADS = 32 * ROW_WARPS
# The first kernel's rows of A in fp32: 4 floats of padding keep them 16-byte aligned (float4
# reads) and move consecutive rows by 4 banks.
A_PITCH = CHUNKED_STEPS + 4
# Registers besides the walk's fp32 fragments (state, K S then U, Q S): operands, addresses, the
# loop (an estimate: ptxas reports 168-255 where it says 136-216; the compile tier holds every
# instance to no spills).
CHUNKED_REG_OVERHEAD = 88


def _renamed(accesses: list, names: dict, buffers: tuple) -> list:
    """tiles.bank_accesses' accesses under this template's tags (`names`: theirs -> ours)."""
    return [banks.Access(names[a.name], a.width, a.address, buffers) for a in accesses if a.name in names]


def chunked_bank(k: int, cols: int, swizzle_k: int, swizzle_c: int, swizzle_m: int, threads: int) -> dict:
    """The chunked template's shared-memory accesses: the 16-bit tiles (q and k rows `k` wide;
    v, the state and the exchange tiles `cols` wide; M 64 wide) through ldmatrix, cp.async
    fills and 4-byte fragment reads and writes, and the fp32 scalars of both kernels."""
    def tile_accesses(make):
        return (_renamed(shared_tiles.bank_accesses(k, threads, make(k, swizzle_k)),
                         {"ldmatrix": "key_ldmatrix", "cp_async_fill": "row_fill"}, ("ring", "prep_keys"))
                + _renamed(shared_tiles.bank_accesses(cols, threads, make(cols, swizzle_c)),
                           {"ldmatrix": "col_ldmatrix", "o_fragment_write": "col_fragment",
                            "o_row_read": "col_row_read"},
                           ("ring", "state", "exchange"))
                + _renamed(shared_tiles.bank_accesses(CHUNKED_STEPS, threads, make(CHUNKED_STEPS, swizzle_m)),
                           {"ldmatrix": "mix_ldmatrix", "cp_async_fill": "mix_fill", "o_fragment_write": "prep_w_write",
                            "o_row_read": "mix_row_read"}, ("ring", "prep_m", "prep_a")))

    a_pitch = A_PITCH
    scalars = [
        banks.contiguous("gc_fill", 16, ("ring",)),
        # qk_l2norm: a thread per q or k row, in 16-byte pieces.
        banks.Access("norm_piece_read", 16, lambda lane, _pad: shared_tiles.tile_offset(lane, 0, k, swizzle_k) * 2,
                     ("ring", "prep_keys")),
        banks.Access("norm_piece_write", 16, lambda lane, _pad: shared_tiles.tile_offset(lane, 0, k, swizzle_k) * 2,
                     ("ring", "prep_keys")),
        banks.Access("gc_row_read", 4, lambda lane, _pad: (lane // 4) * 4, ("ring",)),
        banks.broadcast("gc_broadcast", 4, ("ring",)),
        banks.contiguous("prep_scalar_write", 4, ("prep_scalars",)),
        # M (and T) rounded into the M tile: a thread per row and 4 of every 8 columns, the two
        # threads of a row 16 columns apart.
        banks.Access("prep_t_row_read", 16, lambda lane, _pad: ((lane // 2) * a_pitch + 16 * (lane % 2)) * 4,
                     ("prep_keys",)),
        banks.Access("prep_beta_read", 16, lambda lane, _pad: 16 * (lane % 2) * 4, ("prep_scalars",)),
        banks.Access("prep_m_write", 8, lambda lane, _pad: shared_tiles.tile_offset(lane // 2, 16 * (lane % 2),
                                                                                     CHUNKED_STEPS, swizzle_m) * 2,
                     ("prep_m",)),
        banks.broadcast("prep_scalar_read", 4, ("prep_scalars",)),
        banks.Access("prep_row_read", 4, lambda lane, _pad: (lane // 4) * 4, ("prep_scalars",)),
        banks.Access("prep_column_read", 4, lambda lane, _pad: (lane % 4) * 8, ("prep_scalars",)),
        banks.Access("prep_a_write", 8, lambda lane, _pad: ((lane // 4) * a_pitch + 2 * (lane % 4)) * 4, ("prep_a",)),
        # The blocked inverse. Its diagonal blocks: a warp per 16 x 16 block, a lane per column
        # (lanes 16-31 sit out; every lane reads the same float4 of A's row). The blocks below:
        # 8 columns of a block column per warp, lane (quarter, c) on column c of rows
        # quarter + 4 r (A's and D's rows as float4, T's column by consecutive lanes).
        banks.Access("prep_a_read", 16, lambda lane, _pad: 0 if lane < 16 else None, ("prep_a",)),
        banks.Access("prep_t_write", 4, lambda lane, _pad: lane * 4 if lane < 16 else None, ("prep_keys",)),
        banks.Access("prep_rows_read", 16, lambda lane, _pad: (lane // 8) * a_pitch * 4, ("prep_a", "prep_keys")),
        banks.Access("prep_block_column_read", 4, lambda lane, _pad: (lane % 8) * 4, ("prep_keys",)),
        banks.Access("prep_column_write", 4, lambda lane, _pad: ((lane // 8) * a_pitch + lane % 8) * 4, ("prep_keys",)),
    ]
    return banks.model(tile_accesses(shared_tiles.layout) + scalars,
                       unpadded=tile_accesses(lambda d, _swizzle: shared_tiles.plain_layout(d)) + scalars)


# The first kernel's registers a thread (it is held to 65536 / (PREP_THREADS * its CTAs per SM)):
# 124-125 unbounded (ptxas at 68ea6a0). The forward's at k = 128 fits 96 without spills (5 CTAs an
# SM); at k = 64 it spills 28 bytes there, the backward's 44 (it also writes the inverse): those
# keep 128 (4 CTAs), as does any other k. At 96 the forward's first kernel went 0.222 -> 0.206 ms
# at B8 T4096 H16 K=V=128 bf16 (H200, with the walk's changes of 86ea255 beside it;
# bench/results/h100/gated_delta_balanced_rows_ab.md).
FORWARD_PREP_REGS, BACKWARD_PREP_REGS = {64: 128, 128: 96}, 128


def prepare_geometry(k: int, arch: Arch, prep_regs: int) -> dict:
    """The chunk records' first kernel (templates/delta_rule/chunk_prepare.cuh.j2, padded tiles):
    its threads, shared memory and CTAs per SM, for the forward's chunked kinds and the
    backward's (gated_delta_grad), at most `prep_regs` registers a thread. Its k and q tiles, M,
    A in fp32 (over the tiles where T and A both fit there), beta and gc."""
    steps = CHUNKED_STEPS
    pitch_k, pitch_m = shared_tiles.pitch(k, 0), shared_tiles.pitch(steps, 0)
    a_bytes = 4 * steps * A_PITCH
    a_over_tiles = 2 * 2 * steps * pitch_k >= 2 * a_bytes  # T and A both fit over the k and q tiles
    prep_smem = 2 * steps * (2 * pitch_k + pitch_m) + (0 if a_over_tiles else a_bytes) + 4 * 2 * steps
    prep_ctas_per_sm = min(arch.smem_per_sm // (prep_smem + arch.smem_reserved_per_cta),
                           arch.regs_per_sm // (PREP_THREADS * prep_regs), 8)
    return {"prep_threads": PREP_THREADS, "prep_smem_bytes": prep_smem, "chunk": steps, "a_pitch": A_PITCH,
            "a_over_tiles": "true" if a_over_tiles else "false", "prep_ctas_per_sm": prep_ctas_per_sm}


def _lower_chunked(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p = inst.p
    k, cols, warps, stages = (p[name] for name in ("k", "cols", "warps", "stages"))
    if inst.dtype_bytes != 2:
        raise Rejected("k", f"the chunked kind runs on tensor cores from 16-bit operands, not {inst.a['dtype']}")
    if inst.a["variant"] != "gated_delta":
        raise Rejected("k", f"the chunked kind solves Gated DeltaNet's scalar-decay chunks, not {inst.a['variant']}")
    if CHECKPOINT_EVERY != CHUNKED_STEPS:
        raise Rejected("k", f"a chunk of {CHUNKED_STEPS} steps must be the checkpoint interval {CHECKPOINT_EVERY}")
    if k % 16 or cols % 16:
        raise Rejected("k" if k % 16 else "cols", f"k={k} and cols={cols} must be multiples of 16 (MMA tiles)")
    if warps % ROW_WARPS or cols % (16 * (warps // ROW_WARPS)):
        raise Rejected("warps", f"{warps} warps: a multiple of {ROW_WARPS} (16 steps each), splitting cols={cols} "
                                "into blocks of 16")
    if stages < 1:
        raise Rejected("stages", f"stages={stages}: at least one chunk of input in shared memory")
    warps_m = min(warps, k // 16)
    warps_n = warps // warps_m
    if warps % warps_m or cols // 8 % warps_n or cols // 8 // warps_n % 2:
        raise Rejected("warps", f"{warps} warps do not split the {k} x {cols} state into 16 x 16 blocks")
    wcols = cols // (warps // ROW_WARPS)
    state = k * cols // (32 * warps)
    regs = state + wcols + CHUNKED_REG_OVERHEAD  # state, K S (then U) and Q S
    if regs > MAX_REGS:
        raise Rejected("cols", f"about {regs} registers per thread (state {state}, products {wcols}) exceed {MAX_REGS}")
    # Padded rows, not the XOR swizzle: a padded tile's fragment addresses are one base plus
    # compile-time offsets, where the swizzle's are a register each that the compiler hoists
    # out of the chunk loop (swizzled, every k = 128 instance spilled at 255 registers).
    swizzle_k = swizzle_c = swizzle_m = 0
    pitch_k, pitch_c = shared_tiles.pitch(k, swizzle_k), shared_tiles.pitch(cols, swizzle_c)
    steps = CHUNKED_STEPS
    pitch_m = shared_tiles.pitch(CHUNKED_STEPS, swizzle_m)
    # A stage: q, k, v, M and W in 16 bits, gc in fp32; then the state tile and three exchange
    # tiles. The first kernel: k, q (then T in fp32 over them) and M, A in fp32, beta, gc and
    # three 16 x 16 blocks of E in fp32.
    stage = 2 * steps * (2 * pitch_k + pitch_c + 2 * pitch_m) + 4 * steps
    smem = stages * stage + 2 * (k * pitch_c + 3 * steps * pitch_c)
    threads = 32 * warps
    if smem > arch.max_smem_per_block:
        raise Rejected("stages", f"{smem} bytes of shared memory exceed a CTA's {arch.max_smem_per_block}")
    if threads * max(regs, 64) > arch.regs_per_sm:
        raise Rejected("warps", f"{threads} threads of about {regs} registers exceed an SM's {arch.regs_per_sm}")
    ctas_per_sm = min(arch.smem_per_sm // (smem + arch.smem_reserved_per_cta),
                      arch.regs_per_sm // (threads * max(regs, 64)), 8)
    bank = chunked_bank(k, cols, swizzle_k, swizzle_c, swizzle_m, threads)
    return inst.with_derived({
        "threads": threads, "smem_bytes": smem, **prepare_geometry(k, arch, FORWARD_PREP_REGS.get(k, BACKWARD_PREP_REGS)),
        "warps_m": warps_m, "warps_n": warps_n, "ctas_per_sm": ctas_per_sm, "regs_estimate": regs,
        "swizzle_k": "true" if swizzle_k else "false", "swizzle_c": "true" if swizzle_c else "false",
        "swizzle_m": "true" if swizzle_m else "false",
        "bank": bank, "threads_param": "warps", "smem_param": "stages",
    })


# The pair matrices are products of x exp(lx) and y exp(-lc) while a chunk's decay spread
# max_c(-lc_C) is at most this: factors up to e^40 (2^58) times the inputs stay far inside
# bf16's and fp32's range (2^127) and their products inside fp32's; past it (decays below
# e^-2.5 a step, RWKV-7's own stay above e^-0.61) the kernel sums them term by term.
RWKV7_PRODUCT_SPREAD = 40.0


def value_row_copy(cols: int, src: str, dst: str) -> list:
    """The RWKV-7 chunked kinds' copy of a chunk's value-side rows (V, dO') from the raw tile `src`
    into a bf16 operand tile `dst`: 16-byte pieces, cols / 8 a row, both tiles `cols` + 8 wide."""
    pc = shared_tiles.pitch(cols, 0)

    def piece(lane, _pad):
        return ((lane // (cols // 8)) * pc + lane % (cols // 8) * 8) * 2

    return [banks.Access("v_copy_read", 16, piece, (src,)), banks.Access("v_copy_write", 16, piece, (dst,))]


def rwkv7_fp32_pitches(k: int, cols: int) -> tuple:
    """Floats between the rows of the chunked RWKV-7 kernels' fp32 tiles, which mma fragments
    write and read as float2s (banks.fragment_pitch): the 16 x 16 pair matrices, the tiles
    `cols` wide (X + L_ak V; the backward's scratch) and the tiles `k` wide (the cumulative
    decays; the backward's row gradients). Forward and backward alike."""
    return banks.fragment_pitch(RWKV7_CHUNK), banks.fragment_pitch(cols), banks.fragment_pitch(k)


def rwkv7_chunked_bank(k: int, cols: int, threads: int) -> dict:
    """The RWKV-7 chunked template's shared-memory accesses: ldmatrix over its padded 16-bit
    tiles (k or cols wide), cp.async fills of the ring, a thread per key channel over the
    chunk's rows (2 bytes a lane), fp32 fragments and a thread per value column over X, R and
    the pair matrices (whose reads every lane shares)."""
    pk, pc = shared_tiles.pitch(k, 0), shared_tiles.pitch(cols, 0)
    mat_pitch, xr_pitch, lc_pitch = rwkv7_fp32_pitches(k, cols)
    layout_k, layout_c = shared_tiles.layout(k, 0), shared_tiles.layout(cols, 0)
    rows_k = _renamed(shared_tiles.bank_accesses(k, threads, layout_k),
                      {"ldmatrix": "row_ldmatrix", "cp_async_fill": "row_fill"}, ("ring", "decayed"))
    pair = _renamed(shared_tiles.bank_accesses(k, threads, layout_k), {"ldmatrix": "pair_ldmatrix"}, ("decayed",))
    state = _renamed(shared_tiles.bank_accesses(cols, threads, layout_c),
                     {"ldmatrix": "state_ldmatrix", "o_row_read": "state_row_read"}, ("state",))
    # Z over V (V read in place in the ring where the inputs are bf16: the same layout)
    zv = (_renamed(shared_tiles.bank_accesses(cols, threads, layout_c), {"ldmatrix": "zv_ldmatrix"}, ("zv", "ring"))
          + _renamed(shared_tiles.bank_accesses(cols, threads, layout_c), {"o_row_read": "z_row_read"}, ("zv",)))
    pd = shared_tiles.pitch(4 * RWKV7_CHUNK, 0)
    pm = _renamed(shared_tiles.bank_accesses(4 * RWKV7_CHUNK, threads, shared_tiles.layout(4 * RWKV7_CHUNK, 0)),
                  {"ldmatrix": "pm_ldmatrix"}, ("pm",))
    accesses = rows_k + pair + state + zv + pm + [
        # Step 1 (rwkv7_chunk.cuh): a warp per 16 keys, a lane per C fragment's channel pairs
        banks.Access("raw_pair_read", 4, banks.fragment(pk, 2), ("ring",)),
        banks.Access("decayed_pair_write", 4, banks.fragment(pk, 2), ("decayed",)),
        banks.contiguous("dend_write", 8, ("scalars",)),
        banks.Access("lc_pair_write", 8, banks.fragment(lc_pitch, 4), ("scalars",)),
        banks.Access("mat_fragment_write", 8, banks.fragment(mat_pitch, 4), ("mats",)),
        # Decays past the products' range only: a lane per (t, j) pair, 2 rows t and 16 j a warp.
        banks.Access("lc_read", 4, lambda lane, _pad: (lane % 16) * lc_pitch * 4, ("scalars",)),
        banks.Access("raw_term_read", 2, lambda lane, _pad: (lane % 16) * pk * 2, ("ring",)),
        banks.Access("mat_term_write", 4, lambda lane, _pad: ((lane // 16) * mat_pitch + lane % 16) * 4, ("mats",)),
        banks.Access("xr_fragment_write", 8, banks.fragment(xr_pitch, 4), ("xr",)),
        banks.contiguous("xr_column_read", 4, ("xr",)),
        banks.broadcast("mat_broadcast", 4, ("mats",)),
        banks.Access("zv_write", 2, lambda lane, _pad: lane * 2, ("zv",)),
        # L_ak, N_rb, N_rk in bf16: a fragment's packed pairs, or a lane per (t, j) past the spread
        banks.Access("pm_fragment_write", 4, lambda lane, _pad: ((lane // 4) * pd + 2 * (lane % 4)) * 2, ("pm",)),
        banks.Access("pm_term_write", 2, lambda lane, _pad: ((lane // 16) * pd + lane % 16) * 2, ("pm",)),
        *value_row_copy(cols, "ring", "zv"),
        banks.Access("dend_read", 4, lambda lane, _pad: (lane // 4) * 4, ("scalars",)),
        banks.Access("state_fragment_write", 4, lambda lane, _pad: ((lane // 4) * pc + 2 * (lane % 4)) * 2,
                     ("state",)),
    ]
    return banks.model(accesses)


def _lower_chunked_rwkv7(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p = inst.p
    k, cols, stages = (p[name] for name in ("k", "cols", "stages"))
    if inst.dtype_bytes != 2:
        raise Rejected("k", f"the chunked kind runs on tensor cores from 16-bit storage, not {inst.a['dtype']}")
    if inst.a["variant"] != "rwkv7":
        raise Rejected("k", f"chunked_rwkv7 forms RWKV-7's per-channel-decay chunks, not {inst.a['variant']}")
    if k % 16 or cols % 16 or cols > k or k % cols:
        raise Rejected("cols", f"k={k} and cols={cols}: multiples of 16 (a warp per 16 keys, X and R in 16-column "
                               f"blocks), cols dividing k (the 2k threads shared evenly by the columns)")
    warps = k // 16
    if k != RWKV7_CHUNK_KEYS:
        raise Rejected("k", f"k={k}: the template's four warps are its four pair matrices (k = {RWKV7_CHUNK_KEYS})")
    if stages < 2:
        raise Rejected("stages", f"stages={stages}: at least two (the next chunk loads under this one)")
    if CHECKPOINT_EVERY % RWKV7_CHUNK:
        raise Rejected("k", f"checkpoints every {CHECKPOINT_EVERY} steps must fall on {RWKV7_CHUNK}-step chunks")
    threads = 32 * warps
    pk, pc = shared_tiles.pitch(k, 0), shared_tiles.pitch(cols, 0)
    steps = RWKV7_CHUNK
    mat_pitch, xr_pitch, lc_pitch = rwkv7_fp32_pitches(k, cols)
    raw = 2 * steps * (5 * pk + pc)
    pm = steps * shared_tiles.pitch(4 * steps, 0)  # L_ak, N_rb, N_rk in bf16 beside each other
    smem = (stages * raw + 2 * (4 * steps * pk + 2 * steps * pk + 2 * steps * pc + k * pc + pm)
            + 4 * (steps * lc_pitch + k + steps * mat_pitch + steps * xr_pitch))
    if smem > arch.max_smem_per_block:
        raise Rejected("stages", f"{smem} bytes of shared memory exceed a CTA's {arch.max_smem_per_block}")
    # Two CTAs an SM. Measured on an H200 (bench.rwkv7_kinds, bf16, the training forward; a build
    # of 199 registers), a third CTA an SM lost where 64 columns are the best width (B8 T4096
    # H64: 4.17 against 3.66 ms; 512 CTAs make 1.3 waves of three) and gained at most 1.3% where
    # narrower ones are (B2 T4096 H32: 16 columns 1.139 against 1.154 ms). ptxas (CUDA 13.0) now
    # fits the kernel in 163 registers (205 before each thread's load pieces were fixed and step 1
    # took channel pairs), which admits a third where shared memory does: the launcher holds
    # residency to two with the carveout (unheld, the forward took 2.519 against 2.040 ms at B8
    # T4096 H64; bench/results/h200/rwkv7_rows_ab.md).
    ctas_per_sm = min(arch.smem_per_sm // (smem + arch.smem_reserved_per_cta), RWKV7_CTAS_PER_SM)
    return inst.with_derived({
        "threads": threads, "warps": warps, "smem_bytes": smem, "chunk": steps, "ctas_per_sm": ctas_per_sm,
        "mat_pitch": mat_pitch, "xr_pitch": xr_pitch, "lc_pitch": lc_pitch,
        "smem_carveout": smem_carveout(ctas_per_sm, smem, arch, "stages"),
        "product_spread": RWKV7_PRODUCT_SPREAD,
        "product_spread_why": "codegen/families/delta_rule.py RWKV7_PRODUCT_SPREAD says why",
        "bank": rwkv7_chunked_bank(k, cols, threads), "threads_param": "k", "smem_param": "stages",
    })


def _tune_runtime(shape: dict, dtype_bytes: int, sm_count: int) -> dict:
    return {"K": shape["K"], "V": shape["V"], "T": shape["T"], "BH": shape["B"] * shape["H"], "align": 16 // dtype_bytes,
            "sm_count": sm_count}


FAMILY = Family(
    name="delta_rule",
    axes={"dtype": ("fp32", "fp16", "bf16"), "variant": ("rwkv7", "gated_delta")},
    lowerings={RECURRENT: Lowering({"k": "int", "cols": "int", "tph": "int", "chunk": "int"}, _lower_recurrent),
               CHUNKED: Lowering({"k": "int", "cols": "int", "warps": "int", "stages": "int"}, _lower_chunked),
               CHUNKED_RWKV7: Lowering({"k": "int", "cols": "int", "stages": "int"}, _lower_chunked_rwkv7)},
    support_files={"delta_rule/params.cuh.j2": "delta_rule/params.cuh",
                   "delta_rule/column.cuh.j2": "delta_rule/column.cuh",
                   "delta_rule/variants.cuh.j2": "delta_rule/variants.cuh",
                   "delta_rule/rwkv7_chunk.cuh.j2": "delta_rule/rwkv7_chunk.cuh",
                   "delta_rule/op_impl.h.j2": "delta_rule/op_impl.h"},
    tune=TunePlan(("B", "H", "T", "K", "V"), _tune_runtime, axes={"variant": "rwkv7"}),
    jit_params={"K": "k"},
    support_constants=RECORD_CONSTANTS,
    exported_constants={"delta_rule_checkpoint_every": "kCheckpointEvery",
                        "delta_rule_saved_record_bytes": "kSavedRecordBytes",
                        "delta_rule_records_header_bytes": "kRecordsHeaderBytes",
                        "delta_rule_records_valid": "kRecordsValid",
                        "delta_rule_rwkv7_record_chunk": "kRwkv7RecordChunk",
                        "delta_rule_rwkv7_record_keys": "kRwkv7RecordKeys"},
)
