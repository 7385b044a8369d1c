"""Instances built on first use, from the ops' side: when an op's dispatch finds no instance for
a call, the generator plans, renders and compiles one (codegen/jit.py) into the cache, and it is
registered with the op's dispatch; later calls and later processes load it from the cache.

  ATTNGEN_JIT=0     off: the op's "no compiled instance covers it" ValueError, as without it
  ATTNGEN_CACHE     the cache (default ~/.cache/attngen/torch-<version>/cuda-<version>, a directory per arch)

Eager calls only: inside torch.compile the uncovered call raises as before; an eager call
with the same shape builds and registers the instance, after which compiled code and CUDA
graphs use it like a prebuilt one.
"""
from __future__ import annotations

import ctypes
import importlib
import os
import sys
import time
from pathlib import Path

import torch

from . import _ext

_libraries: dict = {}                         # path -> the loaded library (kept open)


def enabled() -> bool:
    return os.environ.get("ATTNGEN_JIT", "1") != "0"


def toolchain_tag() -> str:
    """What a cached library was built against besides its sources: a change rebuilds it."""
    return f"torch-{torch.__version__}/cuda-{torch.version.cuda}"


def cache_root() -> Path:
    """Where this torch and CUDA's builds live: $ATTNGEN_CACHE, else ~/.cache/attngen/<torch>/<cuda>
    (one directory per arch below it)."""
    if os.environ.get("ATTNGEN_CACHE"):
        return Path(os.environ["ATTNGEN_CACHE"])
    return Path.home() / ".cache" / "attngen" / toolchain_tag()


def cache_dir(arch: str) -> Path:
    return cache_root() / arch


def call(op: str, run):
    """run(); if the op's dispatch finds no compiled instance for it (the typed signal its
    bindings record, read by the `take_uncovered` op), build the instance for that key (or the
    table's row it picked, in an extension built without its instances), register it, and run
    again. When none can be built, the op's error stands, with the generator's reasons added."""
    if torch.compiler.is_compiling() or not enabled():
        return run()
    try:
        return run()
    except ValueError as exc:
        uncovered_op, key, row = _take_uncovered()
        if uncovered_op != op:
            raise   # any other error: bad input, or a forced instance that does not cover the call
        jit = _generator()
        if jit is None:   # an installed package without the source tree: the op's error stands
            raise ValueError(f"{exc}\n(Not built on first use: {GENERATOR_MISSING})") from None
        try:
            ensure(op, key, row)
        except jit.SizeIsBuilt:
            raise exc from None   # not a missing size: the dispatch's own error
        except jit.Unbuildable as why:
            raise ValueError(f"{exc}\nNor can one be built on first use: {why}") from None
    return run()


def _take_uncovered() -> tuple[str, list, str]:
    """The op and key the last call on this thread found no built instance for ('' if none),
    and the table's row it picked when that row is only not built yet; cleared."""
    return torch.ops.attngen.take_uncovered()


GENERATOR_MISSING = ("building an instance on first use needs the generator and its specs and templates: "
                     "an installed attngen (attngen/_codegen, specs/, templates/) or the source tree on the Python path")


def _generator(module: str = "jit"):
    """A module of the generator (codegen.jit by default): the installed copy's (attngen._codegen,
    reading the specs and templates installed beside it) or the checkout's (codegen/); None where
    neither is at hand."""
    try:
        pipeline = importlib.import_module("._codegen.pipeline", __package__)
        package = pipeline.__package__
    except ModuleNotFoundError:
        try:
            pipeline = importlib.import_module("codegen.pipeline")
            package = "codegen"
        except ImportError:
            return None
    if not (pipeline.SPECS_DIR.is_dir() and pipeline.TEMPLATES_DIR.is_dir()):
        return None
    return importlib.import_module(f"{package}.{module}")


