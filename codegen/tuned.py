"""The tuned table: tuned/<arch>/<spec stem>.yaml. Written by the tuner, read by `make gen`,
which emits its winners as dispatch rules ahead of the spec's default rules."""
from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import yaml

from .dispatch import TunedRule
from .errors import SpecError
from .instance import KernelInstance
from .spec import Spec
from .yamlloc import LocDict, LocList, load_located

# `tuned`: the day an entry was measured, where a later run re-timed other buckets only (the
# header's date is the last run's).
ENTRY_KEYS = {"bucket", "dtype", "serves", "kind", "params", "instance", "time_ms", "spread_ms",
              "runner_up", "runner_up_ms", "default", "default_ms", "speedup_vs_default", "candidates", "tuned"}


def table_path(root: Path, spec: Spec) -> Path:
    return root / "tuned" / spec.arch / f"{spec.stem}.yaml"


def write(path: Path, header: dict, entries: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = ("# Written by `make tune`: the winner per shape bucket and dtype, measured on the device\n"
            "# below. `make gen` emits these as dispatch rules ahead of the spec's default rules.\n")
    text += yaml.safe_dump({**header, "buckets": entries}, sort_keys=False, width=110)
    path.write_text(text)


def tuned_instances(spec: Spec, entry: LocDict, file: str, fixed: dict | None = None) -> list[KernelInstance]:
    """The instances a table entry adds: its kind and params for each dtype it serves and each
    value of the other axes, or only the value its bucket fixes (`fixed`, the bucket's axes)."""
    kind = spec.kernels.get(entry["kind"])
    if kind is None:
        raise SpecError(file, entry.line_of("kind"), "kind", f"unknown kernel kind {entry['kind']!r} in {spec.file}")
    params = entry["params"]
    if not isinstance(params, LocDict) or set(params) != set(kind.grid):
        raise SpecError(file, entry.line_of("params"), "params",
                        f"expected exactly the parameters {list(kind.grid)} of kind {kind.name!r}")
    # The winner serves every value of the axes other than dtype (direction, keys): the same
    # code walking the other way or with the other axis as output; but of an axis its bucket
    # fixes (the delta rule's variant), only the value it was timed at.
    fixed = fixed or {}
    axes = [[(axis, value) for value in (entry["serves"] if axis == "dtype" else
                                         (fixed[axis],) if axis in fixed else values)]
            for axis, values in spec.axes.items()]
    return [KernelInstance(family=spec.family, op=spec.op.name, kind=kind.name, template=kind.template,
                           arch=spec.arch, axes=combo, params=tuple((p, params[p]) for p in kind.grid),
                           spec_file=spec.file)
            for combo in itertools.product(*axes)]


def load_rules(spec: Spec, path: Path, lower, display: str | None = None) -> tuple[list[KernelInstance], tuple]:
    """(instances to add to the build, TunedRules in bucket order) from a tuned table;
    `lower` lowers one instance (raising passes.Rejected when impossible); `display` is the
    path errors and generated comments show (repo-relative, so output is the same anywhere)."""
    from .passes import Rejected

    file = display or str(path)
    doc = load_located(path.read_text(), file)
    entries = doc.get("buckets") if isinstance(doc, LocDict) else None
    if not isinstance(entries, LocList):
        raise SpecError(file, getattr(doc, "line", 1), "buckets", "expected a list of tuned buckets")
    if spec.tune is None:
        raise SpecError(file, 1, "buckets", f"{spec.file} has no tune: section to define the buckets")
    buckets = {b.name: b for b in spec.tune.buckets}
    per_bucket: dict[str, list] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, LocDict) or not {"bucket", "kind", "params", "serves"} <= set(entry):
            raise SpecError(file, entries.line_of(i), f"buckets[{i}]", "expected bucket, kind, params and serves")
        unknown = set(entry) - ENTRY_KEYS
        if unknown:
            raise SpecError(file, entry.line_of(sorted(unknown)[0]), f"buckets[{i}]", f"unknown keys {sorted(unknown)}")
        if entry["bucket"] not in buckets:
            raise SpecError(file, entry.line_of("bucket"), f"buckets[{i}].bucket",
                            f"no bucket {entry['bucket']!r} in {spec.file}; expected one of {list(buckets)}")
        lowered = []
        for inst in tuned_instances(spec, entry, file, buckets[entry["bucket"]].axes):
            try:
                lowered.append(lower(inst))
            except Rejected as rej:
                raise SpecError(file, entry.line_of("params"), f"buckets[{i}].params.{rej.param}", rej.reason) from None
        per_bucket.setdefault(entry["bucket"], []).extend(lowered)
    rules = tuple(TunedRule(b.name, b.when, tuple(per_bucket[b.name]), f"{file}: bucket {b.name}: when {b.when.text}")
                  for b in spec.tune.buckets if b.name in per_bucket)
    instances = [inst for rule in rules for inst in rule.instances]
    return instances, rules


def attach(spec: Spec, rules: tuple) -> Spec:
    return replace(spec, tuned=rules)
