"""Paged decode attention (seed 002): lowering of the decode kernels.

A CTA serves one sequence and `heads` query heads that share one kv head. Its threads form
a [tz][heads / hpt][tx] grid: tx lanes split the head dim in 16-byte pieces (`chunks` pieces
per lane when D is wider than tx pieces), each row of lanes takes `hpt` query heads (one
read and widening of a K or V piece serves all of them), and the tz slots take the tokens of
a staged tile in turn. K and V tiles of `tile` tokens go
through a `stages`-deep cp.async ring; every thread keeps a running max, sum and output piece
over its own tokens, merged across the tz slots once at the end (no barrier per token).
A group that `heads` does not divide is padded: its last CTA computes zero queries for the
missing heads and stores nothing for them. Multi-token queries take a CTA per query token.

`grouped_mma` (decode_mma.cu.j2) runs the same attention on m16n8k16 tensor cores: a CTA holds
16 * `mt` query rows, the (query token, head) pairs of one kv head (padded), and each of its
`warps` warps takes a slice of every staged tile of `tile` tokens, so each page of K and V is
read once per (sequence, kv head, partition) whatever the group size and number of query
tokens. Its partitions are chosen at launch from the batch and the SM count (`waves`,
`min_part`) rather than fixed.

A split launch leaves each partition's output and log-sum-exp in a workspace and a merge kernel
(split.cuh) combines them. The merge is instantiated in each split instance's TU with the
instance's own `merge_rows` and `pdl` knobs, so the tuner sweeps it with the kernel it follows.
"""
from __future__ import annotations

import math

from ..arch import MAX_REGS, Arch
from ..instance import KernelInstance
from ..passes import Rejected, banks, is_pow2, vectorize
from ..passes import tiles as shared_tiles
from . import Family, Lowering, TunePlan

DECODE = "paged/decode.cu.j2"
DECODE_MMA = "paged/decode_mma.cu.j2"
# Query tokens per sequence a call may bring (speculative decoding, chunked-prefill tails): the
# bindings check it, the grouped kind's row blocks cover any Q * G.
MAX_QUERY_TOKENS = 16
MAX_SCORES = 32   # scores a thread holds per stage (registers)
# Register estimate of grouped_mma per thread: output and score fragments plus what the
# addressing, the row state and the operands in flight take (ptxas has the last word; the
# compile tier checks its report for spills).
MMA_REG_OVERHEAD = 64


def _merge(p: dict, split: bool, arch: Arch) -> dict:
    """The merge's knobs (split.cuh): `merge_rows` query rows per CTA, each by d / 4 threads
    reading float4s; `pdl` launches it as a programmatic dependent of the decode grid (sm_90)."""
    rows, pdl, d = p["merge_rows"], p["pdl"], p["d"]
    if not split:
        if rows or pdl:
            raise Rejected("merge_rows", f"merge_rows={rows}, pdl={pdl}: a single-pass kind has no merge (0, 0)")
        return {"pdl": "false", "merge_threads": 0}
    threads = rows * d // 4
    if not is_pow2(rows) or threads > arch.max_threads_per_block:
        raise Rejected("merge_rows", f"merge_rows={rows} must be a power of two with merge_rows * d / 4 = {threads} "
                                     f"threads <= {arch.max_threads_per_block}")
    if pdl not in (0, 1):
        raise Rejected("pdl", f"pdl={pdl}: 1 launches the merge as a programmatic dependent, 0 plainly")
    if pdl and arch.compute < 90:
        raise Rejected("pdl", f"pdl=1 needs programmatic dependent launch (sm_90 and later), not {arch.name}")
    return {"pdl": "true" if pdl else "false", "merge_threads": threads}