def cannot_build() -> list[str]:
    """Why an uncovered shape could not be built on first use here ([] where it can): the
    instances are compiled by nvcc into the cache and added to the built extension's dispatch."""
    reasons = []
    if not enabled():
        reasons.append("ATTNGEN_JIT=0")
    jit = _generator()
    if jit is None:
        reasons.append(GENERATOR_MISSING)
    else:
        try:
            jit.nvcc_path()
        except RuntimeError as exc:
            reasons.append(str(exc).removeprefix("attngen: "))
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} has no CUDA")
    return reasons


def built_core() -> Path | None:
    """The extension built without its instances for this generator and toolchain, if a process
    built it already (None where it is not, or no generator is at hand)."""
    core = _generator("core")
    if core is None:
        return None
    path = core.library_path(cache_root(), toolchain_tag())
    return path if path.is_file() else None


def core_library(missing: Path) -> Path:
    """Where no prebuilt extension is (`missing`): the extension built without its instances
    (codegen/core.py) in the cache, built now if no process has; its rows build on first use."""
    reasons = cannot_build()
    if reasons:
        raise RuntimeError(f"attngen: the extension {missing} is not built, and it cannot be built on first use "
                           f"here: {'; '.join(reasons)}. Build it ahead of time with `make build` in the checkout, "
                           "or ATTNGEN_PREBUILD=1 pip install --no-build-isolation .")
    core = _generator("core")
    started = time.monotonic()

    def announce(files):
        print(f"attngen: no prebuilt extension ({missing}); building its bindings and dispatch tables "
              f"({files} host files, no kernels) into {cache_root() / 'core'}; each kernel then builds on "
              "its first call", file=sys.stderr, flush=True)

    path = core.build(cache_root(), toolchain_tag(), on_build=announce)
    if time.monotonic() - started > 1:
        print(f"attngen: built the extension's bindings in {time.monotonic() - started:.0f} s ({path})",
              file=sys.stderr, flush=True)
    return path


def ensure(op: str, key_values, row: str = "") -> Path:
    """The library of the instance for this key (or of the table's row named `row`), built if no
    process built it yet, and registered with `op`'s dispatch. A key no instance can cover
    raises ValueError with the generator's reasons."""
    jit = _generator()
    if jit is None:
        raise RuntimeError(f"attngen: {GENERATOR_MISSING}")
    if row:
        known = _generator("core").built_row(cache_root(), toolchain_tag(), row)
        if known is not None:   # built by an earlier process for this core: no plan needed
            register(op, known)
            return known
    spec = jit.spec_of(op)
    runtime, axes = jit.decode_key(spec, key_values)
    if row:
        plan = jit.plan_named(spec, row, cache_tag=toolchain_tag())
    else:
        plan = jit.plan(spec, runtime, axes, cache_tag=toolchain_tag())
    started = time.monotonic()

    def announce(p):
        sizes = ", ".join(f"{var}={runtime[var]}" for var in jit.jit_variables(spec))
        print(f"attngen: building {op} {sizes} {' '.join(map(str, axes.values()))} for {p.inst.arch} "
              f"(first use; 5-8 s on the H100 machine): {p.inst.name}", file=sys.stderr, flush=True)

    path = jit.build(plan, cache_dir(plan.inst.arch), on_build=announce)
    if time.monotonic() - started > 1:
        print(f"attngen: built {plan.inst.name} in {time.monotonic() - started:.0f} s ({path.parent})",
              file=sys.stderr, flush=True)
    if row:
        _generator("core").record_row(cache_root(), toolchain_tag(), row, path)
    register(op, path)
    return path


def register(op: str, path: Path) -> None:
    """Load a built library and add its instance to `op`'s dispatch (once per process)."""
    key = str(path)
    if key in _libraries:
        return
    _ext.load()
    library = ctypes.CDLL(key)
    entry = ctypes.cast(library.attngen_jit_entry, ctypes.c_void_p).value
    torch.ops.attngen.register_jit(op, entry)
    _libraries[key] = library
