"""FlashAttention forward (seed 004): lowering of the tensor-core softmax attention kernels.

`hopper` (forward_wgmma.cu.j2): each warpgroup of 128 threads owns 64 query rows of one
(batch, head); S = Q K^T is a wgmma with both operands in shared memory, stored as
128-byte-swizzled atoms (wgmma.cuh), and O += P V a wgmma with the weights in registers and V
read transposed. `hopper_ws` (forward_ws.cu.j2) computes the same products in a warp-specialized
CTA: a producer warpgroup fills the K/V ring (one thread issuing TMA boxes with `tma`, one box
per page of a paged cache, its 128 threads issuing cp.async without, for packed batches and for
the tile where a paged context ends), signals mbarriers and hands its
registers to the consumers (setmaxnreg); the consumer warpgroups only compute, take turns at the tensor cores
(`pingpong`) and can run a tile's P V during the next tile's softmax (`overlap`); CTAs are
persistent over the query blocks. `mma_sync` (forward.cu.j2) is the FlashAttention-2 algorithm: a CTA owns
`block_m` query rows; its `warps` warps own `block_m / warps` rows each (whole 16-row m-tiles
of the m16n8k16 MMA). Both walk the visible keys in tiles of `block_n` rows that a
`stages`-deep cp.async ring brings into shared memory, and keep the online softmax in
registers (forward_common.cuh, softmax.cuh).

The mma_sync tiles are rows of D 16-bit elements, either padded by one 16-byte chunk or
XOR-swizzled (`swizzle`); the bank model below checks the warp accesses they see.
"""
from __future__ import annotations

from ..arch import MAX_REGS, WGMMA_N, Arch
from ..instance import KernelInstance
from ..passes import Rejected, banks, vectorize
from ..passes.tiles import atoms_bank_accesses, atoms_layout, bank_accesses, layout, pitch, plain_layout
from . import Family, Lowering, TunePlan

FORWARD = "flash_attention/forward.cu.j2"
FORWARD_WGMMA = "flash_attention/forward_wgmma.cu.j2"
FORWARD_WS = "flash_attention/forward_ws.cu.j2"
FORWARD_WS_FP8 = "flash_attention/forward_ws_fp8.cu.j2"   # forward_ws.cu.j2 with the fp8-only knob exp16
FORWARD_FP8_CACHE = "flash_attention/forward_fp8_cache.cu.j2"   # forward.cu.j2 with kv_e (an fp8 paged cache)
FORWARD_WS_FP8_CACHE = "flash_attention/forward_ws_fp8_cache.cu.j2"   # forward_ws.cu.j2 with kv_e
# Register estimate per thread: fp32 output and score fragments, Q fragments when held, and
# what addressing, the softmax state and the operands in flight take (ptxas has the last
# word; the compile tier checks its report for spills).
REG_OVERHEAD = 56
WGMMA_REG_OVERHEAD = 40   # the wgmma kernel reads no operand fragments into registers but P


def check_ring_tiles(d: int, swizzle: int, stages: int) -> None:
    """The mma.sync kinds' shared tiles (forward and backward): padded or XOR-swizzled rows of d
    columns, in a cp.async ring of `stages`."""
    if swizzle not in (0, 1):
        raise Rejected("swizzle", f"swizzle={swizzle}: 0 (padded rows) or 1 (XOR swizzle)")
    if swizzle and d % 64:
        raise Rejected("swizzle", f"the XOR swizzle permutes chunks within 128-byte lines; d={d} is not a multiple of 64")
    if stages < 2:
        raise Rejected("stages", f"stages={stages}: the cp.async ring needs at least 2")


