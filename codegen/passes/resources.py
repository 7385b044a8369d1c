"""Arch resource limits every instance must fit (threads per block and shared memory), and the
shared-memory carveout that holds a kernel at the CTAs an SM it was planned for."""
from __future__ import annotations

from ..arch import Arch
from ..instance import KernelInstance


def check(inst: KernelInstance, arch: Arch) -> None:
    from . import Rejected

    d = inst.d
    threads, smem = d["threads"], d["smem_bytes"]
    if threads > arch.max_threads_per_block:
        raise Rejected(d.get("threads_param", "tph"),
                       f"{threads} threads per block exceed the {arch.name} limit of "
                       f"{arch.max_threads_per_block}")
    if threads % 32:
        raise Rejected(d.get("threads_param", "tph"), f"{threads} threads is not a whole number of warps")
    if smem > arch.max_smem_per_block:
        raise Rejected(d.get("smem_param", "chunk"),
                       f"shared memory {smem} bytes ({smem / 1024:.1f} KB) exceeds the {arch.name} "
                       f"limit of {arch.max_smem_per_block} bytes ({arch.max_smem_per_block // 1024} KB)")


def smem_carveout(ctas_per_sm: int, smem: int, arch: Arch) -> int:
    """The smallest shared-memory carveout (percent of an SM's) that holds `ctas_per_sm` CTAs of
    `smem` bytes each. Set on a kernel whose registers admit more CTAs than it was planned (and
    timed) at, it keeps it at that many wherever one more CTA overflows the size the driver rounds
    the percentage up to (the RWKV-7 forward's unit test checks its case)."""
    need = ctas_per_sm * (smem + arch.smem_reserved_per_cta)
    return min(100, -(-100 * need // arch.smem_per_sm))