def _geometry(p: dict, nbytes: int) -> dict:
    d, vec, tx, heads, hpt, threads, tile = (p[k] for k in ("d", "vec", "tx", "heads", "hpt", "threads", "tile"))
    vectorize.check(vec, nbytes, {"d": d})
    if vec * nbytes != 16:
        raise Rejected("vec", f"vec={vec}: the cp.async ring moves 16-byte pieces ({16 // nbytes} elements)")
    if not is_pow2(tx) or tx > 32:
        raise Rejected("tx", f"tx={tx} must be a power of two <= 32 (its lanes sum scores by warp shuffles)")
    if not is_pow2(heads):
        raise Rejected("heads", f"heads={heads} must be a power of two")
    if not is_pow2(hpt) or heads % hpt:
        raise Rejected("hpt", f"hpt={hpt} heads per thread must be a power of two dividing heads={heads}")
    rows = heads // hpt
    if threads % (tx * rows):
        raise Rejected("threads", f"threads={threads} is not a multiple of tx*heads/hpt={tx * rows}")
    tz = threads // (tx * rows)
    if tile % tz:
        raise Rejected("tile", f"tile={tile} tokens do not split over {tz} token slots")
    if tile // tz > MAX_SCORES:
        raise Rejected("tile", f"tile={tile} gives {tile // tz} scores per thread per stage; at most {MAX_SCORES}")
    pieces = d // vec
    return {"tz": tz, "rows": rows, "scores": tile // tz, "pieces": pieces, "chunks": -(-pieces // tx)}


def _lower_decode(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p, nbytes = inst.p, inst.dtype_bytes
    geo = _geometry(p, nbytes)
    d, tx, heads, threads, tile, stages, part = (p[k] for k in ("d", "tx", "heads", "threads", "tile",
                                                                 "stages", "part"))
    if stages < 2:
        raise Rejected("stages", f"stages={stages}: the cp.async ring needs at least 2")
    split = part > 0  # part 0: one pass over the whole context, no merge; else split-K over partitions of part tokens
    if split and part % tile:
        raise Rejected("part", f"part={part} must be a multiple of tile={tile} (0: a single pass, no split)")

    row_bytes = d * nbytes
    ring = stages * tile * 2 * row_bytes                     # K and V tiles
    slots = geo["tz"] * heads                                # (token slot, head) pairs
    merge = slots * (d + 2) * 4                              # per slot: output row, max, sum
    smem = max(ring, merge)
    loads = tile * geo["pieces"]                             # 16-byte pieces per tensor per stage

    # Bank model of the tile reads: lane x of a tx group reads piece x (+ tx * j) of its token's
    # row; the other groups of the warp are other rows of heads (the same token: broadcast) or
    # other token slots.
    rows = geo["rows"]

    def tile_read(lane, _pad):
        x, group = lane % tx, lane // tx
        return None if x >= geo["pieces"] else (group // rows) * row_bytes + x * 16

    # The merge of the token slots: lane (x, y, z) stores its output piece x of head slot
    # z * heads + y * hpt as floats (vectorized to 16-byte stores, vec * 4 bytes per piece);
    # the z = 0 lanes read the same layout back. Pieces 4 banks x vec / 4 apart: 2-way at vec 8.
    def merge_slot(lane, _pad):
        x, rest = lane % tx, lane // tx
        y, z = rest % rows, rest // rows
        return None if x >= geo["pieces"] else ((z * heads + y * p["hpt"]) * d + x * p["vec"]) * 4

    # The slots' max and sum: the x = 0 lanes write their head slots, the z = 0 lanes read every
    # slot's entry of their head (lanes of one row read one word: a broadcast).
    def stat_write(lane, _pad):
        x, rest = lane % tx, lane // tx
        y, z = rest % rows, rest // rows
        return None if x else (z * heads + y * p["hpt"]) * 4

    def stat_read(lane, _pad):
        rest = lane // tx
        return None if rest // rows else (rest % rows) * p["hpt"] * 4

    def merge_read(lane, _pad):
        return None if lane // tx // rows else merge_slot(lane, _pad)

    bank = banks.model([banks.contiguous("kv_fill", 16, ("ring",)), banks.Access("kv_tile_read", 16, tile_read, ("ring",)),
                        banks.Access("merge_write", 16, merge_slot, ("merge",)),
                        banks.Access("merge_read", 16, merge_read, ("merge",)),
                        banks.Access("stat_write", 4, stat_write, ("merge",)),
                        banks.Access("stat_read", 4, stat_read, ("merge",))])
    return inst.with_derived({
        **geo, **_merge(p, split, arch), "threads": threads, "smem_bytes": smem, "ring_bytes": ring, "merge_bytes": merge,
        "loads": loads, "split": "true" if split else "false", "bank": bank,
        "threads_param": "threads", "smem_param": "tile",
    })


# Head sizes whose fp8 rows the grouped kind reads straight into MMA operands: a lane's share
# of a row (d / 4 bytes of K, d / 8 of V) is whole 16-byte reads, or one 8-byte read at 64.
# Measured on the H100 (bench/results/h100/paged.md, e4m3 D128, 64 seqs x 4096, G 1-8): widened
# per warp it took 0.70-0.71x the bf16 time, bound by issue (ncu: 59% of issue slots busy
# against 42% for bf16, 1.69 TB/s); read directly, same tiles, 0.60-0.62x (commit 4a51496).
FP8_DIRECT_D = (64, 128, 256)


def raw_at(row: int, byte: int, d: int) -> int:
    """Byte offset of a raw fp8 row's byte in a directly read tile (decode_mma.cu's raw_at):
    16-byte chunks XOR-swizzled by the row (by row / 2 where two 64-byte rows share a line)."""
    key = (row >> 1) & 3 if d == 64 else row & 7
    return row * d + (((byte >> 4) ^ key) << 4) + (byte & 15)


def k_chunk(t: int, i: int, d: int) -> int:
    """The chunk of its K row that lane t reads at step i (decode_mma.cu's k_chunk)."""
    return t if d == 64 else 2 * t + (i & 1) + 8 * (i >> 1)


def q_column(col: int, d: int) -> int:
    """The permuted q tile's column of head-dim element col (decode_mma.cu's q_column)."""
    c, b = col >> 4, col & 15
    t, i = (c, 0) if d == 64 else ((c & 7) >> 1, (c & 1) + 2 * (c >> 3))
    kd, e = 4 * i + (b >> 2), b & 3
    return 16 * kd + 2 * t + (e if e < 2 else 6 + e)


def v_byte(g: int, j: int, d: int) -> int:
    """The first byte of lane g's piece j of a V row (decode_mma.cu's v_byte)."""
    return 8 * g if d == 64 else 16 * (g + 8 * j)


def out_column(col: int, d: int) -> int:
    """The permuted output's column of head-dim element col (decode_mma.cu's out_column)."""
    return (col & 7) * 8 + (col >> 3) if d == 64 else (16 * (col >> 7) + (col & 15)) * 8 + ((col >> 4) & 7)


def _direct_fp8_accesses(d: int, swizzle: int) -> list:
    """The shared accesses of the direct fp8 path (declared by every grouped instance: the
    template holds them all; those of another path are never executed)."""
    offset = shared_tiles.layout(d, swizzle)
    per_lane = d // 32

    def k_read(lane, _pad):         # lane (g, t): row g, chunk k_chunk(t, 0)
        return raw_at(lane // 4, k_chunk(lane % 4, 0, d) * 16, d)

    def v_read(lane, _pad):         # lane (g, t): token 2t, its piece 0
        return raw_at(2 * (lane % 4), v_byte(lane // 4, 0, d), d)

    def q_read(lane, _pad):         # a warp converts one row: lane reads its pair of elements
        return offset(0, lane * per_lane) * 2

    def q_write(lane, _pad):
        return offset(0, q_column(lane * per_lane, d)) * 2

    def factor_read(lane, _pad):    # a lane's rows lane / 4 (and + 8): one word per quad
        return (lane // 4) * 4

    def merge_read(lane, _pad):     # one thread per (row, 8-column chunk): element 0 of its chunk
        chunks = d // 8
        return ((lane // chunks) * (d + 8) + out_column(lane % chunks * 8, d)) * 4

    return [banks.Access("fp8_k_read", 16, k_read, ("ring",)),
            banks.Access("fp8_v_read", 8 if d == 64 else 16, v_read, ("ring",)),
            banks.Access("q_convert_read", 4, q_read, ("q_tile",)), banks.Access("q_convert_write", 4, q_write, ("q_tile",)),
            banks.Access("factor_write", 4, lambda lane, _pad: 0 if lane == 0 else None, ("factor",)),
            banks.Access("factor_read", 4, factor_read, ("factor",)),
            banks.Access("merge_read_permuted", 4, merge_read, ("merge",))]


def _lower_mma(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p = inst.p
    d, warps, tile, stages, mt, waves, fill, unsplit, min_part, kv_e = (
        p[k] for k in ("d", "warps", "tile", "stages", "mt", "waves", "fill", "unsplit", "min_part", "kv_e"))
    if inst.dtype_bytes != 2:
        raise Rejected("d", f"tensor-core kinds take 16-bit operands, not {inst.a['dtype']}")
    if d % 16:
        raise Rejected("d", f"d={d} is not a multiple of 16 (the k-step of m16n8k16)")
    if tile % (16 * warps):
        raise Rejected("tile", f"tile={tile} does not split into 16-token slices over {warps} warps")
    if stages < 2:
        raise Rejected("stages", f"stages={stages}: the cp.async ring needs at least 2")
    if waves < 0 or min_part < tile or min_part % tile:
        raise Rejected("min_part", f"waves={waves} must be >= 0 and min_part={min_part} a multiple of tile={tile}")
    if kv_e not in (0, 4, 5):
        raise Rejected("kv_e", f"kv_e={kv_e}: 0 (the cache has q's dtype), 4 (fp8 e4m3) or 5 (fp8 e5m2)")
    if not 0 <= fill <= 100:
        raise Rejected("fill", f"fill={fill} is a percentage of the waves' CTA slots (0-100)")
    threads, rows, warp_tokens = 32 * warps, 16 * mt, tile // warps
    # fp8: the ring holds raw rows of d bytes. At the head sizes of FP8_DIRECT_D the MMAs read
    # them directly (half operands, q scaled per row: a float per row); otherwise they are
    # widened into one 16-bit K and V tile pair first.
    direct = bool(kv_e) and d in FP8_DIRECT_D
    # Read directly, a lane also holds its K words of every n-tile and 4 tokens' V pieces
    # (at D 64 with 32 rows and 128-token tiles, the estimate without them let ptxas spill).
    fp8_operands = warp_tokens // 8 * 4 + 16 if direct else 0
    regs = mt * d // 2 + mt * warp_tokens // 2 + MMA_REG_OVERHEAD + fp8_operands
    if regs > MAX_REGS:
        raise Rejected("mt", f"about {regs} registers per thread (output {mt * d // 2}, scores "
                             f"{mt * warp_tokens // 2}, fp8 operands {fp8_operands}) exceed {MAX_REGS}")
    swizzle = int(d % 64 == 0)      # whole 128-byte lines: XOR swizzle; otherwise rows padded by a chunk
    row_bytes = shared_tiles.pitch(d, swizzle) * 2
    raw_tile = tile * d if kv_e else tile * row_bytes
    ring = (rows * row_bytes + (rows * 4 if direct else 0) + (2 * tile * row_bytes if kv_e and not direct else 0)
            + stages * 2 * raw_tile)
    merge_bytes = warps * rows * (d + 8 + 2) * 4         # the warps' rows, max and sum (fp32)
    smem = max(ring, merge_bytes)
    if smem > arch.max_smem_per_block:
        raise Rejected("stages", f"{smem} bytes of shared memory exceed the {arch.max_smem_per_block} of a block")
    ctas_per_sm = min(arch.smem_per_sm // (smem + arch.smem_reserved_per_cta), arch.max_threads_per_sm // threads,
                      arch.regs_per_sm // (threads * min(MAX_REGS, regs)), arch.max_ctas_per_sm)
    if ctas_per_sm < 1:
        raise Rejected("stages", f"{smem} bytes of shared memory leave no room for one CTA per SM")
    # The K and V copies of a tile: where a row's 16-byte chunks divide the threads, thread x
    # copies chunk x % row_chunks of its own rows, in runs of run_rows (a power of two, at most 8)
    # consecutive rows that start at a multiple of run_rows, so lie in one page wherever pages hold
    # run_rows tokens or more (the kernel checks the block size at run time): one block-table
    # entry and one address per run. Otherwise (0) each row loads its entry (decode_mma.cu.j2).
    row_chunks = d * (1 if kv_e else 2) // 16
    fits = threads % row_chunks == 0 and tile * row_chunks % threads == 0
    run_rows = math.gcd(tile * row_chunks // threads, 8) if fits else 0

    # The tiles: fills and ldmatrix reads as in flash attention (rows padded by a chunk where
    # they are not whole 128-byte lines); fp8 rows land raw (d bytes) and each warp widens its
    # rows, 8 bytes in and 16 out per lane.
    tiles = ("q_tile", "ring", "wide")
    def tile_accesses(offset):
        return [a for a in shared_tiles.bank_accesses(d, threads, offset, tiles) if not a.name.startswith("o_")]

    def raw_read(lane, _pad):
        return (lane // (d // 8)) * d + lane % (d // 8) * 8

    def wide_write(lane, _pad, offset=shared_tiles.layout(d, swizzle)):
        return offset(lane // (d // 8), lane % (d // 8) * 8) * 2

    # The merge of the warps: float2 writes of row lane / 4, columns 2 (lane % 4), rows d + 8
    # floats apart; the warps' max and sum by the first lane of each quad; one thread per (row,
    # 8-column chunk) reads them back (a row's threads read one word) and its 8 floats as 16-byte pieces.
    def merge_write(lane, _pad):
        return ((lane // 4) * (d + 8) + lane % 4 * 2) * 4

    def stat_write(lane, _pad):
        return None if lane % 4 else (lane // 4) * 4

    def stat_read(lane, _pad):
        return (lane // (d // 8)) * 4

    def merge_read(lane, _pad):
        return ((lane // (d // 8)) * (d + 8) + lane % (d // 8) * 8) * 4

    # A warp's run copies: lane x writes chunk x % row_chunks of the first row of its run (the
    # runs of lanes a row's width apart start rows_per_thread apart).
    def run_fill(lane, _pad, offset=shared_tiles.layout(d, swizzle),
                 rows_per_thread=tile * row_chunks // threads if run_rows else 1):
        return offset(lane // row_chunks * rows_per_thread, lane % row_chunks * (16 if kv_e else 8)) * 2

    rest = [banks.Access("fp8_raw_read", 8, raw_read, ("ring",)), banks.Access("fp8_wide_write", 16, wide_write, ("wide",)),
            banks.Access("kv_run_fill", 16, run_fill, ("ring",)),
            *_direct_fp8_accesses(d, swizzle),
            banks.Access("merge_write", 8, merge_write, ("merge",)), banks.Access("merge_read", 16, merge_read, ("merge",)),
            banks.Access("stat_write", 4, stat_write, ("merge",)), banks.Access("stat_read", 4, stat_read, ("merge",))]
    bank = banks.model(tile_accesses(shared_tiles.layout(d, swizzle)) + rest,
                       unpadded=tile_accesses(shared_tiles.plain_layout(d)) + rest)
    return inst.with_derived({
        "threads": threads, "rows": rows, "warp_tokens": warp_tokens, "swizzle": swizzle, "smem_bytes": smem,
        "ctas_per_sm": ctas_per_sm, "regs_estimate": regs,
        "cache_doc": (f"fp8 e{kv_e}m{7 - kv_e}, read straight into half MMA operands (q scaled into half's range per row)"
                      if direct else f"fp8 e{kv_e}m{7 - kv_e}, widened to {inst.a['dtype']} in shared memory tile by tile"
                      if kv_e else f"{inst.a['dtype']}, as q"),
        "fp8_direct": "true" if direct else "false", "run_rows": run_rows,
        **_merge(p, True, arch),
        "bank": bank,
        "threads_param": "warps", "smem_param": "stages",
    })


# Pages of the tuning workload (bench/workloads/paged.py makes its block tables of them).
TUNE_BLOCK = 16


def _tune_runtime(shape: dict, dtype_bytes: int, sm_count: int) -> dict:
    return {"D": shape["D"], "G": shape["Hq"] // shape["Hkv"], "S": shape["S"], "Q": 1, "KVE": 0,
            "Hq": shape["Hq"], "Hkv": shape["Hkv"], "L": -(-shape["L"] // TUNE_BLOCK) * TUNE_BLOCK,
            "align": vectorize.contiguous_align(dtype_bytes, shape["D"]), "sm_count": sm_count}


FAMILY = Family(
    name="paged",
    axes={"dtype": ("fp32", "fp16", "bf16")},
    lowerings={
        DECODE: Lowering({"d": "int", "vec": "int", "tx": "int", "heads": "int", "hpt": "int", "threads": "int",
                          "tile": "int", "stages": "int", "part": "int0", "merge_rows": "int0", "pdl": "int0"},
                         _lower_decode),
        DECODE_MMA: Lowering({"d": "int", "warps": "int", "tile": "int", "stages": "int", "mt": "int",
                              "waves": "int0", "fill": "int0", "unsplit": "int0", "min_part": "int", "kv_e": "int0",
                              "merge_rows": "int", "pdl": "int0"}, _lower_mma),
    },
    support_files={"paged/params.cuh.j2": "paged/params.cuh",
                   "paged/op_impl.h.j2": "paged/op_impl.h",
                   "paged/split.cuh.j2": "paged/split.cuh"},   # the split workspace and the merge kernel template
    # ragged 1 (the default): the workload's contexts U(1..L) beside one of L; 0: every one L long
    # (bench/workloads/paged.py)
    tune=TunePlan(("S", "Hq", "Hkv", "D", "L", "ragged"), _tune_runtime, flags=("ragged",), defaults={"ragged": 1}),
    jit_params={"D": "d"},
    support_constants={"max_query_tokens": MAX_QUERY_TOKENS},
    # paged_attention sends batches of at most this many query tokens per sequence here
    exported_constants={"paged_decode_max_query_tokens": str(MAX_QUERY_TOKENS)},
)
