"""FlashAttention backward: lowering of the softmax attention backward kernels
(templates/flash_attention_grad/backward.cu.j2, specs/flash_attention_grad.yaml).

`hopper` (backward_wgmma.cu.j2) computes the same products on Hopper's warpgroup MMAs: each
warpgroup owns 64 of the block's keys; S^T, dP^T and dQ read both operands from 128-byte-swizzled
shared tiles, dV and dK take P^T and dS^T from registers, and dS reaches shared memory through a
transposing stmatrix; dQ = dS K is split over the warpgroups by rows or columns, or
(`dq_by_keys`) each warpgroup adds the product over its own keys (`dq_exchange`: after handing
the other warpgroup the half of the columns it adds). `hopper_wide` (backward_wgmma_wide.cu.j2)
serves heads whose dK and dV overflow a warpgroup at 64 keys (d256): one 64-key block per CTA,
the warpgroups splitting dK, dV and dQ by columns, the first computing S^T and the second dP^T,
handed between them through shared memory. `mma_sync` is
FlashAttention-2's backward on m16n8k16: a CTA owns `block_n` keys and values of
one kv head and walks the `block_m`-row query tiles of every query head of its group that see
them (Q and dO through a `stages`-deep cp.async ring). Its `warps` warps form groups of `dsplit`
warps; a group owns 16-row m-tiles of the keys, computes S^T = K Q^T and dP^T = V dO^T for
them, and each warp of the group accumulates D / dsplit columns of dK and dV in registers (at
large D the group recomputes the scores rather than spill). dS^T goes through shared memory to
dQ = dS K, which every warp adds for its part of the tile to an fp32 scratch with atomics.
"""
from __future__ import annotations

from ..arch import MAX_REGS, WGMMA_N, Arch
from ..instance import KernelInstance
from ..passes import Rejected, banks
from ..passes.tiles import CHUNK, atoms_layout, layout, pitch, plain_layout
from . import Family, Lowering, TunePlan
from .flash_attention import _tune_runtime as forward_tune_runtime
from .flash_attention import MBARRIER_BYTES, check_ring_tiles, padded_tile_columns, register_split

BACKWARD = "flash_attention_grad/backward.cu.j2"
BACKWARD_WGMMA = "flash_attention_grad/backward_wgmma.cu.j2"
BACKWARD_WGMMA_WIDE = "flash_attention_grad/backward_wgmma_wide.cu.j2"
# Registers per thread besides dK, dV, S^T and dP^T: the operand fragments in flight (K, V, Q,
# dO: 16), addresses, the loop state (ptxas has the last word; the compile tier checks spills).
REG_OVERHEAD = 64


