"""Candidates: each tuning grid expanded (tuned dtypes, and the one value of each other axis
that the family's workload times: causal linear's forward direction, rwkv's forward scan with
the keys contracted) and lowered; impossible ones are reported."""
from __future__ import annotations

from dataclasses import replace

from .. import expand, lower
from ..families import family
from ..spec import Spec


def tuning_spec(spec: Spec) -> Spec:
    """The spec with its kinds' grids replaced by the tuning grids, over the tuned axes."""
    kinds = {name: spec.tune.kernels.get(name, kind) for name, kind in spec.kernels.items()}
    timed = {axis: (value,) for axis, value in family(spec.family).tune.axes.items()}
    axes = {**spec.axes, "dtype": spec.tune.dtypes, **timed}
    return replace(spec, kernels=kinds, axes=axes, tuned=())


def candidates(spec: Spec):
    """(lowered candidates, rejections) of every tuned kind."""
    tspec = tuning_spec(spec)
    raw = [inst for name in spec.tune.kernels for inst in expand.expand_kind(tspec, tspec.kernels[name])]
    lowered, rejected = lower.lower_all(tspec, raw, strict=False)
    return lowered, rejected
