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
from ..passes import Rejected, banks
from . import Family, Lowering, TunePlan

RECURRENT = "delta_rule/recurrent.cu.j2"
# With a gradient wanted, the forward saves its state every CHECKPOINT_EVERY steps: K*V fp32 per
# (b, h) per window, a third of what bf16 r, w, k, v, a, b of the window take at K = V = 64 (as
# flash-linear-attention's chunk kernels keep a state per 64 steps). The backward
# (specs/delta_rule_grad.yaml) rebuilds the states inside a window from it.
CHECKPOINT_EVERY = 64
CHECKPOINT_CONSTANTS = {"checkpoint_every": CHECKPOINT_EVERY,
                        "checkpoint_every_why": "codegen/families/delta_rule.py CHECKPOINT_EVERY says why"}

# Per variant: the C++ step struct of templates/delta_rule/recurrent.cu.j2, the key-side
# vectors staged per step (K floats each) and the per-step scalars.
VARIANTS = {
    "rwkv7": {"struct": "Rwkv7", "vectors": 5, "scalars": 0},
    "gated_delta": {"struct": "GatedDelta", "vectors": 2, "scalars": 2},
}
# Registers per thread besides the state: the reduction, addresses, the loop and the staged
# operands in flight (ptxas has the last word; the compile tier checks its report for spills).
REG_OVERHEAD = 48


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _lower_recurrent(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p = inst.p
    k, cols, tph, chunk = (p[name] for name in ("k", "cols", "tph", "chunk"))
    variant = VARIANTS[inst.a["variant"]]
    if not _is_pow2(tph) or tph > 32:
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
                key_read, value_read]
    if variant["scalars"]:
        accesses.append(banks.broadcast("scalar_read", 4, ("keys",)))
    return inst.with_derived({
        "threads": threads, "smem_bytes": smem, "ept": ept, "groups": ept // 4, "stage_floats": stage_floats,
        "variant_struct": variant["struct"], "bank": banks.model(accesses),
        "threads_param": "tph", "smem_param": "chunk",
    })


def _tune_runtime(shape: dict, dtype_bytes: int, sm_count: int) -> dict:
    return {"K": shape["K"], "V": shape["V"], "T": shape["T"], "BH": shape["B"] * shape["H"], "sm_count": sm_count}


FAMILY = Family(
    name="delta_rule",
    axes={"dtype": ("fp32", "fp16", "bf16"), "variant": ("rwkv7", "gated_delta")},
    lowerings={RECURRENT: Lowering({"k": "int", "cols": "int", "tph": "int", "chunk": "int"}, _lower_recurrent)},
    support_files={"delta_rule/params.cuh.j2": "delta_rule/params.cuh",
                   "delta_rule/column.cuh.j2": "delta_rule/column.cuh",
                   "delta_rule/variants.cuh.j2": "delta_rule/variants.cuh",
                   "delta_rule/op_impl.h.j2": "delta_rule/op_impl.h"},
    tune=TunePlan(("B", "H", "T", "K", "V"), _tune_runtime, axes={"variant": "rwkv7"}),
    jit_params={"K": "k"},
    support_constants=CHECKPOINT_CONSTANTS,
    exported_constants={"delta_rule_checkpoint_every": "kCheckpointEvery"},
)
