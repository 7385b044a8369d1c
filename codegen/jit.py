"""Instances built on first use: a dispatch key that no built instance covers (paged D=48, RWKV
N=96) gets an instance planned, rendered and compiled now, into a library of its own that the
runtime loads and registers with the op's dispatch (attngen/_jit.py).

The plan follows the spec: the dispatch rules are tried in order, and within a rule's kind the
built instances nearest in head size (from above first); a candidate is such an instance with
the head size replaced. Every lowering pass checks it (a rejection is a reason in the error,
as for a spec's grid), and the kind's `covers:` must accept the key. The library holds the
instance's TU, the family's support TUs it includes, and jit_entry.cu (its dispatch-table row).

The cache keeps one directory per instance and content hash (sources, compiler flags, and the
caller's toolchain tag), so a stale build is never loaded. Builds are process-safe: a file
lock per entry, a temporary directory renamed into place when the library is complete, so an
interrupted build leaves nothing another process would load.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import build as build_stage
from . import dispatch, lower, pipeline, render
from .arch import ARCHES
from .families import family
from .instance import KernelInstance
from .passes import Rejected
from .spec import Spec

# `make build`'s flags, linked into a library of its own.
NVCC_FLAGS = (*build_stage.NVCC_FLAGS, "-shared", "-Xcompiler=-fPIC", "-cudart=shared")
LIBRARY = "lib.so"


class Unbuildable(ValueError):
    """No instance can be planned for the key: the reasons say what each candidate lacked."""


class SizeIsBuilt(ValueError):
    """Built instances have the key's sizes: what they refuse (alignment, say) a new build of
    the same sizes would refuse too, and the op's own error says it best."""


@dataclass(frozen=True)
class Plan:
    spec: Spec
    inst: KernelInstance
    sources: dict        # {path inside the build directory: text}
    digest: str

    @property
    def entry_name(self) -> str:
        return f"{self.inst.name}-{self.digest}"


def spec_of(op: str) -> Spec:
    """The spec that declares `op` (specs/*.yaml)."""
    for spec in pipeline.load():
        if spec.op.name == op:
            return spec
    raise ValueError(f"no spec declares the op {op!r}")


def decode_key(spec: Spec, values) -> tuple[dict, dict]:
    """The numbers of `<op>_key` (dispatch.cpp.j2): the run-time variables, then each axis' index."""
    values_of = family(spec.family).axes
    names = list(spec.op.key)
    values = [int(v) for v in values]
    if len(values) != len(names) + len(spec.axes):
        raise ValueError(f"{spec.op.name}: a key of {len(values)} numbers, expected {len(names) + len(spec.axes)}")
    runtime = dict(zip(names, values))
    axes = {axis: values_of[axis][index] for axis, index in zip(spec.axes, values[len(names):])}
    return runtime, axes


def jit_variables(spec: Spec) -> list:
    """The run-time variables an instance built on first use takes its sizes from."""
    return list(family(spec.family).jit_params)


def _by_distance(instances, targets: dict):
    """Instances nearest to the target parameter values first, larger before smaller, keeping the
    dispatch order among equals."""
    def distance(inst):
        return tuple((abs(inst.p[param] - want), inst.p[param] < want) for param, want in targets.items())
    return sorted(instances, key=distance)


