"""The gated_delta_grad family: Gated DeltaNet's backward by chunks on tensor cores
(templates/gated_delta_grad/chunked_grad.cu.j2, specs/gated_delta_grad.yaml).

Three kernels a call: the forward's chunk-record kernel (delta_rule/chunk_prepare.cuh.j2, here
keeping each chunk's inverse T too); a reverse walk over each (b, h, `cols` value columns)'s
chunks carrying the state's gradient in fp32 registers, tiled as the forward's walk tiles its
state; then one CTA per (b, h, chunk) with every value column of the chunk (`v`, the bucket of V)
for the key-side gradients, its operands all in shared memory at once.
"""
from __future__ import annotations

from ..arch import MAX_REGS, Arch
from ..instance import KernelInstance
from ..passes import Rejected, banks
from ..passes import tiles as shared_tiles
from . import Family, Lowering, TunePlan
from .delta_rule import (RECORD_CONSTANTS, CHECKPOINT_EVERY, CHUNKED_STEPS, ROW_WARPS, chunked_bank,
                         prepare_geometry, BACKWARD_PREP_REGS)

CHUNKED_GRAD = "gated_delta_grad/chunked_grad.cu.j2"
# Registers of the reverse walk besides its fp32 fragments (the state's gradient, two [16, cols
# per warp] products): operands, addresses, the loop; as the forward's walk (CHUNKED_REG_OVERHEAD).
WALK_REG_OVERHEAD = 88


