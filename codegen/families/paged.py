"""Paged decode attention (seed 002): lowering of the decode kernels.

A CTA serves one sequence and `heads` query heads that share one kv head. Its threads form
a [tz][heads / hpt][tx] grid: tx lanes split the head dim in 16-byte pieces (`chunks` pieces
per lane when D is wider than tx pieces), each row of lanes takes `hpt` query heads (one
read and widening of a K or V piece serves all of them), and the tz slots take the tokens of
a staged tile in turn. K and V tiles of `tile` tokens go
through a `stages`-deep cp.async ring; every thread keeps a running max, sum and output piece
over its own tokens, merged across the tz slots once at the end (no barrier per token).
"""
from __future__ import annotations

from ..arch import Arch
from ..instance import KernelInstance
from ..passes import Rejected, banks, vectorize

NAME = "paged"
AXES = {"dtype": ("fp32", "fp16", "bf16")}
RUNTIME_VARS = {
    "D": "head size",
    "G": "query heads per kv head (Hq / Hkv)",
    "S": "sequences in the batch",
    "Hq": "query heads",
    "Hkv": "key/value heads",
    "L": "longest context the block table can hold (max_blocks * block_size)",
    "align": "largest vector width (elements) that every pointer, stride and D allow",
    "sm_count": "multiprocessors on the current device",
}
DERIVED_NAMES = {"dtype_bytes"}
SHAPE_DIMS = ("S", "Hq", "Hkv", "D", "L")
DECODE = "paged/decode.cu.j2"
TEMPLATE_PARAMS = {
    DECODE: {"d": "int", "vec": "int", "tx": "int", "heads": "int", "hpt": "int", "threads": "int",
             "tile": "int", "stages": "int", "part": "int0"},
}
SUPPORT_FILES = {
    "paged/params.cuh.j2": "paged/params.cuh",
    "paged/bindings.cpp.j2": "paged/bindings.cpp",
    "paged/reduce.h.j2": "paged/reduce.h",       # split-K's merge, not grid-instanced
    "paged/reduce.cu.j2": "paged/reduce.cu",
}
KEY_STRUCT = "DecodeKey"
MAX_SCORES = 32   # scores a thread holds per stage (registers)


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _geometry(p: dict, nbytes: int) -> dict:
    d, vec, tx, heads, hpt, threads, tile = (p[k] for k in ("d", "vec", "tx", "heads", "hpt", "threads", "tile"))
    vectorize.check(vec, nbytes, {"d": d})
    if vec * nbytes != 16:
        raise Rejected("vec", f"vec={vec}: the cp.async ring moves 16-byte pieces ({16 // nbytes} elements)")
    if not _is_pow2(tx) or tx > 32:
        raise Rejected("tx", f"tx={tx} must be a power of two <= 32 (its lanes sum scores by warp shuffles)")
    if not _is_pow2(heads):
        raise Rejected("heads", f"heads={heads} must be a power of two")
    if not _is_pow2(hpt) or heads % hpt:
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


def lower(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p, nbytes = inst.p, inst.dtype_bytes
    geo = _geometry(p, nbytes)
    d, tx, heads, threads, tile, stages, part = (p[k] for k in ("d", "tx", "heads", "threads", "tile",
                                                                 "stages", "part"))
    if stages < 2:
        raise Rejected("stages", f"stages={stages}: the cp.async ring needs at least 2")
    split = inst.kind != "single_pass"
    if split and (part <= 0 or part % tile):
        raise Rejected("part", f"part={part} must be a positive multiple of tile={tile} for a split kind")
    if not split and part:
        raise Rejected("part", f"part={part}: a single-pass kind walks the whole context (part 0)")

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

    ways = banks.conflict_ways([banks.Access("kv_tile_read", 16, tile_read),
                                banks.Access("merge_write", 16, merge_slot)], 0)
    return inst.with_derived({
        **geo, "threads": threads, "smem_bytes": smem, "ring_bytes": ring, "merge_bytes": merge,
        "loads": loads, "split": "true" if split else "false", "bank_ways": ways,
        "threads_param": "threads", "smem_param": "tile",
    })


def smem_bytes_at_runtime(inst: KernelInstance) -> str:
    return str(inst.d["smem_bytes"])


def axes_match_cpp(axes: dict) -> str:
    """C++ condition selecting the instances built for these axis values."""
    return f"key.dtype == DType::k{axes['dtype'].upper()}"
