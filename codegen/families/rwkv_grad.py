"""The rwkv_grad family: the wkv backward for r, k, w, u and the initial state
(templates/rwkv_grad/grad_rkwu.cu.j2), one kernel kind whose knobs are grid axes.

The lowering decides the kernel's whole geometry (keys per CTA, lanes per key, which tiles are
widened to float, shared memory) from the knobs, the head size and the dtype; the template
prints the numbers. Its shared-memory accesses are declared here for the bank model.
"""
from __future__ import annotations

from ..arch import Arch
from ..instance import KernelInstance
from ..passes import Rejected, banks, is_pow2
from . import Family, Lowering, TunePlan
from .rwkv import CHECKPOINT_CONSTANTS, CHECKPOINT_EVERY

GRAD = "rwkv_grad/grad_rkwu.cu.j2"
def _check_knobs(p: dict) -> None:
    if not is_pow2(p["e"]) or not 4 <= p["e"] <= 32:
        raise Rejected("e", f"e={p['e']}: values per thread must be a power of two from 4 to 32 (float4 groups)")
    if not 1 <= p["minb"] <= 4:
        raise Rejected("minb", f"minb={p['minb']}: CTAs per SM the registers must allow, 1 to 4")
    if p["threads"] % 32 or not 32 <= p["threads"] <= 1024:
        raise Rejected("threads", f"threads={p['threads']}: a whole number of warps, at most 1024")
    if not is_pow2(p["l"]) or CHECKPOINT_EVERY % p["l"]:
        raise Rejected("l", f"l={p['l']}: steps per sub-window, a power of two dividing the "
                            f"{CHECKPOINT_EVERY}-step window")
    for flag in ("float_v", "float_do", "prefetch"):
        if p[flag] not in (0, 1):
            raise Rejected(flag, f"{flag}={p[flag]}: 0 or 1")
    if not is_pow2(p["n"]) or p["n"] < 32:
        raise Rejected("n", f"n={p['n']}: a power of two of at least 32 (a key's lanes stay in one warp)")