def plan(spec: Spec, runtime: dict, axes: dict, cache_tag: str = "") -> Plan:
    """The instance to build for a key that the spec's built instances do not cover."""
    jit_params = family(spec.family).jit_params
    if not jit_params:
        raise Unbuildable(f"{spec.op.name}: the {spec.family} family builds no instance on first use")
    (spec, instances), = pipeline.lower(pipeline.expand([spec]))  # with the tuned table's rules
    fallback = {name for name, kind in spec.kernels.items() if kind.role == "fallback"}
    instances = [i for i in instances if i.kind not in fallback]  # a fallback kind does not count as covering
    if dispatch.select(spec, instances, runtime, axes) is not None:
        raise ValueError(f"{spec.op.name}: the key is covered by a built instance; nothing to build")
    targets = {param: runtime[var] for var, param in jit_params.items()}
    if any(all(i.p[k] == v for k, v in targets.items()) for i in instances if i.a == axes):
        raise SizeIsBuilt(f"{spec.op.name}: instances with " + ", ".join(f"{k}={v}" for k, v in targets.items()) +
                          " are built; none covers this call")
    reasons = {}   # kind -> why its first candidate failed
    for rule in spec.dispatch:
        if rule.kind in fallback or not rule.when.evaluate(runtime):
            continue
        members = [i for i in dispatch.ordered(spec, instances, rule.kind) if i.a == axes]
        for inst in _by_distance(members, targets):
            candidate = inst.with_params(**targets)
            try:
                lowered = lower.lower_one(candidate)
            except Rejected as exc:
                reasons.setdefault(rule.kind, f"{candidate.name}: {exc.param}: {exc.reason}")
                continue
            if dispatch.covers(spec, lowered, runtime):
                sources = render_sources(spec, lowered)
                return Plan(spec, lowered, sources, digest(sources, cache_tag))
            reasons.setdefault(rule.kind, f"{candidate.name}: its covers "
                                          f"({spec.kernels[rule.kind].covers.text}) reject the call")
    raise Unbuildable(f"{spec.op.name}: no instance can be built for " +
                      ", ".join(f"{k}={v}" for k, v in {**runtime, **axes}.items()) +
                      (f" ({'; '.join(reasons.values())})" if reasons else " (no dispatch rule applies)"))


def _planned(spec: Spec, inst: KernelInstance, cache_tag: str) -> Plan:
    sources = render_sources(spec, inst)
    return Plan(spec, inst, sources, digest(sources, cache_tag))


def plan_named(spec: Spec, name: str, cache_tag: str = "") -> Plan:
    """The plan of a row of the spec's table by its name: what an extension built without its
    instances (codegen/core.py) asks for when its dispatch picks a row that is not built yet."""
    (spec, instances), = pipeline.lower(pipeline.expand([spec]))  # with the tuned table's rules
    for inst in instances:
        if inst.name == name:
            return _planned(spec, inst, cache_tag)
    raise Unbuildable(f"{spec.op.name}: the spec has no instance named {name} (the extension's table is "
                      "older than the specs: rebuild it)")


def row_plans(spec: Spec, cache_tag: str = "") -> list[Plan]:
    """The plans of every row of the spec's table, as plan_named makes each (one lowering)."""
    (spec, instances), = pipeline.lower(pipeline.expand([spec]))
    return [_planned(spec, inst, cache_tag) for inst in instances]


def plan_instance(spec: Spec, inst: KernelInstance, cache_tag: str = "") -> Plan:
    """A plan for an instance chosen by the caller (the bank check's unpadded twins), checked by
    every lowering pass but by no dispatch rule: it is reached by name (`<op>_with`)."""
    return _planned(spec, lower.lower_one(inst), cache_tag)


def render_sources(spec: Spec, inst: KernelInstance) -> dict:
    """Every file the library compiles, at the paths its #includes expect."""
    env = render.environment(pipeline.TEMPLATES_DIR)
    files = render.render_common(env)
    support = render.render_support(env, spec)
    for rel, text in support.items():
        if rel.endswith((".cuh", ".h")):
            files[rel] = text
    source = render.render_instance(env, spec, inst)
    files[inst.filename] = source
    for rel, text in support.items():
        # a support TU the instance uses (the paged split-K merge): its header is included
        if rel.endswith(".cu") and f'"{Path(rel).stem}.h"' in source:
            files[rel] = text
    runtime = render.key_env(spec)
    files[f"{spec.family}/jit_entry.cu"] = render._render(
        env, spec.file, "op/jit_entry.cu.j2", family=spec.family, inst=inst, role=spec.kernels[inst.kind].role,
        axes_match=render.axes_match_cpp(spec, inst.a), covers=spec.kernels[inst.kind].covers.to_cpp({**runtime, **inst.p}))
    return files


