"""Resource limits of the target architectures the passes check against."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    name: str                 # as written in a spec and in instance names: sm_90a
    gencode: str              # nvcc flag that targets it
    max_threads_per_block: int
    max_smem_per_block: int   # bytes, opt-in dynamic limit
    default_smem_per_block: int  # bytes a kernel gets without cudaFuncSetAttribute
    regs_per_sm: int
    smem_per_sm: int = 228 * 1024     # bytes shared by the resident CTAs, each also reserving...
    smem_reserved_per_cta: int = 1024  # ...this much (CUDA programming guide, CC 8.0 and 9.0)
    max_threads_per_sm: int = 2048
    max_ctas_per_sm: int = 32
    # The shared-memory sizes (KB) an SM's unified data cache can be carved to; a kernel's
    # preferred carveout (a percentage of smem_per_sm) is rounded up to one of them (CUDA
    # programming guide, CC 9.0; CC 8.0 stops at 164).
    smem_configs_kb: tuple = (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)

    @property
    def short(self) -> str:
        return self.name.replace("_", "")

    @property
    def compute(self) -> int:
        """Compute capability as a number: 90 for sm_90a."""
        return int(self.name[3:].rstrip("a"))


ARCHES = {
    # Hopper: 227 KB of shared memory per block once opted in (CUDA programming guide, CC 9.0).
    "sm_90a": Arch("sm_90a", "-gencode=arch=compute_90a,code=sm_90a", 1024, 227 * 1024,
                   48 * 1024, 65536),
    "sm_90": Arch("sm_90", "-gencode=arch=compute_90,code=sm_90", 1024, 227 * 1024,
                  48 * 1024, 65536),
    "sm_80": Arch("sm_80", "-gencode=arch=compute_80,code=sm_80", 1024, 163 * 1024,
                  48 * 1024, 65536, smem_per_sm=164 * 1024, smem_configs_kb=(0, 8, 16, 32, 64, 100, 132, 164)),
}

# Registers a thread may hold (PTX ISA: 255 on every arch the specs target).
MAX_REGS = 255

# e4m3: float8_e4m3fn operands (the FP8 forward; its output and accumulation are wider).
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "e4m3": 1}
DTYPE_CPP = {"fp32": "float", "fp16": "__half", "bf16": "__nv_bfloat16", "e4m3": "__nv_fp8_e4m3"}

# The N extents of wgmma.mma_async m64nNk16 that templates/common/wgmma.cuh instantiates
# (PTX allows multiples of 8 up to 256; a kernel using another N fails to compile, naming it).
WGMMA_N = (32, 48, 64, 96, 128, 192, 256)
