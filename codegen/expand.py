"""Stage 2, expand: each kernel kind's grid (cartesian product, filtered by `where:`) ->
KernelInstances, crossed with the spec's axes (dtype, direction)."""
from __future__ import annotations

import itertools

from .arch import DTYPE_BYTES
from .errors import SpecError
from .expr import ExprError
from .instance import KernelInstance
from .spec import KernelKind, Spec


def where_env(params: dict, axes: dict) -> dict:
    env = dict(params)
    env.update(axes)
    env["dtype_bytes"] = DTYPE_BYTES[axes["dtype"]]
    return env


def expand_kind(spec: Spec, kind: KernelKind) -> list[KernelInstance]:
    out = []
    axis_names = list(spec.axes)
    for axis_values in itertools.product(*spec.axes.values()):
        axes = dict(zip(axis_names, axis_values))
        for values in itertools.product(*kind.grid.values()):
            params = dict(zip(kind.grid, values))
            if not _where_holds(spec, kind, params, axes):
                continue
            out.append(KernelInstance(
                family=spec.family, op=spec.op.name, kind=kind.name, template=kind.template,
                arch=spec.arch, axes=tuple(axes.items()), params=tuple(params.items()),
                spec_file=spec.file))
    return out


def _where_holds(spec: Spec, kind: KernelKind, params: dict, axes: dict) -> bool:
    env = where_env(params, axes)
    for i, cond in enumerate(kind.where):
        if any(env.get(n) == "auto" for n in cond.names()):
            raise SpecError(spec.file, kind.line, f"kernels.{kind.name}.where[{i}]",
                            "a where: condition cannot use a parameter set to 'auto'")
        line = kind.where_lines[i] if i < len(kind.where_lines) else kind.line
        try:
            if not cond.evaluate(env):
                return False
        except ExprError as exc:
            raise SpecError(spec.file, line, f"kernels.{kind.name}.where[{i}]", f"{exc} (at {params})") from None
    return True


def expand(spec: Spec) -> list[KernelInstance]:
    """All instances of the spec, in kind order; a kind whose grid yields nothing is an error."""
    instances = []
    for kind in spec.kernels.values():
        got = expand_kind(spec, kind)
        if not got:
            raise SpecError(spec.file, kind.line, f"kernels.{kind.name}",
                            "the grid and its where: constraints leave no instance")
        instances += got
    return instances


def unused_grid_values(spec: Spec) -> list[str]:
    """Grid values that no instance of their kind keeps after `where:` (a value added to a grid
    that a constraint then filters out entirely would otherwise vanish in silence), as
    `file:line: field: message` warnings."""
    warnings = []
    for kind in spec.kernels.values():
        got = expand_kind(spec, kind)
        for param, values in kind.grid.items():
            used = {inst.p[param] for inst in got}
            for value in values:
                if value not in used:
                    line = kind.param_lines.get(param, kind.line)
                    warnings.append(f"{spec.file}:{line}: kernels.{kind.name}.grid.{param}: value {value!r} leaves no "
                                    f"instance after the kind's where: constraints")
    return warnings
