"""Causal linear attention (fast-transformers `causal_dot_product`): lowering of its kernels.

The recurrent template keeps a slice of the E x cols state of one (b, h) in registers:
`cols` value columns per CTA, `tph` threads per column each holding e/tph state rows.
`chunk` time steps of q, k, v are staged per barrier through a `buf`-deep cp.async ring.
"""
from __future__ import annotations

from ..arch import MAX_REGS, Arch
from ..instance import KernelInstance
from ..passes import Rejected, banks, is_pow2, vectorize
from ..passes import tiles as shared_tiles
from . import Family, Lowering, TunePlan

RECURRENT = "causal_linear/recurrent.cu.j2"
GENERIC = "causal_linear/generic.cu.j2"
CHUNKED = "causal_linear/chunked.cu.j2"


def _lower_recurrent(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p, nbytes = inst.p, inst.dtype_bytes
    e, m, cols, mpt, tph, vec, chunk, buf = (p[k] for k in ("e", "m", "cols", "mpt", "tph", "vec", "chunk", "buf"))
    if not is_pow2(tph) or tph > 32:
        raise Rejected("tph", f"tph={tph} must be a power of two <= 32 (its lanes reduce by warp shuffles)")
    vectorize.check(vec, nbytes, {"e": e, "cols": cols})
    if e % tph:
        raise Rejected("tph", f"e={e} is not divisible by tph={tph}")
    ept = e // tph
    # Each thread reads its q/k slice from shared memory in 16-byte pieces when it can.
    lds = min(16 // nbytes, ept)
    if ept % lds:
        raise Rejected("tph", f"{ept} state rows per thread do not split into {lds}-element reads")
    if chunk * mpt % tph:
        raise Rejected("chunk", f"chunk*mpt={chunk * mpt} must be divisible by tph={tph} (reduce-scatter of partials)")
    if cols % mpt or mpt * nbytes not in vectorize.LEGAL_BYTES + (2,):
        raise Rejected("mpt", f"mpt={mpt} must divide cols={cols} and be one read of 2 to 16 bytes")
    if cols > m:
        raise Rejected("cols", f"cols={cols} exceeds the value bucket m={m}")
    if buf < 2:
        raise Rejected("buf", f"buf={buf}: the cp.async ring needs at least 2 stages")
    if p["seg"] % chunk:
        raise Rejected("seg", f"seg={p['seg']} must be a multiple of chunk={chunk} (0: never split time)")

    read_floats = min(vec, 4)   # o tile is read back as float4 (or narrower) pieces
    accesses = banks.output_tile_accesses(cols, mpt, tph, vec, read_floats)
    pad = banks.output_tile_pad(p["pad"], accesses, read_floats)
    inst = inst.with_params(pad=pad)

    threads = cols // mpt * tph
    stage_bytes = chunk * (2 * e + cols) * nbytes
    o_tile_floats = chunk * (cols + pad)
    smem = buf * stage_bytes + 2 * o_tile_floats * 4
    # The stage ring: cp.async fills by consecutive threads, then each thread reads its q/k slice
    # (lanes of a column group apart) and its group's value columns (groups apart).
    ring = [banks.contiguous("qk_fill", vec * nbytes, ("stages",)), banks.contiguous("v_fill", vec * nbytes, ("stages",)),
            banks.Access("qk_read", lds * nbytes, lambda lane, _: (lane % tph) * lds * nbytes, ("stages",)),
            banks.Access("v_read", mpt * nbytes, lambda lane, _: (lane // tph) * mpt * nbytes, ("stages",))]
    bank = banks.model(ring + accesses, pad, candidates=banks.padding_candidates(ring + accesses, read_floats))
    return inst.with_derived({
        "threads": threads, "smem_bytes": smem, "stage_bytes": stage_bytes,
        "ept": ept, "lds": lds, "o_ld": cols + pad, "o_tile_floats": o_tile_floats,
        "o_read": read_floats, "bank": bank, "threads_param": "tph", "smem_param": "chunk",
    })


# Registers the chunked kernel needs besides its fp32 fragments (operands, addresses, loop
# state); with the fragments, the estimate must stay under 255 (the compile tier forbids spills).
CHUNKED_REG_OVERHEAD = 64


def _lower_chunked(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p = inst.p
    e, m, cols, warps, stages, terms = (p[k] for k in ("e", "m", "cols", "warps", "stages", "terms"))
    if inst.dtype_bytes != 2:
        raise Rejected("e", f"the chunked kind runs on tensor cores from 16-bit operands, not {inst.a['dtype']}")
    if e % 16 or cols % 16:
        raise Rejected("e" if e % 16 else "cols", f"e={e} and cols={cols} must be multiples of 16 (MMA tiles)")
    if cols > m:
        raise Rejected("cols", f"cols={cols} exceeds the value bucket m={m}")
    if stages < 2:
        raise Rejected("stages", f"stages={stages}: the cp.async ring needs at least 2")
    if p["sbuf"] not in (1, 2):
        raise Rejected("sbuf", f"sbuf={p['sbuf']}: 1 or 2 state buffers in shared memory")
    if terms not in (1, 2):
        raise Rejected("terms", f"terms={terms}: the state is read as 1 (rounded) or 2 (hi + lo) 16-bit terms")
    chunk = 16 * warps
    if p["seg"] % chunk:
        raise Rejected("seg", f"seg={p['seg']} must be a multiple of the chunk, 16 * warps = {chunk} (0: never split time)")
    if p["waves"] < 1:
        raise Rejected("waves", f"waves={p['waves']}: waves of resident CTAs the time split aims for, at least 1")
    # The state's E x cols tiles split over the warps: rows first, then columns, each warp
    # holding whole pairs of 8-column n-tiles (one ldmatrix_x4_trans of V serves two).
    warps_m = min(warps, e // 16)
    warps_n = warps // warps_m
    if warps % warps_m or cols // 8 % warps_n or cols // 8 // warps_n % 2:
        raise Rejected("warps", f"{warps} warps do not split the {e} x {cols} state into 16 x 16 blocks")
    state = e * cols // (32 * warps)
    regs = state + cols // 2 + chunk // 2 + CHUNKED_REG_OVERHEAD
    if regs > MAX_REGS:
        raise Rejected("cols", f"about {regs} registers per thread (state {state}, output {cols // 2}, "
                               f"scores {chunk // 2}) exceed {MAX_REGS}")
    swizzle_e, swizzle_c = int(e % 64 == 0), int(cols % 64 == 0)
    pitch_e, pitch_c = shared_tiles.pitch(e, swizzle_e), shared_tiles.pitch(cols, swizzle_c)
    stage = chunk * (2 * pitch_e + pitch_c)
    smem = 2 * (stages * stage + p["sbuf"] * terms * e * pitch_c + warps * 16 * pitch_c)
    threads = 32 * warps
    # Resident CTAs per SM, from shared memory; __launch_bounds__ holds the registers to it
    # and the time split sizes its grid by it.
    ctas_per_sm = min(arch.smem_per_sm // (smem + arch.smem_reserved_per_cta),
                      arch.regs_per_sm // (threads * max(regs, 64)), 8)
    if ctas_per_sm < 1:
        raise Rejected("stages", f"{smem} bytes of shared memory leave no room for one CTA per SM")
    # q and k tiles (the ring): cp.async fills and ldmatrix reads. Tiles `cols` wide: v in the
    # ring, the state terms and the staged output rows, with 4-byte fragment writes (state and
    # output) and the output rows read back in 16-byte pieces.
    def tiles(layout_e, layout_c):
        qk = [banks.Access(f"qk_{a.name}", a.width, a.address, ("ring",))
              for a in shared_tiles.bank_accesses(e, threads=threads, offset=layout_e) if not a.name.startswith("o_")]
        buffers = {"cp_async_fill": ("ring",), "ldmatrix": ("ring", "state_terms"),
                   "o_fragment_write": ("state_terms", "o_stage"), "o_row_read": ("o_stage",)}
        cols_ = [banks.Access(f"cols_{a.name}", a.width, a.address, buffers[a.name])
                 for a in shared_tiles.bank_accesses(cols, threads=threads, offset=layout_c)]
        return qk + cols_

    chosen = tiles(shared_tiles.layout(e, swizzle_e), shared_tiles.layout(cols, swizzle_c))
    plain = tiles(shared_tiles.plain_layout(e), shared_tiles.plain_layout(cols))
    padded = tiles(shared_tiles.layout(e, 0), shared_tiles.layout(cols, 0))
    bank = banks.model(chosen, unpadded=plain, candidates=[(padded, 0)])
    return inst.with_derived({
        "threads": threads, "smem_bytes": smem, "chunk": chunk, "warps_m": warps_m, "warps_n": warps_n,
        "swizzle_e": "true" if swizzle_e else "false", "swizzle_c": "true" if swizzle_c else "false",
        "regs_estimate": regs, "ctas_per_sm": ctas_per_sm,
        "bank": bank, "threads_param": "warps", "smem_param": "stages",
    })


def _lower_generic(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p = inst.p
    emax, cols, groups, chunk = p["emax"], p["cols"], p["groups"], p["chunk"]
    threads = cols * groups
    if threads % 32 or cols % 32:
        raise Rejected("cols", f"cols={cols} must be a multiple of 32 (one warp spans a row of the state)")
    if chunk * cols > threads * 4:
        raise Rejected("chunk", f"chunk*cols={chunk * cols} outputs exceed 4 per thread in the reduction")
    # fp32 state for emax rows, staging of q, k, v in fp32, and one partial per (step, group, col).
    smem = emax * cols * 4 + chunk * (2 * emax + cols) * 4 + chunk * groups * cols * 4
    # Every access is a row of consecutive floats (a warp spans 32 of a row's COLS columns), or,
    # for q and k, one element the whole warp (one group) reads.
    staged = [banks.contiguous(name, 4, buffers) for name, buffers in (
        ("state_clear", ("state",)), ("state_read", ("state",)), ("state_write", ("state",)),
        ("qk_stage", ("staging",)), ("v_stage", ("staging",)), ("v_read", ("staging",)),
        ("partial_write", ("partial",)), ("partial_read", ("partial",)))]
    bank = banks.model(staged + [banks.broadcast("qk_read", 4, ("staging",))])
    return inst.with_derived({"threads": threads, "smem_bytes": smem, "threads_param": "groups",
                              "smem_param": "emax", "bank": bank})


def _generic_smem_at_runtime(inst: KernelInstance) -> str:
    """The generic kernel's dynamic shared memory: E is known only at run time."""
    p = inst.p
    return (f"(size_t)p.E * {p['cols']} * 4 + (size_t){p['chunk']} * (2 * p.E + {p['cols']}) * 4 + "
            f"(size_t){p['chunk'] * p['groups'] * p['cols']} * 4")


def _tune_runtime(shape: dict, dtype_bytes: int, sm_count: int) -> dict:
    return {"E": shape["E"], "M": shape["M"], "L": shape["L"], "BH": shape["B"] * shape["H"],
            "align": vectorize.contiguous_align(dtype_bytes, shape["E"], shape["M"]), "sm_count": sm_count}


FAMILY = Family(
    name="causal_linear",
    axes={"dtype": ("fp32", "fp16", "bf16"), "direction": ("fwd", "rev")},
    lowerings={
        RECURRENT: Lowering({"e": "int", "m": "int", "cols": "int", "mpt": "int", "tph": "int", "vec": "int",
                             "chunk": "int", "buf": "int", "pad": "auto_ok", "seg": "int0"}, _lower_recurrent),
        GENERIC: Lowering({"emax": "int", "cols": "int", "groups": "int", "chunk": "int"}, _lower_generic,
                          _generic_smem_at_runtime),
        CHUNKED: Lowering({"e": "int", "m": "int", "cols": "int", "warps": "int", "stages": "int", "terms": "int",
                           "sbuf": "int", "seg": "int0", "waves": "int"}, _lower_chunked),
    },
    support_files={"causal_linear/params.cuh.j2": "causal_linear/params.cuh",
                   "causal_linear/op_impl.h.j2": "causal_linear/op_impl.h"},
    # Forward only: the reverse kernel is the same code walking time backwards.
    tune=TunePlan(("B", "H", "L", "E", "M"), _tune_runtime, axes={"direction": "fwd"}),
    # A call the dispatch sends to the fallback kind (E or M past the recurrent kinds' buckets)
    # gets a recurrent instance built for it, tried before the fallback.
    jit_params={"E": "e", "M": "m"},
)
