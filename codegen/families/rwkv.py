"""RWKV5/6 wkv (seed 001): lowering of the decayed-state scan kernels.

Every pass of the op, forward and backward, is one scan of an N x N state X[c, o]:
    y_t[o] = sum_c q_t[c] X[c, o] + bonus_t[o];   X[c, o] <- X[c, o] * decay_t + kc_t[c] vo_t[o]
read before the update, walking time forward or in reverse (`direction`). The key axis of
RWKV (the one that carries the decay exp(w) and the bonus u) is either the contracted axis c
(forward and the dv pass) or the output axis o (the dr and dk passes): the `keys` axis.

The scan template keeps `cols` output columns of one (b, h) per CTA in registers: `mpt`
columns per thread, `tph` threads per column group each holding N/tph contracted rows, whose
partial sums meet in a warp-shuffle reduce-scatter (as in causal_linear's recurrent kernel).
"""
from __future__ import annotations

from ..arch import Arch
from ..instance import KernelInstance
from ..passes import Rejected, banks, is_pow2, vectorize
from . import Family, Lowering, TunePlan

SCAN = "rwkv/scan.cu.j2"
# The forward saves its state every CHECKPOINT_EVERY steps for the backward, which rebuilds the
# states in between (the rwkv_grad family, specs/rwkv_grad.yaml): N*N*4 bytes per (b, h) per 64
# steps, half of what bf16 r, k, v, w take at N = 64; and 64 steps are the window that pass
# stages in shared memory.
CHECKPOINT_EVERY = 64
CHECKPOINT_CONSTANTS = {"checkpoint_every": CHECKPOINT_EVERY,
                        "checkpoint_every_why": "codegen/families/rwkv.py CHECKPOINT_EVERY says why"}


