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


def carveout_bytes(percent: int, arch: Arch) -> int:
    """The shared memory an SM is carved to for a preferred carveout of `percent`: the smallest
    configuration the arch supports that holds the percentage."""
    want = percent * arch.smem_per_sm / 100
    return min(kb * 1024 for kb in arch.smem_configs_kb if kb * 1024 >= want)


def smem_carveout(ctas_per_sm: int, smem: int, arch: Arch, knob: str) -> int:
    """The smallest shared-memory carveout (percent of an SM's) that holds `ctas_per_sm` CTAs of
    `smem` bytes each and, once the driver rounds it up to a configuration, not one more. Set on
    a kernel whose registers admit more CTAs than it was planned (and timed) at, it keeps it at
    that many; where no configuration separates the two, the instance is refused at `knob`."""
    from . import Rejected

    per_cta = smem + arch.smem_reserved_per_cta
    percent = min(100, -(-100 * ctas_per_sm * per_cta // arch.smem_per_sm))
    carved = carveout_bytes(percent, arch)
    if carved // per_cta != ctas_per_sm:
        raise Rejected(knob, f"no shared-memory carveout holds {ctas_per_sm} CTAs of {per_cta} bytes an SM and "
                             f"not {ctas_per_sm + 1}: {percent}% rounds to {carved // 1024} KB, which holds "
                             f"{carved // per_cta}")
    return percent