def digest(sources: dict, cache_tag: str) -> str:
    h = hashlib.sha256()
    for rel in sorted(sources):
        h.update(rel.encode() + b"\0" + sources[rel].encode() + b"\0")
    h.update(" ".join(NVCC_FLAGS).encode() + b"\0" + cache_tag.encode())
    return h.hexdigest()[:16]


def nvcc_path() -> str:
    """nvcc as `make build` finds it; a clear error when the toolkit is missing."""
    nvcc = os.environ.get("NVCC", os.path.join(build_stage.cuda_home(), "bin", "nvcc"))
    if not os.path.isfile(nvcc):
        raise RuntimeError(f"attngen: building an instance on first use needs nvcc, not found at {nvcc}; install "
                           "the CUDA toolkit (12.4 or later) and set CUDA_HOME, or set ATTNGEN_JIT=0")
    return nvcc


def compile_command(plan_: Plan, src_dir: Path, out: Path) -> list[str]:
    tus = [str(src_dir / rel) for rel in sorted(plan_.sources) if rel.endswith(".cu")]
    return [nvcc_path(), *NVCC_FLAGS, ARCHES[plan_.inst.arch].gencode, f"-I{src_dir / plan_.spec.family}",
            f"-I{src_dir}", "-o", str(out), *tus]


def run_nvcc(plan_: Plan, src_dir: Path, out: Path) -> None:
    cmd = compile_command(plan_, src_dir, out)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"attngen: nvcc failed building {plan_.inst.name} (exit {done.returncode}):\n"
                           f"{done.stderr[-4000:]}")


def library_path(cache_dir: Path, plan_: Plan) -> Path:
    return Path(cache_dir) / plan_.spec.family / plan_.entry_name / LIBRARY


def locked_build(final: Path, fill) -> Path:
    """The cache entry `final` (a directory), made now if no process has made it yet. Under the
    entry's lock: a finished entry is reused; otherwise `fill(tmp)` writes it into a temporary
    directory beside it, renamed into place only when fill returns, so an interrupted build
    leaves nothing another process would load."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.is_dir():      # another process finished it while this one waited
            return final
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
        try:
            fill(tmp)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


# Sources whose line info names them (nvcc -lineinfo): CUDA and C++ files.
LOCATED_SUFFIXES = (".cu", ".cuh", ".h")


def located(text: str, path: Path) -> str:
    """`text` headed by a #line directive naming `path`: the compiler's line info (what ncu's
    source view opens) then names where the file will be, not the temporary directory it is
    compiled in, which locked_build renames away."""
    name = str(path).replace("\\", "\\\\").replace('"', '\\"')
    return f'#line 1 "{name}"\n{text}'


def build(plan_: Plan, cache_dir: Path, compiler=run_nvcc, on_build=None) -> Path:
    """The library of `plan_` in the cache, built now if no process has built it yet: the
    sources are written and compiled in the entry's temporary directory (locked_build), each
    naming its place in the finished entry (located). `on_build` is called before a compile
    starts (the runtime's progress line)."""
    final_src = library_path(cache_dir, plan_).parent / "src"

    def fill(tmp: Path) -> None:
        if on_build is not None:
            on_build(plan_)
        src = tmp / "src"
        for rel, text in plan_.sources.items():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_text(located(text, final_src / rel) if rel.endswith(LOCATED_SUFFIXES) else text)
        compiler(plan_, src, tmp / LIBRARY)
        if not (tmp / LIBRARY).is_file():
            raise RuntimeError(f"attngen: building {plan_.inst.name} produced no library")
        (tmp / "instance.json").write_text(json.dumps(
            {"name": plan_.inst.name, "op": plan_.spec.op.name, "digest": plan_.digest,
             "params": plan_.inst.p, "axes": plan_.inst.a}, indent=1) + "\n")

    return locked_build(library_path(cache_dir, plan_).parent, fill) / LIBRARY
