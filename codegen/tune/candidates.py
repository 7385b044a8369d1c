"""Candidates: each tuning grid expanded (tuned dtypes, and the values of the other axes that
the buckets are timed at: the family's TunePlan value, such as causal linear's forward
direction or rwkv's forward scan with the keys contracted, unless a bucket fixes its own, such
as the delta rule's variant) and lowered; impossible ones are reported."""
from __future__ import annotations

from dataclasses import replace

from .. import expand, lower
from ..families import family
from ..spec import Bucket, Spec


def timed_axes(spec: Spec, bucket: Bucket) -> dict:
    """The axis values besides dtype that `bucket`'s candidates are timed at."""
    return {**family(spec.family).tune.axes, **bucket.axes}


def tuning_spec(spec: Spec) -> Spec:
    """The spec with its kinds' grids replaced by the tuning grids, over the tuned axes."""
    kinds = {name: spec.tune.kernels.get(name, kind) for name, kind in spec.kernels.items()}
    timed: dict = {}
    for bucket in spec.tune.buckets:
        for axis, value in timed_axes(spec, bucket).items():
            timed.setdefault(axis, set()).add(value)
    axes = {**spec.axes, "dtype": spec.tune.dtypes,
            **{axis: tuple(v for v in spec.axes[axis] if v in values) for axis, values in timed.items()}}
    return replace(spec, kernels=kinds, axes=axes, tuned=())


def candidates(spec: Spec):
    """(lowered candidates, rejections) of every tuned kind."""
    tspec = tuning_spec(spec)
    raw = [inst for name in spec.tune.kernels for inst in expand.expand_kind(tspec, tspec.kernels[name])]
    lowered, rejected = lower.lower_all(tspec, raw, strict=False)
    return lowered, rejected
