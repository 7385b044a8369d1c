"""Family plug-ins: what each family adds to the generic pipeline, declared once per family as
a `Family` (each codegen/families/<name>.py defines `FAMILY`). The pipeline reads a family
only through this interface; nothing outside a family's module tests one of its kind names."""
from __future__ import annotations

import importlib
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..arch import Arch
from ..instance import KernelInstance


@dataclass(frozen=True)
class Lowering:
    """One kernel template's lowering: its grid parameters (name -> "int", "int0" or "auto_ok",
    in instance-name order) and the function that resolves an instance's geometry, shared
    memory and bank model, raising passes.Rejected for an impossible one."""
    params: Mapping[str, str]
    lower: Callable[[KernelInstance, Arch], KernelInstance]
    # C++ expression of the dynamic shared memory a launch needs, where it depends on run-time
    # sizes (read from the Params `p`); None: the lowered `smem_bytes`.
    smem_at_runtime: Callable[[KernelInstance], str] | None = None


@dataclass(frozen=True)
class TunePlan:
    """The planning half of a family's tuning workload (the measuring half, which makes inputs
    and calls instances on the GPU, is bench/workloads/<family>.py): the dims of a bucket's
    representative shape, the axis values candidates are timed at besides dtype (the winner then
    serves every value: the same code either way), and the dispatch variables the generated
    table computes for contiguous inputs of a shape."""
    shape_dims: tuple[str, ...]
    runtime: Callable[[dict, int, int], dict] | None   # (shape, dtype_bytes, sm_count) -> key variables; None: not tuned yet
    axes: Mapping[str, str] = field(default_factory=dict)
    flags: tuple[str, ...] = ()   # shape dims that are switches (0 or 1: flash attention's causal), not sizes
    defaults: Mapping[str, int] = field(default_factory=dict)   # shape dims a bucket may leave out, and their value then


@dataclass(frozen=True)
class Family:
    name: str
    axes: Mapping[str, tuple]                 # the values each spec axis may take, in key order
    lowerings: Mapping[str, Lowering]         # template path -> its lowering
    support_files: Mapping[str, str]          # template -> output rendered once per family
    tune: TunePlan
    # Built on first use (codegen/jit.py): run-time key variable -> the grid parameter that takes
    # its value; empty: the family builds nothing on first use.
    jit_params: Mapping[str, str] = field(default_factory=dict)
    support_constants: Mapping[str, object] = field(default_factory=dict)  # for the support templates
    exported_constants: Mapping[str, str] = field(default_factory=dict)    # op name -> C++ constant
    derived_names: frozenset = frozenset({"dtype_bytes"})  # names `where:` may use besides the grid

    def lowering(self, inst: KernelInstance) -> Lowering:
        return self.lowerings[inst.template]

    def lower(self, inst: KernelInstance, arch: Arch) -> KernelInstance:
        return self.lowering(inst).lower(inst, arch)

    def smem_bytes_at_runtime(self, inst: KernelInstance) -> str:
        at_runtime = self.lowering(inst).smem_at_runtime
        return at_runtime(inst) if at_runtime else str(inst.d["smem_bytes"])


def names() -> list[str]:
    """The families that have a plug-in (codegen/families/<name>.py)."""
    return sorted(p.stem for p in Path(__file__).parent.glob("*.py") if p.stem != "__init__")


def family(name: str) -> Family | None:
    """The declared plug-in of family `name`, or None if there is none."""
    if not name.isidentifier():
        return None
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        return None
    return module.FAMILY