def _lower_mma_sync(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p = inst.p
    d, block_m, block_n, warps, stages, swizzle, qregs, minb = (
        p[k] for k in ("d", "block_m", "block_n", "warps", "stages", "swizzle", "qregs", "minb"))
    kv_e = p.get("kv_e", 0)   # forward_fp8_cache.cu.j2 only
    if inst.dtype_bytes != 2:
        raise Rejected("d", f"tensor-core kinds take 16-bit operands, not {inst.a['dtype']}")
    if d % 16:
        raise Rejected("d", f"d={d} is not a multiple of 16 (the k-step of m16n8k16)")
    if block_m % (16 * warps):
        raise Rejected("block_m", f"block_m={block_m} does not split into whole 16-row m-tiles over {warps} warps")
    if block_n % 16:
        raise Rejected("block_n", f"block_n={block_n} is not a multiple of 16 (the k-step of P V)")
    check_ring_tiles(d, swizzle, stages)
    if qregs not in (0, 1):
        raise Rejected("qregs", f"qregs={qregs}: 0 (Q fragments re-read per tile) or 1 (held in registers)")
    mt = block_m // (16 * warps)
    threads = warps * 32
    regs = mt * d // 2 + mt * block_n // 2 + (mt * d // 4 if qregs else 0) + REG_OVERHEAD
    if regs > MAX_REGS:
        raise Rejected("block_m" if mt > 1 else "block_n",
                       f"about {regs} registers per thread (output {mt * d // 2}, scores {mt * block_n // 2}"
                       f"{f', Q {mt * d // 4}' if qregs else ''}) exceed {MAX_REGS}")
    if regs * threads * minb > arch.regs_per_sm:
        raise Rejected("minb", f"minb={minb} CTAs of {threads} threads at about {regs} registers exceed the "
                               f"{arch.regs_per_sm} registers of an SM")
    if kv_e not in (0, 4, 5):
        raise Rejected("kv_e", f"kv_e={kv_e}: 4 (e4m3) or 5 (e5m2) exponent bits of an fp8 cache, 0 for none")
    row = pitch(d, swizzle) * 2
    # The Q tile, then (an fp8 cache) the widened K and V tiles, then the ring of raw tiles.
    ring_row = d if kv_e else row
    smem = block_m * row + (2 * block_n * row if kv_e else 0) + stages * 2 * block_n * ring_row
    _check_smem(smem, minb, arch)

    def accesses(offset):
        return bank_accesses(d, threads, offset, ("q_tile", "kv_ring")) + _fp8_cache_accesses(d, threads, offset)

    bank = banks.model(accesses(layout(d, swizzle)), unpadded=accesses(plain_layout(d)),
                       candidates=[(accesses(layout(d, s)), 0) for s in (0, 1) if d % 64 == 0 or not s])
    return inst.with_derived({
        "threads": threads, "smem_bytes": smem, "mt": mt, "pitch": pitch(d, swizzle), "regs_estimate": regs,
        "bank": bank, "threads_param": "warps", "smem_param": "stages", "kv_e": kv_e,
        "cache_doc": (f"an fp8 e{kv_e}m{7 - kv_e} paged cache, its raw tiles widened to 16 bits in shared memory "
                      "by the whole CTA each tile" if kv_e else "the dtype of q"),
    })


def _fp8_cache_accesses(d: int, threads: int, offset) -> list:
    """forward.cu.j2's widening of an fp8 cache's tiles (widen_tiles; tagged in every instance,
    run where kv_e is set): lane i reads 8 bytes of the raw rows (D bytes each) and writes the
    16-byte chunk they widen to. The epilogue stages its rows in the Q tile (bank_accesses)."""
    groups = d // 8

    def raw_read(lane, _pad):
        return (lane // groups) * d + lane % groups * 8

    def wide_write(lane, _pad):
        return offset(lane // groups, lane % groups * 8) * 2

    return [banks.Access("fp8_raw_read", 8, raw_read, ("kv_ring",)), banks.Access("fp8_wide_write", 16, wide_write, ("wide",))]


def tile_columns(d: int, dtype_bytes: int = 2) -> int:
    """Columns of the padded Hopper kernels' shared tiles and head-wide accumulators (the
    warp-specialized forward, the wgmma backward): the head size rounded up to whole 64-column
    (128-byte) swizzle atoms. The columns past d are zeros (TMA's out-of-range fill, cp.async's
    zero fill); the products over the head (Q K^T; the backward's S^T, dP^T) stop at d, the
    others compute the pad columns and the epilogues drop them. At d96 P V does a third more work
    than the head needs; the spec's hopper_ws comment has what that costs against the mma.sync
    kernel d96 ran on before. 8-bit elements fill an atom with 128 columns."""
    atom = 128 // dtype_bytes
    return -(-d // atom) * atom


def padded_tile_columns(d: int, over_head: str) -> int:
    """tile_columns(d), or Rejected naming d where the padded kernels cannot take it: `over_head`
    says which products walk the head 16 columns at a time ("Q K^T steps")."""
    cols = tile_columns(d)
    if d % 16 or cols not in WGMMA_N:
        raise Rejected("d", f"d={d}: {over_head} 16 columns at a time, and the tiles' {cols} columns (whole "
                            f"64-column atoms) must be an N that wgmma.cuh instantiates ({', '.join(map(str, WGMMA_N))})")
    return cols


def _check_wgmma_tiles(inst: KernelInstance, arch: Arch, padded: bool = False) -> None:
    """What both wgmma kernels need of the target, the dtype and the tile shapes; `padded`: the
    kernel pads the head size to whole atoms (tile_columns), so any multiple of the k-step does."""
    d, block_m, block_n, warpgroups = (inst.p[k] for k in ("d", "block_m", "block_n", "warpgroups"))
    if not arch.name.endswith("a"):
        raise Rejected("d", f"wgmma needs an arch-specific target (sm_90a), not {arch.name}")
    if inst.dtype_bytes != 2 and not (padded and inst.a["dtype"] == "e4m3"):
        raise Rejected("d", f"this tensor-core kind takes 16-bit operands, not {inst.a['dtype']}"
                            f"{' (the warp-specialized kind takes e4m3 too)' if not padded else ''}")
    if inst.dtype_bytes == 1:
        _check_fp8_tiles(d, block_n)
    elif padded:
        padded_tile_columns(d, "Q K^T steps")
    elif d % 64 or d not in WGMMA_N:
        raise Rejected("d", f"d={d}: rows of 128-byte swizzle atoms need a multiple of 64 that wgmma.cuh "
                            f"instantiates as N ({', '.join(map(str, WGMMA_N))})")
    if block_m != 64 * warpgroups:
        raise Rejected("block_m", f"block_m={block_m}: each of the {warpgroups} warpgroups owns 64 rows "
                                  f"(block_m = {64 * warpgroups})")
    if block_n % 16 or block_n not in WGMMA_N:
        raise Rejected("block_n", f"block_n={block_n} is not a wgmma N of wgmma.cuh "
                                  f"({', '.join(map(str, WGMMA_N))}) and a multiple of 16")
    if inst.p["overlap"] not in (0, 1):
        raise Rejected("overlap", f"overlap={inst.p['overlap']}: 0 or 1")


# The 8-bit kernel's V^T tile: atoms of 128 keys (the 128-byte swizzle) or, for 64-key tiles,
# of 64 (the 64-byte swizzle), K-major, one box of D rows.
FP8_KEY_ATOM = 64


def _check_fp8_tiles(d: int, block_n: int) -> None:
    """e4m3 operands (forward_ws.cu.j2's FP8): Q K^T walks the head 32 columns at a time, the
    output has a column per head column (V^T's rows: an N of wgmma.cuh) and the key tiles are
    whole atoms of V^T (128 keys, or 64 in the 64-byte swizzle)."""
    if d % 32 or d not in WGMMA_N:
        raise Rejected("d", f"d={d}: fp8 operands need a multiple of 32 (the k-step of m64nNk32) that wgmma.cuh "
                            f"instantiates as N ({', '.join(map(str, WGMMA_N))}): V^T has a row per head column")
    if block_n % FP8_KEY_ATOM or block_n not in WGMMA_N:
        raise Rejected("block_n", f"block_n={block_n}: fp8 key tiles are whole {FP8_KEY_ATOM}-key atoms of V^T "
                                  f"(K-major; 8-bit operands are not read transposed)")


def _check_registers(regs: int, threads: int, minb: int, arch: Arch, what: str) -> None:
    """A register estimate against the per-thread limit and the SM's file at minb CTAs."""
    if regs > MAX_REGS:
        raise Rejected("block_n", f"about {regs} registers per thread ({what}) exceed {MAX_REGS}")
    if regs * threads * minb > arch.regs_per_sm:
        raise Rejected("minb", f"minb={minb} CTAs of {threads} threads at about {regs} registers ({what}) exceed "
                               f"the {arch.regs_per_sm} registers of an SM")


def _check_smem(smem: int, minb: int, arch: Arch) -> None:
    if smem <= arch.max_smem_per_block and minb * (smem + arch.smem_reserved_per_cta) > arch.smem_per_sm:
        raise Rejected("minb", f"minb={minb} CTAs of {smem} bytes of shared memory exceed the SM's {arch.smem_per_sm}")


def _lower_wgmma(inst: KernelInstance, arch: Arch) -> KernelInstance:
    _check_wgmma_tiles(inst, arch)
    p = inst.p
    d, block_m, block_n, warpgroups, stages, overlap, minb = (
        p[k] for k in ("d", "block_m", "block_n", "warpgroups", "stages", "overlap", "minb"))
    if stages < 2 + overlap:
        raise Rejected("stages", f"stages={stages}: the cp.async ring needs at least {2 + overlap}"
                                 f"{' when the next tile is read during the softmax' if overlap else ''}")
    threads = warpgroups * 128
    scores = block_n // 2 * (1 + overlap)       # the packed weights reuse the scores' registers
    regs = scores + d // 2 + WGMMA_REG_OVERHEAD
    _check_registers(regs, threads, minb, arch, f"scores {scores}, output {d // 2}")
    smem = (block_m + stages * 2 * block_n) * d * 2 + 1024   # + 1 KB to align the atoms
    _check_smem(smem, minb, arch)
    bank = banks.model(atoms_bank_accesses(d, block_m), unpadded=atoms_bank_accesses(d, block_m, offset=plain_layout(d)))
    return inst.with_derived({
        "threads": threads, "smem_bytes": smem, "regs_estimate": regs, "bank": bank,
        "threads_param": "warpgroups", "smem_param": "stages",
    })


# setmaxnreg takes 24 .. 256 registers in steps of 8; what the producer warpgroup releases of
# the launch's allotment (65536 / threads per thread, rounded down to 8) the consumers claim.
# The producer walks the work units and computes its loads' addresses (TMA, and cp.async for
# packed batches): 64 registers, which leaves 216 to each of two consumer warpgroups and 144 to
# each of three. ptxas (CUDA 13.0) spilled 8-164 bytes in the soft-cap/ALiBi variant at a
# producer share of 32-56 (d128, two consumer warpgroups, cp.async only), and with the TMA path
# beside the copies 72-100 bytes at 48 and 16-44 at 56 (d64, three consumer warpgroups).
PRODUCER_REGS = 64
SETMAXNREG_STEP = 8


def register_split(consumers: int, minb: int, arch: Arch, producer: int = PRODUCER_REGS) -> tuple[int, int]:
    """Registers per thread of the producer (`producer`) and of each consumer warpgroup after setmaxnreg."""
    threads = (consumers + 1) * 128
    allotted = arch.regs_per_sm // (threads * minb) // SETMAXNREG_STEP * SETMAXNREG_STEP * threads
    consumer = (allotted - 128 * producer) // (128 * consumers) // SETMAXNREG_STEP * SETMAXNREG_STEP
    return producer, min(consumer, 256)


MBARRIER_BYTES = 8
# The lazy rescale's largest slack: 16-bit weights up to 2^15, within fp16's 65504.
MAX_SLACK = 15
TMA_BOX_ROWS = 256  # cuTensorMapEncodeTiled: every box dim is at most 256 elements


def _lower_warp_specialized(inst: KernelInstance, arch: Arch) -> KernelInstance:
    """forward_ws.cu.j2: `warpgroups` consumer warpgroups and a producer warpgroup. The ring has a
    full and an empty mbarrier per stage for K and for V, and one for Q; with `overlap` a
    tile's packed weights stay in registers while the next tile's scores are computed."""
    _check_wgmma_tiles(inst, arch, padded=True)
    p = inst.p
    d, block_m, block_n, warpgroups, stages, overlap, pingpong, minb, tma = (
        p[k] for k in ("d", "block_m", "block_n", "warpgroups", "stages", "overlap", "pingpong", "minb", "tma"))
    if tma not in (0, 1):
        raise Rejected("tma", f"tma={tma}: 1 (the producer loads tiles by TMA where the call allows) or 0 (cp.async)")
    if block_m > TMA_BOX_ROWS or block_n > TMA_BOX_ROWS:
        raise Rejected("block_m" if block_m > TMA_BOX_ROWS else "block_n",
                       f"a tile of {max(block_m, block_n)} rows: a TMA box (and the copy loop) take at most "
                       f"{TMA_BOX_ROWS}")
    if pingpong not in (0, 1):
        raise Rejected("pingpong", f"pingpong={pingpong}: 0 or 1 (consumer warpgroups take turns issuing MMAs)")
    if pingpong and warpgroups < 2:
        raise Rejected("pingpong", "pingpong needs at least 2 consumer warpgroups to take turns")
    if stages < 2:
        raise Rejected("stages", f"stages={stages}: the ring needs at least 2")
    elem = inst.dtype_bytes
    slack = p.get("slack", 0)   # the fp8 kinds have no such axis: their weights keep the exact max
    if not 0 <= slack <= MAX_SLACK:
        raise Rejected("slack", f"slack={slack}: 0 (every tile rescales) to {MAX_SLACK} (weights up to 2^slack, "
                                f"within fp16's range)")
    cols = tile_columns(d, elem)
    out_cols = d if elem == 1 else cols           # fp8: V^T's rows; else V's padded columns
    kv_e = p.get("kv_e", 0)   # forward_ws_fp8_cache.cu.j2 only: the producer widens an fp8 cache
    if kv_e not in (0, 4, 5):
        raise Rejected("kv_e", f"kv_e={kv_e}: 4 (e4m3) or 5 (e5m2) exponent bits of an fp8 cache, 0 for none")
    if kv_e and (elem != 2 or cols != d):
        raise Rejected("d", f"an fp8 cache is widened under a 16-bit q into heads of whole 64-column atoms; "
                            f"d={d} {inst.a['dtype']}")
    if kv_e and block_n * d // 16 % 128:
        raise Rejected("block_n", f"{block_n} rows of {d // 16} raw 16-byte pieces do not split over the producer's "
                                  "128 threads")
    rows_per_copier = block_n * cols * elem // 16 // 128   # key rows each producer thread copies per tile
    if p["page_ids"] < 1 or rows_per_copier % p["page_ids"]:
        raise Rejected("page_ids", f"page_ids={p['page_ids']}: the page ids a producer thread loads together must "
                                   f"divide the {rows_per_copier} rows it copies per tile")
    threads = (warpgroups + 1) * 128
    producer_regs, consumer_regs = register_split(warpgroups, minb, arch)
    weights = block_n * elem // 8 if overlap else 0   # held while the next scores are computed
    regs = block_n // 2 + out_cols // 2 + weights + WGMMA_REG_OVERHEAD
    if regs > consumer_regs:
        raise Rejected("block_n", f"about {regs} registers per consumer thread (scores {block_n // 2}, output "
                                  f"{out_cols // 2}, weights {weights}) exceed the {consumer_regs} that {warpgroups} "
                                  f"consumer warpgroups get at minb={minb}")
    barriers = (2 + 4 * stages) * MBARRIER_BYTES
    value_tile = out_cols * block_n if elem == 1 else block_n * cols   # V^T's or V's tile, elements
    raw = 4 * block_n * d if kv_e else 0          # an fp8 cache: the producer's raw K and V rows of two tiles
    smem = 1024 + ((block_m + stages * block_n) * cols + stages * value_tile) * elem + raw + barriers
    _check_smem(smem, minb, arch)
    wide = cols * elem // 2   # the accesses' 16-bit columns: the same bytes
    widening = _widening_accesses(wide, block_n)
    bank = banks.model(atoms_bank_accesses(wide, block_m, staged_epilogue=False) + widening(atoms_layout(block_n)),
                       unpadded=atoms_bank_accesses(wide, block_m, staged_epilogue=False, offset=plain_layout(wide)) +
                       widening(plain_layout(wide)))
    return inst.with_derived({
        "threads": threads, "smem_bytes": smem, "regs_estimate": regs, "bank": bank, "tile_cols": cols,
        "out_cols": out_cols, "out_ctype": "__nv_bfloat16" if elem == 1 else inst.ctype, "exp16": 0, "slack": slack,
        "producer_regs": producer_regs, "consumer_regs": consumer_regs,
        "loads_doc": ("an fp8 cache's raw rows by cp.async, widened by the producer" if kv_e else
                      "TMA, a box per page of a paged cache, cp.async for packed batches" if tma else "cp.async"),
        "threads_param": "warpgroups", "smem_param": "stages", "kv_e": kv_e,
    })


def _widening_accesses(d: int, block_n: int):
    """forward_ws.cu.j2's producer over an fp8 cache (tagged in every instance, run where kv_e is
    set): lane i copies and reads raw piece i (16 bytes of rows D bytes long: consecutive), then
    writes its first 8 values widened into the key tile's atoms at (row, 16 (i % (D / 16)))."""
    chunks = d // 16

    def accesses(offset):
        def wide_write(lane, _pad):
            return offset(lane // chunks, lane % chunks * 16) * 2
        return [banks.contiguous("fp8_raw_fill", 16, ("raw",)), banks.contiguous("fp8_raw_read", 16, ("raw",)),
                banks.Access("fp8_wide_write", 16, wide_write, ("kv_ring",))]
    return accesses


def _lower_warp_specialized_fp8(inst: KernelInstance, arch: Arch) -> KernelInstance:
    """forward_ws_fp8.cu.j2: the warp-specialized kernel on e4m3 operands, with `exp16` (1: each
    pair of weights is one ex2.approx.f16x2, converted to e4m3 straight from half precision and
    summed in half pairs per tile; 0: one fp32 MUFU.EX2 a weight, as the 16-bit kinds)."""
    if inst.a["dtype"] != "e4m3":
        raise Rejected("d", f"the fp8 template takes e4m3 operands, not {inst.a['dtype']} (where: dtype == 'e4m3')")
    if inst.p["exp16"] not in (0, 1):
        raise Rejected("exp16", f"exp16={inst.p['exp16']}: 0 (fp32 exponentials) or 1 (half-precision pairs)")
    lowered = _lower_warp_specialized(inst, arch)
    return lowered.with_derived({**lowered.d, "exp16": inst.p["exp16"]})


def _tune_runtime(shape: dict, dtype_bytes: int, sm_count: int) -> dict:
    """The key of contiguous [B, L, H, D] inputs of a bucket's shape (bench/workloads/flash_attention.py)."""
    return {"D": shape["D"], "B": shape["B"], "Hq": shape["Hq"], "Hkv": shape["Hkv"], "G": shape["Hq"] // shape["Hkv"],
            "Lq": shape["Lq"], "Lk": shape["Lk"], "align": vectorize.contiguous_align(dtype_bytes, shape["D"]),
            "sm_count": sm_count, "causal": shape["causal"], "KVE": 0}


FAMILY = Family(
    name="flash_attention",
    axes={"dtype": ("fp16", "bf16", "e4m3")},
    lowerings={
        FORWARD: Lowering({"d": "int", "block_m": "int", "block_n": "int", "warps": "int", "stages": "int",
                           "swizzle": "int0", "qregs": "int0", "minb": "int"}, _lower_mma_sync),
        FORWARD_FP8_CACHE: Lowering({"d": "int", "block_m": "int", "block_n": "int", "warps": "int", "stages": "int",
                                     "swizzle": "int0", "qregs": "int0", "minb": "int", "kv_e": "int"}, _lower_mma_sync),
        FORWARD_WGMMA: Lowering({"d": "int", "block_m": "int", "block_n": "int", "warpgroups": "int",
                                 "stages": "int", "overlap": "int0", "minb": "int"}, _lower_wgmma),
        FORWARD_WS: Lowering({"d": "int", "block_m": "int", "block_n": "int", "warpgroups": "int", "stages": "int",
                              "overlap": "int0", "pingpong": "int0", "minb": "int", "tma": "int0",
                              "page_ids": "int", "slack": "int0"},
                             _lower_warp_specialized),
        FORWARD_WS_FP8_CACHE: Lowering({"d": "int", "block_m": "int", "block_n": "int", "warpgroups": "int",
                                        "stages": "int", "overlap": "int0", "pingpong": "int0", "minb": "int",
                                        "tma": "int0", "page_ids": "int", "slack": "int0", "kv_e": "int"},
                                       _lower_warp_specialized),
        FORWARD_WS_FP8: Lowering({"d": "int", "block_m": "int", "block_n": "int", "warpgroups": "int", "stages": "int",
                                  "overlap": "int0", "pingpong": "int0", "minb": "int", "tma": "int0",
                                  "page_ids": "int", "exp16": "int0"},
                                 _lower_warp_specialized_fp8),
    },
    support_files={"flash_attention/params.cuh.j2": "flash_attention/params.cuh",
                   "flash_attention/forward_common.cuh.j2": "flash_attention/forward_common.cuh",
                   "flash_attention/epilogue.cuh.j2": "flash_attention/epilogue.cuh",
                   "flash_attention/op_impl.h.j2": "flash_attention/op_impl.h"},
    tune=TunePlan(("B", "Hq", "Hkv", "Lq", "Lk", "D", "causal"), _tune_runtime, flags=("causal",)),
    jit_params={"D": "d"},
)
