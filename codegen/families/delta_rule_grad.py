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
from ..passes import Rejected, banks
from . import Family, Lowering, TunePlan
from .delta_rule import CHECKPOINT_CONSTANTS, CHECKPOINT_EVERY

GRAD = "delta_rule_grad/recurrent_grad.cu.j2"
VECTORS = 5  # q, exp(w), k, a, b staged; dq, dw, dk, da, db reduced
# Registers per thread besides the state, its adjoint and one gradient's terms (3 k / tph):
# the step's scalars, addresses and staged operands in flight.
REG_OVERHEAD = 48


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _lower_grad(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p = inst.p
    k, cols, tph, sub = (p[name] for name in ("k", "cols", "tph", "sub"))
    if not _is_pow2(tph) or tph > 32:
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
    if not _is_pow2(groups):
        raise Rejected("tph", f"k / tph = {ept} entries per lane: the float4 groups ({groups}) must be a power of two "
                              f"(the reduce-scatter halves them)")
    regs = 3 * ept + REG_OVERHEAD
    if regs > MAX_REGS:
        raise Rejected("tph", f"about {regs} registers per thread (3 x {ept} floats) exceed {MAX_REGS}")
    threads = cols * tph
    if threads % 32:
        raise Rejected("cols", f"cols={cols} x tph={tph} = {threads} threads must be whole warps")
    if not _is_pow2(sub) or CHECKPOINT_EVERY % sub:
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


FAMILY = Family(
    name="delta_rule_grad",
    axes={"dtype": ("fp32", "fp16", "bf16")},
    lowerings={GRAD: Lowering({"k": "int", "cols": "int", "tph": "int", "sub": "int"}, _lower_grad)},
    support_files={"delta_rule_grad/params.cuh.j2": "delta_rule_grad/params.cuh",
                   "delta_rule/column.cuh.j2": "delta_rule_grad/column.cuh",   # the forward's, in this namespace
                   "delta_rule_grad/op_impl.h.j2": "delta_rule_grad/op_impl.h"},
    tune=TunePlan(("B", "H", "T", "K", "V"), None),
    jit_params={"K": "k"},
    support_constants=CHECKPOINT_CONSTANTS,
)
