"""Arch resource limits every instance must fit: threads per block and shared memory."""
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
