"""The kernel instance: the single source of truth for one generated kernel.

Its name, file name, launcher symbol, template arguments, dispatch key and build edge all
derive from its fields, so they cannot drift apart.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .arch import ARCHES, DTYPE_BYTES, DTYPE_CPP


@dataclass(frozen=True)
class KernelInstance:
    family: str
    op: str
    kind: str
    template: str
    arch: str
    axes: tuple            # (("dtype", "fp32"), ("direction", "fwd")): matched exactly at run time
    params: tuple          # (("e", 64), ...): in the template's declared order
    spec_file: str
    derived: tuple = field(default=(), compare=False)  # filled by the passes

    # ---- names -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        # Every axis value is in the name (dtype last, with the arch): instances that differ
        # only in an axis must not share a file.
        a = self.a
        parts = [self.family] + [v for k, v in self.axes if k != "dtype"] + [self.kind]
        parts += [f"{k}{v}" for k, v in self.params]
        parts += [a.get("dtype", ""), ARCHES[self.arch].short]
        return "_".join(p for p in parts if p)

    @property
    def filename(self) -> str:
        return f"{self.family}/{self.name}.cu"

    @property
    def launcher(self) -> str:
        return f"launch_{self.name}"

    @property
    def workspace(self) -> str:
        """Host function: scratch bytes a launch with given params needs (0: none)."""
        return f"workspace_{self.name}"

    # ---- views -------------------------------------------------------------------------
    @property
    def p(self) -> dict:
        return dict(self.params)

    @property
    def a(self) -> dict:
        return dict(self.axes)

    @property
    def d(self) -> dict:
        return dict(self.derived)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.a["dtype"]]

    @property
    def ctype(self) -> str:
        return DTYPE_CPP[self.a["dtype"]]

    def with_params(self, **updates) -> "KernelInstance":
        params = tuple((k, updates.get(k, v)) for k, v in self.params)
        return replace(self, params=params)

    def with_derived(self, derived: dict) -> "KernelInstance":
        return replace(self, derived=tuple(derived.items()))
