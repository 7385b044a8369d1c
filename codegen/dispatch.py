"""The dispatch decision, in Python: the same rules and the same expressions the generated
C++ table evaluates, for the tuner (which instance would the default rules pick?) and for
tests that compare the two."""
from __future__ import annotations

from dataclasses import dataclass

from .instance import KernelInstance
from .spec import Spec


@dataclass(frozen=True)
class TunedRule:
    """A bucket's winner: when `when` holds and the axes match, try these instances first."""
    bucket: str
    when: object          # expr.Expr over the run-time variables
    instances: tuple      # KernelInstance, one per (dtype, direction) it serves
    source: str


def covers(spec: Spec, inst: KernelInstance, runtime: dict) -> bool:
    kind = spec.kernels[inst.kind]
    return bool(kind.covers.evaluate({**runtime, **inst.p}))


def ordered(spec: Spec, instances, kind: str):
    prefer = spec.kernels[kind].prefer
    return sorted((i for i in instances if i.kind == kind), key=lambda i: tuple(i.p[k] for k in prefer))


def select(spec: Spec, instances: list[KernelInstance], runtime: dict, axes: dict) -> KernelInstance | None:
    """The instance the generated table launches for `runtime` (E, M, L, BH, align, sm_count)
    and `axes` (dtype, direction); None where it raises the unsupported-shape error. The
    tuned rules attached to the spec come first, as in the generated table."""
    for rule in spec.tuned:
        if rule.when.evaluate(runtime):
            for inst in rule.instances:
                if inst.a == axes and covers(spec, inst, runtime):
                    return inst
    for rule in spec.dispatch:
        if not rule.when.evaluate(runtime):
            continue
        for inst in ordered(spec, instances, rule.kind):
            if inst.a == axes and covers(spec, inst, runtime):
                return inst
    return None


def first_covering(spec: Spec, instances: list[KernelInstance], kind: str, runtime: dict,
                   axes: dict) -> KernelInstance | None:
    """The instance of `kind` that the generated table would try first for `runtime` and `axes`
    (benchmarks and tests forcing one kind)."""
    return next((i for i in ordered(spec, instances, kind) if i.a == axes and covers(spec, i, runtime)), None)