def _dq_warps_over_rows(block_m: int, warps: int, d: int) -> int | None:
    """How many of the warps split the query tile's rows for dQ (the rest split D): the most
    that leaves every warp whole 16-row m-tiles and whole 16-column steps of D."""
    for rows in range(min(warps, block_m // 16), 0, -1):
        if warps % rows == 0 and (block_m // 16) % rows == 0 and d % (warps // rows) == 0 \
                and (d // (warps // rows)) % 16 == 0:
            return rows
    return None


def _stats_accesses() -> list:
    """The per-row statistics: a quad's float2 of lse and delta, and their staging by thread."""
    return [banks.Access("stats_read", 8, lambda lane, _pad: lane % 4 * 8, ("stats",)),
            banks.contiguous("stats_write", 4, ("stats",))]


def _tile_accesses(d: int, rows_d, rows_s) -> list:
    """The warp accesses of the backward's tiles (rows_d: the offsets of the D-wide K, V, Q and
    dO tiles; rows_s: of the dS^T tile): ldmatrix phases (8 rows at one chunk; plain and
    transposed reads take the same addresses), the cp.async fill, dS^T's 4-byte fragment
    writes and transposed reads, the per-row statistics."""
    chunks = d // 8

    def ldmatrix(lane, _pad):
        return rows_d((lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8) * 2

    def fill(lane, _pad):
        return rows_d(lane // chunks, lane % chunks * 8) * 2

    def ds_write(lane, _pad):
        return rows_s(lane // 4, lane % 4 * 2) * 2

    def ds_read(lane, _pad):
        return rows_s((lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8) * 2

    return [banks.Access("ldmatrix", CHUNK, ldmatrix, ("kv_tiles", "q_ring")),
            banks.Access("ldmatrix_trans", CHUNK, ldmatrix, ("kv_tiles", "q_ring")),
            banks.Access("cp_async_fill", CHUNK, fill, ("kv_tiles", "q_ring")),
            banks.Access("ds_write", 4, ds_write, ("ds_tile",)),
            banks.Access("ds_read", CHUNK, ds_read, ("ds_tile",))] + _stats_accesses()


def _lower_backward(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p = inst.p
    d, block_n, block_m, warps, dsplit, stages, swizzle, minb = (
        p[k] for k in ("d", "block_n", "block_m", "warps", "dsplit", "stages", "swizzle", "minb"))
    if inst.dtype_bytes != 2:
        raise Rejected("d", f"tensor-core kinds take 16-bit operands, not {inst.a['dtype']}")
    if d % 16:
        raise Rejected("d", f"d={d} is not a multiple of 16 (the k-step of m16n8k16)")
    if warps % dsplit or d % (16 * dsplit):
        raise Rejected("dsplit", f"dsplit={dsplit}: it must divide warps={warps}, and d={d} into multiples of 16")
    groups = warps // dsplit
    if block_n % (16 * groups):
        raise Rejected("block_n", f"block_n={block_n} does not split into whole 16-row m-tiles over {groups} groups "
                                  f"of warps")
    if block_m % 16:
        raise Rejected("block_m", f"block_m={block_m} is not a multiple of 16 (the k-step of dV and dK)")
    check_ring_tiles(d, swizzle, stages)
    q_warps_m = _dq_warps_over_rows(block_m, warps, d)
    if q_warps_m is None:
        raise Rejected("warps", f"warps={warps} cannot split the dQ tile ({block_m} x {d}) into whole 16 x 16 steps")
    mt = block_n // (16 * groups)
    dw = d // dsplit
    regs = mt * 2 * dw // 2 + mt * block_m + REG_OVERHEAD
    if regs > MAX_REGS:
        raise Rejected("block_m", f"about {regs} registers per thread (dK and dV {mt * dw}, S^T and dP^T "
                                  f"{mt * block_m}) exceed {MAX_REGS}")
    threads = warps * 32
    if regs * threads * minb > arch.regs_per_sm:
        raise Rejected("minb", f"minb={minb} CTAs of {threads} threads at about {regs} registers exceed the "
                               f"{arch.regs_per_sm} registers of an SM")
    s_swizzle = int(block_m % 64 == 0)
    smem = (2 * block_n * pitch(d, swizzle) + stages * 2 * block_m * pitch(d, swizzle)) * 2 \
        + block_n * pitch(block_m, s_swizzle) * 2 + stages * 2 * block_m * 4
    if smem > arch.max_smem_per_block:
        raise Rejected("stages", f"{smem} bytes of shared memory exceed the {arch.max_smem_per_block} of a block")
    if minb * (smem + arch.smem_reserved_per_cta) > arch.smem_per_sm:
        raise Rejected("minb", f"minb={minb} CTAs of {smem} bytes of shared memory exceed the SM's {arch.smem_per_sm}")
    bank = banks.model(_tile_accesses(d, layout(d, swizzle), layout(block_m, s_swizzle)),
                       unpadded=_tile_accesses(d, plain_layout(d), plain_layout(block_m)))
    return inst.with_derived({
        "threads": threads, "smem_bytes": smem, "mt": mt, "groups": groups, "dw": dw, "q_warps_m": q_warps_m,
        "q_warps_d": warps // q_warps_m, "s_swizzle": s_swizzle, "regs_estimate": regs, "bank": bank,
        "threads_param": "warps", "smem_param": "stages",
    })


WGMMA_REG_OVERHEAD = 40   # addresses and loop state: the wgmma kernel reads no operand fragments
STAGE_PAD = 8   # floats after each staged dQ row: 16-byte rows, and 8 rows of float2 stores in two wavefronts
# dq_bulk 2's boxes: 64 rows (a warpgroup's dQ rows) of 32 floats, the 128-byte span of the tensor
# map's swizzle (tma::encode_fp32_rows); the template reads both from the lowering.
BOX_ROWS, BOX_COLS = 64, 32
# The producer warpgroup's registers after setmaxnreg (the rest go to the consumers: 232 each with
# two consumer warpgroups): it holds two row pointers and a row per copy loop.
PRODUCER_REGS = 32
# Deterministic, the producer also waits for each tile's dq turn: at 32 its variants spilled 28-48
# bytes, at 40 (consumers 224) 4-8 (ptxas, CUDA 13.0, d96 and d128); 48 leaves the consumers 224
# and builds clean.
PRODUCER_REGS_TAKING_TURNS = 48


def _wgmma_accesses(d: int, block_m: int, block_n: int, offset_d, offset_s, stage_pitch: int, box_swizzle: bool) -> list:
    """The thread accesses of the wgmma kernel's tiles (wgmma reads them itself): the cp.async
    fill of K, V, Q and dO, the transposing stmatrix of dS (lane 8i + j: row j of matrix i,
    query row 8 (i / 2) + j, keys from 8 (i % 2)), the per-row statistics, the staged dQ rows
    (lane 4r + c: float2 c of row r, rows `stage_pitch` floats apart) and dq_bulk 2's boxes
    (rows of 32 floats, 16-byte chunk k of row r at k ^ (r % 8) when `box_swizzle`)."""
    chunks = d // 8

    def fill(lane, _pad):
        return offset_d(lane // chunks, lane % chunks * 8) * 2

    def ds_write(lane, _pad):
        return offset_s((lane >> 4) * 8 + (lane & 7), ((lane >> 3) & 1) * 8) * 2

    def box(lane, _pad):
        return _box_store(lane, box_swizzle)

    # dq's exchange (the template holds it whether or not dq_exchange compiles it in): a float4
    # per thread, consecutive threads at consecutive 16 bytes.
    return [banks.Access("cp_async_fill", CHUNK, fill, ("kv_tiles", "q_ring")),
            banks.Access("ds_write", CHUNK, ds_write, ("ds_tile",)),
            banks.contiguous("dq_exchange_write", 16, ("dq_exchange",)),
            banks.contiguous("dq_exchange_read", 16, ("dq_exchange",)),
            banks.Access("dq_stage_write", 8, lambda lane, _pad: (lane // 4 * stage_pitch + lane % 4 * 2) * 4,
                         ("dq_stage",)),
            banks.Access("dq_box_write", 8, box, ("dq_stage",)),
            banks.Access("dq_box_read", 8, box, ("dq_stage",))] + _stats_accesses()   # deterministic: a sum onto the boxes


def _box_offset(row: int, col: int, swizzle: bool) -> int:
    """Float offset of (row, col) in a dq_bulk 2 box of 64 rows x 32 floats (backward_wgmma.cu.j2)."""
    chunk = col % BOX_COLS // 4
    return row * BOX_COLS + ((chunk ^ (row % 8)) if swizzle else chunk) * 4 + col % 4


def _box_store(lane: int, swizzle: bool) -> int:
    """Byte offset of a lane's float2 in a warp's first dq box store (store_box_row's step 0 in
    backward_common.cuh.j2; lane 4r + c: row r, floats 2c, 2c + 1 of tile 0, or of tile 2 on odd
    rows). Under the swizzle odd rows store tile j ^ 2: rows r and r ^ 1 would put tile j's chunks
    in the same slots."""
    row = lane // 4
    tile = row % 2 * 2 if swizzle else 0
    return _box_offset(row, tile * 8 + lane % 4 * 2, swizzle) * 4


def _lower_wgmma(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p = inst.p
    d, block_n, block_m, warpgroups, stages, minb, dq_by_keys, dq_exchange, dq_bulk, overlap, producer = (
        p[k] for k in ("d", "block_n", "block_m", "warpgroups", "stages", "minb", "dq_by_keys", "dq_exchange", "dq_bulk",
                       "overlap", "producer"))
    if not arch.name.endswith("a"):
        raise Rejected("d", f"wgmma needs an arch-specific target (sm_90a), not {arch.name}")
    if inst.dtype_bytes != 2:
        raise Rejected("d", f"tensor-core kinds take 16-bit operands, not {inst.a['dtype']}")
    cols = padded_tile_columns(d, "S^T and dP^T step")   # the tiles and dK, dV hold whole 64-column atoms
    if block_n != 64 * warpgroups:
        raise Rejected("block_n", f"block_n={block_n}: each of the {warpgroups} warpgroups owns 64 keys "
                                  f"(block_n = {64 * warpgroups})")
    if block_m % 64 or block_m not in WGMMA_N:
        raise Rejected("block_m", f"block_m={block_m}: whole 64-row blocks of dQ and a wgmma N of wgmma.cuh "
                                  f"({', '.join(map(str, WGMMA_N))})")
    if dq_by_keys not in (0, 1):
        raise Rejected("dq_by_keys", f"dq_by_keys={dq_by_keys}: 0 (the warpgroups split dQ's rows or columns) or 1 "
                                     f"(each adds the product over its own keys)")
    if dq_by_keys:
        if block_m != 64:
            raise Rejected("dq_by_keys", f"dq_by_keys=1 gives each warpgroup the whole {block_m}-row tile: one "
                                         f"64-row wgmma takes block_m = 64")
        dq_cols = cols
    else:
        dq_cols = block_m * cols // (warpgroups * 64)
        if block_m * cols % (warpgroups * 64) or dq_cols % 64 or dq_cols not in WGMMA_N or (block_m // 64) > warpgroups:
            raise Rejected("block_m", f"block_m={block_m}: dQ ({block_m} x {cols}) does not split into whole 64 x 64 "
                                      f"blocks over {warpgroups} warpgroups (dq_by_keys=1 splits the keys)")
    if dq_exchange not in (0, 1) or dq_exchange and not (dq_by_keys and warpgroups == 2 and dq_cols % 16 == 0):
        raise Rejected("dq_exchange", f"dq_exchange={dq_exchange}: 0, or 1 with dq_by_keys=1 and two warpgroups (the two "
                                      f"products swap halves of whole 8-column tiles)")
    if dq_bulk not in (0, 1, 2):
        raise Rejected("dq_bulk", f"dq_bulk={dq_bulk}: 2 (a warpgroup's dQ staged in 64 x 32 boxes, a tensor bulk reduction "
                                  f"each), 1 (dQ rows staged, a bulk reduction each) or 0 (every thread's atomics)")
    if overlap not in (0, 1):
        raise Rejected("overlap", f"overlap={overlap}: 0 or 1 (the next tile's scores during this tile's dQ atomics)")
    if producer not in (0, 1):
        raise Rejected("producer", f"producer={producer}: 1 (a producer warpgroup fills the ring) or 0 (every thread copies)")
    if producer and block_m != 64:
        raise Rejected("block_m", f"block_m={block_m} with producer=1: the producer stages a tile's lse and delta as "
                                  f"128 floats, 64 rows each (backward_producer.cuh); use block_m=64 or producer=0")
    if stages < (2 if producer else 2 + overlap):
        raise Rejected("stages", f"stages={stages}: the cp.async ring needs at least {2 + overlap}"
                                 f"{' when the next tile is read during this one' if overlap else ''}")
    threads = (warpgroups + producer) * 128
    # dK + dV, and S^T + dP^T (their packed A fragments, half as many, take their place)
    regs = cols + block_m + WGMMA_REG_OVERHEAD
    producer_regs, consumer_regs = register_split(warpgroups, minb, arch, PRODUCER_REGS) if producer else (0, MAX_REGS)
    turns_regs = register_split(warpgroups, minb, arch, PRODUCER_REGS_TAKING_TURNS) if producer else (0, MAX_REGS)
    if regs > consumer_regs:   # (the deterministic variants' 8 fewer: ptxas and the compile tier judge those)
        raise Rejected("block_m", f"about {regs} registers per thread (dK and dV {cols}, S^T and dP^T {block_m}) "
                                  f"exceed {consumer_regs}")
    if not producer and regs * threads * minb > arch.regs_per_sm:
        raise Rejected("minb", f"minb={minb} CTAs of {threads} threads at about {regs} registers exceed the "
                               f"{arch.regs_per_sm} registers of an SM")
    exchange = dq_exchange * warpgroups * (dq_cols // 16) * 128 * 16   # float4 per thread and 8-column tile
    add_cols = dq_cols // 2 if dq_exchange else dq_cols                 # the columns of dQ a warpgroup adds
    if dq_bulk == 2 and add_cols % BOX_COLS:
        raise Rejected("dq_bulk", f"dq_bulk=2 adds whole boxes of {BOX_COLS} columns: a warpgroup adds {add_cols}")
    # their staged rows, padded (1), or their boxes (2)
    stage = {0: 0, 1: warpgroups * 64 * (add_cols + STAGE_PAD) * 4, 2: warpgroups * 64 * add_cols * 4}[dq_bulk]
    ds_buffers = 2 if overlap or producer else 1   # no CTA-wide barrier per tile with a producer
    # K/V's, each stage's full and empty; with dQ's boxes the deterministic writer's (stored, full,
    # empty) for two buffers of boxes (BoxBarriers in backward_wgmma.cu.j2)
    barriers = ((1 + 2 * stages) + (3 * 2 if dq_bulk == 2 else 0)) * MBARRIER_BYTES if producer else 0
    smem = (2 * block_n * cols + stages * 2 * block_m * cols + ds_buffers * block_m * block_n) * 2 \
        + stages * 2 * block_m * 4 + exchange + stage + barriers + 1024
    if smem > arch.max_smem_per_block:
        raise Rejected("stages", f"{smem} bytes of shared memory exceed the {arch.max_smem_per_block} of a block")
    if minb * (smem + arch.smem_reserved_per_cta) > arch.smem_per_sm:
        raise Rejected("minb", f"minb={minb} CTAs of {smem} bytes of shared memory exceed the SM's {arch.smem_per_sm}")
    bank = banks.model(_wgmma_accesses(cols, block_m, block_n, atoms_layout(block_n), atoms_layout(block_m), add_cols + STAGE_PAD,
                                       True),
                       unpadded=_wgmma_accesses(cols, block_m, block_n, plain_layout(cols), plain_layout(block_n), add_cols,
                                                False))
    return inst.with_derived({
        "threads": threads, "smem_bytes": smem, "dq_rows": 64, "dq_cols": dq_cols, "regs_estimate": regs,
        "tile_cols": cols, "producer_regs": producer_regs, "consumer_regs": consumer_regs,
        "turns_producer_regs": turns_regs[0], "turns_consumer_regs": turns_regs[1],
        "loads_doc": "filled by a producer warpgroup (mbarriers)" if producer else "filled by every thread",
        "stage_pitch": add_cols + STAGE_PAD, "box_rows": BOX_ROWS, "box_cols": BOX_COLS,
        "dq_add_doc": {0: "atomics",
                       1: "rows staged in shared memory, a bulk reduction each; atomics when deterministic",
                       2: "64 x 32 boxes staged in shared memory, a tensor bulk reduction each; in turn when "
                          "deterministic, by the producer's last warp" if producer else
                          "64 x 32 boxes staged in shared memory, a tensor bulk reduction each; in turn when "
                          "deterministic, each turn passed a tile late",
                       }[dq_bulk],
        "bank": bank, "threads_param": "warpgroups", "smem_param": "stages",
    })



def _wide_accesses(d: int, offset_d, offset_s, box_swizzle: bool) -> list:
    """The wide kernel's thread accesses: the producer's cp.async fill, dS's transposing stmatrix
    (as `hopper`'s), the hand-off of dP^T and the packed fragments (16 bytes per thread,
    consecutive threads at consecutive 16 bytes), and dq_bulk 2's boxes (as `hopper`'s, in the
    ring's stage)."""
    chunks = d // 8
    return [banks.Access("cp_async_fill", CHUNK, lambda lane, _pad: offset_d(lane // chunks, lane % chunks * 8) * 2,
                         ("kv_tiles", "q_ring")),
            banks.Access("ds_write", CHUNK,
                         lambda lane, _pad: offset_s((lane >> 4) * 8 + (lane & 7), ((lane >> 3) & 1) * 8) * 2, ("ds_tile",)),
            banks.contiguous("handoff_write", 16, ("handoff",)),
            banks.contiguous("handoff_read", 16, ("handoff",)),
            banks.Access("dq_box_write", 8, lambda lane, _pad: _box_store(lane, box_swizzle), ("q_ring",))] + _stats_accesses()


def _lower_wgmma_wide(inst: KernelInstance, arch: Arch) -> KernelInstance:
    """backward_wgmma_wide.cu.j2: the warpgroups split dK, dV and dQ by columns over one 64-key
    block; the first computes S^T, the second dP^T, and the weights travel between them through
    shared memory."""
    p = inst.p
    d, block_n, block_m, warpgroups, dq_cols, dq_bulk, stages, minb = (
        p[k] for k in ("d", "block_n", "block_m", "warpgroups", "dq_cols", "dq_bulk", "stages", "minb"))
    if not arch.name.endswith("a"):
        raise Rejected("d", f"wgmma needs an arch-specific target (sm_90a), not {arch.name}")
    if inst.dtype_bytes != 2:
        raise Rejected("d", f"tensor-core kinds take 16-bit operands, not {inst.a['dtype']}")
    if warpgroups != 2:
        raise Rejected("warpgroups", f"warpgroups={warpgroups}: 2 (one computes S^T, the other dP^T)")
    if d % (64 * warpgroups):
        raise Rejected("d", f"d={d}: each of the {warpgroups} warpgroups takes whole 64-column atoms of dK, dV and dQ "
                            f"(d a multiple of {64 * warpgroups})")
    if block_n != 64 or block_m != 64:
        raise Rejected("block_n", f"block_n={block_n}, block_m={block_m}: one 64-row wgmma of keys (S^T, dP^T) and "
                                  f"of queries (dQ): both 64")
    cols = d // warpgroups
    if dq_cols % 64 or cols % dq_cols or dq_cols not in WGMMA_N:
        raise Rejected("dq_cols", f"dq_cols={dq_cols}: whole 64-column atoms that divide a warpgroup's {cols} columns")
    if dq_bulk not in (0, 2):
        raise Rejected("dq_bulk", f"dq_bulk={dq_bulk}: 2 (each dQ product staged in 64 x {BOX_COLS} boxes in the "
                                  f"tile's stage, a tensor bulk reduction each) or 0 (every thread's atomics)")
    if dq_bulk == 2 and (cols != 2 * dq_cols or block_m != BOX_ROWS):
        raise Rejected("dq_cols", f"dq_bulk=2 stores a warpgroup's two dQ products (dq_cols={dq_cols} fp32 columns "
                                  f"each) where its {cols} columns of Q and of dO were: dq_cols = {cols // 2}")
    if stages < 2:
        raise Rejected("stages", f"stages={stages}: the ring holds the tile in use and the next")
    threads = (warpgroups + 1) * 128
    # dK + dV on the warpgroup's columns, then the larger of S^T with dP^T (warpgroup 0 holds both)
    # and their packed A fragments (half as many) with dQ's accumulators
    regs = cols + max(block_m, block_m // 2 + dq_cols // 2) + WGMMA_REG_OVERHEAD
    producer_regs, consumer_regs = register_split(warpgroups, minb, arch, PRODUCER_REGS)
    turns_regs = register_split(warpgroups, minb, arch, PRODUCER_REGS_TAKING_TURNS)
    if regs > consumer_regs:   # (the deterministic variants' 8 fewer: ptxas and the compile tier judge those)
        raise Rejected("dq_cols", f"about {regs} registers per thread (dK and dV {cols}, S^T and dP^T {block_m} or "
                                  f"their fragments {block_m // 2} and dQ {dq_cols // 2}) exceed {consumer_regs}")
    handoff = block_m // 8 * 128 * 16        # a float4 per thread and 8-column tile of dP^T
    # K/V's, each stage's full and empty; with dQ's boxes the deterministic writer's boxes_full per stage
    barriers = (1 + 2 * stages + (stages if dq_bulk == 2 else 0)) * MBARRIER_BYTES
    smem = (2 * block_n * d + stages * 2 * block_m * d + block_m * block_n) * 2 + handoff + stages * 2 * block_m * 4 \
        + barriers + 1024
    if smem > arch.max_smem_per_block:
        raise Rejected("stages", f"{smem} bytes of shared memory exceed the {arch.max_smem_per_block} of a block")
    if minb * (smem + arch.smem_reserved_per_cta) > arch.smem_per_sm:
        raise Rejected("minb", f"minb={minb} CTAs of {smem} bytes of shared memory exceed the SM's {arch.smem_per_sm}")
    bank = banks.model(_wide_accesses(d, atoms_layout(block_n), atoms_layout(block_m), True),
                       unpadded=_wide_accesses(d, plain_layout(d), plain_layout(block_n), False))
    return inst.with_derived({
        "threads": threads, "smem_bytes": smem, "cols": cols, "regs_estimate": regs,
        "box_rows": BOX_ROWS, "box_cols": BOX_COLS,
        "dq_add_doc": {0: "atomics", 2: "64 x 32 boxes staged in the tile's stage, a tensor bulk reduction each; in "
                                       "turn when deterministic, by the producer's last warp"}[dq_bulk],
        "producer_regs": producer_regs, "consumer_regs": consumer_regs,
        "turns_producer_regs": turns_regs[0], "turns_consumer_regs": turns_regs[1],
        "bank": bank, "threads_param": "warpgroups", "smem_param": "stages",
    })

FAMILY = Family(
    name="flash_attention_grad",
    axes={"dtype": ("fp16", "bf16")},
    lowerings={BACKWARD: Lowering({"d": "int", "block_n": "int", "block_m": "int", "warps": "int", "dsplit": "int",
                                   "stages": "int", "swizzle": "int0", "minb": "int"}, _lower_backward),
               BACKWARD_WGMMA: Lowering({"d": "int", "block_n": "int", "block_m": "int", "warpgroups": "int",
                                         "dq_by_keys": "int0", "dq_exchange": "int0", "dq_bulk": "int0", "stages": "int",
                                         "overlap": "int0", "producer": "int0", "minb": "int"},
                                        _lower_wgmma),
               BACKWARD_WGMMA_WIDE: Lowering({"d": "int", "block_n": "int", "block_m": "int", "warpgroups": "int",
                                              "dq_cols": "int", "dq_bulk": "int0", "stages": "int", "minb": "int"},
                                             _lower_wgmma_wide)},
    support_files={"flash_attention_grad/params.cuh.j2": "flash_attention_grad/params.cuh",
                   # the forward's shared helpers, rendered into this family's namespace
                   "flash_attention/forward_common.cuh.j2": "flash_attention_grad/forward_common.cuh",
                   "flash_attention_grad/backward_common.cuh.j2": "flash_attention_grad/backward_common.cuh",
                   "flash_attention_grad/backward_producer.cuh.j2": "flash_attention_grad/backward_producer.cuh",
                   "flash_attention_grad/op_impl.h.j2": "flash_attention_grad/op_impl.h"},
    # The backward's key is the forward's (op_checks.h.j2 fills both), and so is its bucket's.
    tune=TunePlan(("B", "Hq", "Hkv", "Lq", "Lk", "D", "causal"), forward_tune_runtime, flags=("causal",)),
    jit_params={"D": "d"},
)