def geometry(p: dict, nbytes: int, arch: Arch) -> dict:
    """What the knobs make of the kernel for head size n and elements of nbytes on arch."""
    n, w = p["n"], CHECKPOINT_EVERY
    e = max(p["e"], n // 32)                     # values per thread: a key's lanes fit one warp
    tpk = n // e                                 # threads per key
    threads = max(p["threads"], tpk)
    keys = threads // tpk                        # keys per CTA
    subs = w // p["l"]
    row_lanes = n // (16 // nbytes)              # 16-byte pieces of a row
    ov_parts = row_lanes // 32 if row_lanes > 32 else 1
    groups = e // 4

    def smem(v_bytes: int, d_bytes: int) -> int:
        return (nbytes * 3 * w * keys + (v_bytes + d_bytes) * w * n + 16 * (w * keys + (subs - 1) * groups * threads)
                + 4 * w * ov_parts)

    def ctas(nbytes_: int) -> int:
        return min(arch.smem_per_sm // (nbytes_ + arch.smem_reserved_per_cta), p["minb"])
    # v's and do's tiles in float where that keeps as many CTAs per SM as the input type would
    # (v is read at three places per step, do at one; widening them there was about a fifth of
    # the instructions: ncu, N = 64 bf16).
    v_bytes = 4 if p["float_v"] and ctas(smem(4, nbytes)) >= ctas(smem(nbytes, nbytes)) else nbytes
    d_bytes = 4 if p["float_do"] and ctas(smem(v_bytes, 4)) >= ctas(smem(v_bytes, nbytes)) else nbytes
    return {"e_eff": e, "l": p["l"], "groups": groups, "tpk": tpk, "threads": threads, "keys_per_cta": keys, "subs": subs,
            "parts": -(-3 * p["l"] // tpk) * tpk, "row_lanes": row_lanes, "ov_parts": ov_parts,
            "swizzle": min(keys, 8), "v_float": int(v_bytes == 4), "d_float": int(d_bytes == 4),
            "vk": min(keys, 16 // nbytes), "smem_bytes": smem(v_bytes, d_bytes),
            "v_type": "float" if v_bytes == 4 else "T", "d_type": "float" if d_bytes == 4 else "T"}


def _bank(g: dict, nbytes: int) -> dict:
    """The kernel's shared-memory accesses, lane by lane for warp 0 (tid = lane; lane // tpk is
    the key, lane % tpk its lane)."""
    tpk, keys, sw, vn, vk = g["tpk"], g["keys_per_cta"], g["swizzle"], 16 // nbytes, g["vk"]
    ov_lanes = g["row_lanes"] // g["ov_parts"]
    kar = lambda t, x: (t * keys + (x ^ (t & (sw - 1)))) * 16  # noqa: E731 - row t, key x, swizzled
    tile_bytes = 4 if g["v_float"] else nbytes

    def finishing(lane):
        """(row, what) a lane finishes first: pair = its lane in the key; None past dr."""
        pair = lane % tpk
        return None if pair // g["l"] >= 3 else (pair % g["l"], pair // g["l"])

    def kar_finish(lane, _pad):
        # One float of the entry, the one the lane's sum needs: decay hi (dw), r (dk) or k (dr);
        # ptxas reads it alone (LDS, measured: ncu, H100, N 32 fp16: 4 wavefronts, 4-way).
        f = finishing(lane)
        return None if f is None else kar(f[0], lane // tpk) + (4, 8, 0)[f[1]]

    def ov_read(lane, _pad):
        f = finishing(lane)
        return None if f is None else f[0] * g["ov_parts"] * 4

    def out_write(lane, _pad):
        f = finishing(lane)
        return None if f is None else ((f[1] * CHECKPOINT_EVERY + f[0]) * keys + lane // tpk) * nbytes

    def ov_write(lane, _pad):
        return None if lane % ov_lanes else (lane // g["row_lanes"] * g["ov_parts"] + lane % g["row_lanes"] // ov_lanes) * 4

    def kar_write(lane, _pad):
        row, x = lane // (keys // vk), lane % (keys // vk) * vk
        return kar(row, x)
    accesses = [
        banks.contiguous("tile_write", 16, ("v_tile", "do_tile")),                # a piece as loaded
        banks.Access("tile_widen", 16, lambda lane, _: lane * vn * 4, ("v_tile", "do_tile")),  # its first float4
        banks.Access("ov_write", 4, ov_write, ("ov",)),
        banks.Access("kar_write", 16, kar_write, ("kar",)),
        # A step's k, decay and r: the lanes of a key read one entry (broadcast), the keys of a
        # warp distinct ones.
        banks.Access("kar_read", 16, lambda lane, _: kar(0, lane // tpk), ("kar",)),
        # Finishing the sums: the lanes of a key on L rows (lane % L), swizzled apart.
        banks.Access("kar_finish_read", 4, kar_finish, ("kar",)),
        banks.contiguous("sub_write", 16, ("sub",)),
        banks.contiguous("sub_read", 16, ("sub",)),
        # A row's group g of four values, widened: the lanes of a key contiguous, the keys of a
        # warp on the same row (broadcast).
        banks.Access("tile_read", 4 * tile_bytes, lambda lane, _: lane % tpk * 4 * tile_bytes, ("v_tile", "do_tile")),
        banks.Access("ov_read", 4, ov_read, ("ov",)),
        banks.Access("out_write", nbytes, out_write, ("out",)),
        banks.contiguous("out_read", vk * nbytes, ("out",)),
        banks.contiguous("du_write", 4, ("kar",)),
        banks.Access("du_read", 4, lambda lane, _: lane * tpk * 4 if lane < keys else None, ("kar",)),
    ]
    return banks.model(accesses)


def _lower_grad(inst: KernelInstance, arch: Arch) -> KernelInstance:
    p, nbytes = inst.p, inst.dtype_bytes
    _check_knobs(p)
    g = geometry(p, nbytes, arch)
    if g["tpk"] > 32 or p["n"] % g["keys_per_cta"] or not is_pow2(g["keys_per_cta"]):
        raise Rejected("threads", f"threads={p['threads']} gives {g['keys_per_cta']} keys of {g['tpk']} lanes per CTA; "
                                  f"the keys must be a power of two dividing n={p['n']}")
    v_items = CHECKPOINT_EVERY * p["n"] // (16 // nbytes)
    v_batch = min(v_items // g["threads"], 4)
    if v_batch < 1 or v_items % (v_batch * g["threads"]):
        raise Rejected("threads", f"threads={g['threads']} do not split the window's {v_items} pieces of v evenly")
    if g["smem_bytes"] > arch.max_smem_per_block:
        raise Rejected("l", f"{g['smem_bytes']} bytes of shared memory exceed the {arch.max_smem_per_block} of a block")
    return inst.with_derived({**g, "bank": _bank(g, nbytes), "threads_param": "threads", "smem_param": "l"})


def _tune_runtime(shape: dict, dtype_bytes: int, sm_count: int) -> dict:
    return {"N": shape["N"], "T": shape["T"], "BH": shape["B"] * shape["H"], "sm_count": sm_count}


FAMILY = Family(
    name="rwkv_grad",
    axes={"dtype": ("fp32", "fp16", "bf16")},
    lowerings={GRAD: Lowering({"n": "int", "e": "int", "minb": "int", "threads": "int", "l": "int",
                               "float_v": "int0", "float_do": "int0", "prefetch": "int0"}, _lower_grad)},
    support_files={"rwkv_grad/params.cuh.j2": "rwkv_grad/params.cuh",
                   "rwkv/decay.cuh.j2": "rwkv_grad/decay.cuh",   # the forward's decay split, rendered for this family too
                   "rwkv_grad/op_impl.h.j2": "rwkv_grad/op_impl.h"},
    tune=TunePlan(("B", "H", "T", "N"), _tune_runtime),
    support_constants=CHECKPOINT_CONSTANTS,
    # The tuning workload (bench/workloads/rwkv_grad.py) sizes its checkpoints by it.
    exported_constants={"wkv_grad_checkpoint_every": "kCheckpointEvery"},
)