def grad_scalar_rows(col_warps: int) -> int:
    """The per-chunk kernel's fp32 scalar rows (CHUNK floats each): gc, beta, five rows of
    per-warp partial sums per column warp (q S . dO, k S . dY, U . dU, and the decay's row sums
    from dA and F), two per row warp (column sums of dM * T and of F), dgc; rounded up to 8 rows."""
    return -(-(2 + 5 * col_warps + 2 * ROW_WARPS + 1) // 8) * 8


def _lower_chunked_grad(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p = inst.p
    k, v, cols, warps, stages, grad_warps = (p[name] for name in ("k", "v", "cols", "warps", "stages", "grad_warps"))
    if inst.dtype_bytes != 2:
        raise Rejected("k", f"the chunked backward runs on tensor cores from 16-bit operands, not {inst.a['dtype']}")
    steps = CHUNKED_STEPS
    if CHECKPOINT_EVERY != CHUNKED_STEPS:
        raise Rejected("k", f"a chunk of {CHUNKED_STEPS} steps must be the checkpoint interval {CHECKPOINT_EVERY}")
    for name, x in (("k", k), ("v", v), ("cols", cols)):
        if x % 32 or x > 128:
            raise Rejected(name, f"{name}={x} must be a multiple of 32 up to 128 (two column warps of 16-wide MMA tiles)")
    if warps != 2 * ROW_WARPS:
        raise Rejected("warps", f"warps={warps}: the walk tiles a chunk as {ROW_WARPS} row warps x 2 column warps")
    grad_col_warps = grad_warps // ROW_WARPS
    if grad_warps % ROW_WARPS or grad_col_warps not in (2, 4) or any(x // grad_col_warps % 16 for x in (k, v, steps)):
        raise Rejected("grad_warps", f"grad_warps={grad_warps}: the per-chunk kernel tiles a chunk as {ROW_WARPS} row "
                                     f"warps x 2 or 4 column warps, each 16-column blocks of k={k}, v={v} and "
                                     f"{steps} steps")
    warps_m = min(warps, k // 16)   # the walk's state tiling, as the forward's
    warps_n = warps // warps_m
    if cols // 8 % warps_n or cols // 8 // warps_n % 2:
        raise Rejected("cols", f"{warps} warps do not split the {k} x {cols} state gradient into 16 x 16 blocks")
    pitch_k, pitch_c, pitch_v, pitch_m = (shared_tiles.pitch(x, 0) for x in (k, cols, v, steps))
    threads = 32 * warps
    if stages not in (1, 2):
        raise Rejected("stages", f"stages={stages}: the walk keeps one or two chunks of input in flight")
    # The walk: a ring of `stages` chunks of q, k, dO, M, W (16-bit) and gc; G rounded to 16 bits
    # and four exchange tiles (dU, dV's staging, -gamma dY, gamma scale dO).
    stage = 2 * steps * (2 * pitch_k + pitch_c + 2 * pitch_m) + 4 * steps
    walk_smem = stages * stage + 2 * (k * pitch_c + 4 * steps * pitch_c)
    walk_regs = k * cols // threads + 2 * cols // 2 // 2 + WALK_REG_OVERHEAD
    if walk_regs > MAX_REGS:
        raise Rejected("cols", f"about {walk_regs} registers per thread in the reverse walk exceed {MAX_REGS}")
    # The per-chunk kernel: q, k; v (then Y, then U), dO, dY, dU; S, G; M, T and three exchange
    # tiles of [CHUNK, CHUNK]; the scalars.
    scalar_rows = grad_scalar_rows(grad_col_warps)
    grad_smem = (2 * (2 * steps * pitch_k + 4 * steps * pitch_v + 2 * k * pitch_v + 5 * steps * pitch_m)
                 + 4 * (scalar_rows * steps + grad_warps))
    for name, smem in (("stages", walk_smem), ("v", grad_smem)):
        if smem > arch.max_smem_per_block:
            raise Rejected(name, f"{smem} bytes of shared memory exceed a CTA's {arch.max_smem_per_block}")
    # The forward's tile accesses (the column tiles modelled v wide: the walk's, cols wide, pad the
    # same way), then this template's own: the [CHUNK, CHUNK] tiles' 4-byte fragment reads and
    # writes, S and G converted from fp32 in 16-byte pieces, the per-warp partial sums.
    if k * v // 8 % (32 * grad_warps):
        raise Rejected("v", f"the {k} x {v} slab is not whole rounds of {32 * grad_warps} 16-byte pieces")
    bank = chunked_bank(k, v, 0, 0, 0, threads)
    mix_fragment = next(a for a in shared_tiles.bank_accesses(steps, threads, shared_tiles.layout(steps, 0),
                                                              ("ring", "exchange"))
                        if a.name == "o_fragment_write")
    bank.update(banks.model([
        banks.Access("mix_fragment", mix_fragment.width, mix_fragment.address, ("ring", "exchange")),
        banks.contiguous("state_fill", 16, ("state",)),
        banks.Access("part_write", 4, lambda lane, _pad: (lane // 4) * 4, ("exchange",)),
        banks.contiguous("part_read", 4, ("exchange",)),
    ]))
    return inst.with_derived({
        "threads": threads, "smem_bytes": walk_smem, "grad_smem_bytes": grad_smem, **prepare_geometry(k, arch, BACKWARD_PREP_REGS),
        "warps_m": warps_m, "warps_n": warps_n, "walk_regs_estimate": walk_regs,
        "swizzle_k": "false", "swizzle_c": "false", "swizzle_m": "false",
        "scalar_rows": scalar_rows, "bank": bank, "threads_param": "warps", "smem_param": "cols",
    })


def _tune_runtime(shape: dict, dtype_bytes: int, sm_count: int) -> dict:
    return {"K": shape["K"], "V": shape["V"], "T": shape["T"], "BH": shape["B"] * shape["H"],
            "align": 16 // dtype_bytes, "sm_count": sm_count}


FAMILY = Family(
    name="gated_delta_grad",
    axes={"dtype": ("fp32", "fp16", "bf16")},
    lowerings={CHUNKED_GRAD: Lowering({"k": "int", "v": "int", "cols": "int", "warps": "int", "stages": "int",
                                       "grad_warps": "int"}, _lower_chunked_grad)},
    support_files={"gated_delta_grad/params.cuh.j2": "gated_delta_grad/params.cuh",
                   "gated_delta_grad/op_impl.h.j2": "gated_delta_grad/op_impl.h"},
    tune=TunePlan(("B", "H", "T", "K", "V"), _tune_runtime),
    support_constants=RECORD_CONSTANTS,
    exported_constants={"gated_delta_grad_checkpoint_every": "kCheckpointEvery"},
)