def _lower_scan(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p, nbytes = inst.p, inst.dtype_bytes
    n, cols, mpt, tph, vec, chunk, buf = (p[k] for k in ("n", "cols", "mpt", "tph", "vec", "chunk", "buf"))
    keys_output = inst.a["keys"] == "output"
    if not is_pow2(tph) or tph > 32:
        raise Rejected("tph", f"tph={tph} must be a power of two <= 32 (its lanes reduce by warp shuffles)")
    if n % tph:
        raise Rejected("tph", f"n={n} is not divisible by tph={tph}")
    vectorize.check(vec, nbytes, {"n": n, "cols": cols})
    ept = n // tph
    # Contracted rows read from shared memory 16 bytes at a time, in equal power-of-two reads
    # (ept = 6 at n = 96, tph = 16: 2 at a time).
    lds = min(16 // nbytes, ept)
    while ept % lds or not is_pow2(lds):
        lds -= 1
    if ept % lds:
        raise Rejected("tph", f"{ept} state rows per thread do not split into {lds}-element reads")
    if n % cols or cols % mpt or mpt * nbytes not in vectorize.LEGAL_BYTES + (2,):
        raise Rejected("mpt", f"mpt={mpt} must divide cols={cols} (a divisor of n={n}) and be one "
                              f"read of 2 to 16 bytes")
    if chunk * mpt % tph:
        raise Rejected("chunk", f"chunk*mpt={chunk * mpt} must be divisible by tph={tph} (reduce-scatter)")
    if CHECKPOINT_EVERY % chunk:
        raise Rejected("chunk", f"chunk={chunk} must divide the checkpoint interval {CHECKPOINT_EVERY}")
    if buf < 2:
        raise Rejected("buf", f"buf={buf}: the cp.async ring needs at least 2 stages")
    if p["dsplit"] not in (0, 1):
        raise Rejected("dsplit", f"dsplit={p['dsplit']} must be 0 (decay as one float) or 1 (hi + lo)")

    read_floats = min(vec, 4)
    accesses = banks.output_tile_accesses(cols, mpt, tph, vec, read_floats)
    pad = banks.output_tile_pad(p["pad"], accesses, read_floats)
    inst = inst.with_params(pad=pad)

    # Decay entries one step needs: those of the CTA's output columns when the keys are the
    # output axis, all n otherwise. They are converted once per stage to fp32 (hi, and lo
    # when dsplit) in their own buffer, read by every thread that shares the key.
    wcols = cols if keys_output else n
    threads = cols // mpt * tph
    stage_bytes = chunk * (2 * n + cols + wcols) * nbytes
    decay_floats = chunk * wcols * (1 + p["dsplit"])
    o_tile_floats = chunk * (cols + pad)
    smem = buf * stage_bytes + decay_floats * 4 + 2 * o_tile_floats * 4
    # The stage ring: cp.async fills by consecutive threads, each thread's q/k slice (lanes of a
    # column group apart) and its group's value columns; the raw decays, converted once per stage
    # by consecutive threads into the fp32 decay buffer.
    ring = [banks.contiguous(name, vec * nbytes, ("stages",)) for name in ("row_fill", "col_fill", "w_fill")]
    ring += [banks.Access("q_read", lds * nbytes, lambda lane, _: (lane % tph) * lds * nbytes, ("stages",)),
             banks.Access("vo_read", mpt * nbytes, lambda lane, _: (lane // tph) * mpt * nbytes, ("stages",)),
             banks.contiguous("w_read", nbytes, ("stages",)), banks.contiguous("decay_write", 4, ("decays",))]
    # The fp32 decays of a step, read per state row (keys contracted: lds floats at the lane's
    # rows, in pieces of at most 16 bytes) or per column (keys output: mpt floats of the group).
    if keys_output:
        ring.append(banks.Access("decay_read", min(mpt, 4) * 4, lambda lane, _: (lane // tph) * mpt * 4, ("decays",)))
    else:
        ring.append(banks.Access("decay_read", min(lds, 4) * 4, lambda lane, _: (lane % tph) * lds * 4, ("decays",)))
    bank = banks.model(ring + accesses, pad, candidates=banks.padding_candidates(ring + accesses, read_floats))
    return inst.with_derived({
        "threads": threads, "smem_bytes": smem, "stage_bytes": stage_bytes, "ept": ept, "lds": lds,
        "wcols": wcols, "o_ld": cols + pad, "o_tile_floats": o_tile_floats, "decay_floats": decay_floats,
        "o_read": read_floats, "keys_output": "true" if keys_output else "false",
        "bank": bank, "threads_param": "tph", "smem_param": "chunk",
    })


def _tune_runtime(shape: dict, dtype_bytes: int, sm_count: int) -> dict:
    return {"N": shape["N"], "T": shape["T"], "BH": shape["B"] * shape["H"],
            "align": vectorize.contiguous_align(dtype_bytes, shape["N"]), "sm_count": sm_count}


FAMILY = Family(
    name="rwkv",
    axes={"dtype": ("fp32", "fp16", "bf16"), "direction": ("fwd", "rev"), "keys": ("contracted", "output")},
    lowerings={SCAN: Lowering({"n": "int", "cols": "int", "mpt": "int", "tph": "int", "vec": "int", "chunk": "int",
                               "buf": "int", "pad": "auto_ok", "dsplit": "int0"}, _lower_scan)},
    support_files={"rwkv/params.cuh.j2": "rwkv/params.cuh",
                   "rwkv/decay.cuh.j2": "rwkv/decay.cuh",
                   "rwkv/op_impl.h.j2": "rwkv/op_impl.h"},
    # RWKV6's forward (keys contracted, u and an initial state): the backward's scans are the same
    # kinds walking in reverse or with the keys as the output axis, and take the same winners.
    tune=TunePlan(("B", "H", "T", "N"), _tune_runtime, axes={"direction": "fwd", "keys": "contracted"}),
    jit_params={"N": "n"},
    support_constants=CHECKPOINT_CONSTANTS,
    # The runtime reads it from the extension (the op wkv_checkpoint_every), never from codegen.
    exported_constants={"wkv_checkpoint_every": "kCheckpointEvery"},
)
