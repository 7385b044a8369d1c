"""The extension built without its instances: every op's bindings and its full dispatch table,
whose rows get their kernels on first use (codegen/jit.py builds the instance a call picks and
the runtime registers it under the row's name). It is what an installed attngen builds when it
is first imported on a GPU machine with no prebuilt extension: host C++ only, one object per
op's bindings and table, so an install compiles no kernel it does not call.

The cache keeps one directory per hash of what the generator reads (its own code, the specs,
templates and tuned tables) and the caller's toolchain tag, so an edited spec or another torch
never loads a stale table. A build runs under the entry's file lock in a temporary directory
that is renamed into place when the library is linked (jit.locked_build).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import build as build_stage
from . import jit, ninja, pipeline, render

LIBRARY = "attngen_ext.so"
# Inside an entry: the sources under generated/, ninja's outputs under build/, the library in lib/.
LAYOUT = ninja.Layout(gen="generated", build="build", extension=f"lib/{LIBRARY}")
GENERATOR_DIR = Path(__file__).resolve().parent


def _inputs() -> list[tuple[str, Path]]:
    """Every file the generator reads to render the extension (its code, specs, templates and
    tuned tables), named relative to its folder, in a fixed order."""
    roots = {"codegen": GENERATOR_DIR, "specs": pipeline.SPECS_DIR, "templates": pipeline.TEMPLATES_DIR,
             "tuned": pipeline.ROOT / "tuned"}
    return [(f"{label}/{p.relative_to(root).as_posix()}", p) for label, root in roots.items() if root.is_dir()
            for p in sorted(root.rglob("*")) if p.is_file() and p.suffix in (".py", ".yaml", ".j2")]


def digest(cache_tag: str) -> str:
    """The hash of the generator's inputs and the toolchain: what names a built core in the cache.
    Reading the files costs milliseconds, so a process finds its built core without rendering."""
    h = hashlib.sha256()
    for name, path in _inputs():
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(cache_tag.encode())
    return h.hexdigest()[:16]


def entry_dir(cache_root: Path, cache_tag: str) -> Path:
    return Path(cache_root) / "core" / digest(cache_tag)


def library_path(cache_root: Path, cache_tag: str) -> Path:
    return entry_dir(cache_root, cache_tag) / LAYOUT.extension


def sources() -> dict[str, str]:
    """The extension's host files (bindings, tables with no launchers, build.ninja), rendered
    with the tuned tables' rules as `make gen` renders them."""
    lowered = pipeline.lower(pipeline.expand(pipeline.load()))
    return render.render_all(pipeline.TEMPLATES_DIR, lowered, layout=LAYOUT, built=False)


def run_ninja(entry: Path, jobs: int | None = None) -> None:
    """Compile and link in `entry` (the build file reads build/toolchain.ninja, written here)."""
    reason = build_stage.write_toolchain(entry / LAYOUT.build)
    if reason is not None:
        raise RuntimeError(f"attngen: cannot link the extension: {reason}")
    cmd = build_stage.ninja_command(["extension"], jobs, f"{LAYOUT.gen}/build.ninja")
    done = subprocess.run(cmd, cwd=entry, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"attngen: building the extension's bindings failed (exit {done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-4000:]}")


def build(cache_root: Path, cache_tag: str, builder=run_ninja, on_build=None) -> Path:
    """The core library in the cache, built now if no process has built it yet. `on_build(n)` is
    called before a build starts, with the number of files it compiles."""
    def fill(tmp: Path) -> None:
        files = sources()
        if on_build is not None:
            on_build(sum(rel.endswith(".cpp") for rel in files))
        render.write_tree(tmp / LAYOUT.gen, files)
        builder(tmp)
        if not (tmp / LAYOUT.extension).is_file():
            raise RuntimeError("attngen: building the extension's bindings produced no library")

    return jit.locked_build(entry_dir(cache_root, cache_tag), fill) / LAYOUT.extension


# Rows built on first use, by name: for the core of one digest, a row's instance has one set of
# sources, so the library built for it once is the library for every later process. The index
# spares a process the plan (lowering the spec's whole grid, seconds) just to find that library.
def _row_record(cache_root: Path, cache_tag: str, name: str) -> Path:
    return Path(cache_root) / "core" / f"{digest(cache_tag)}.rows" / name


def built_row(cache_root: Path, cache_tag: str, name: str) -> Path | None:
    """The library a process built for the row `name` of this core, or None."""
    record = _row_record(cache_root, cache_tag, name)
    if not record.is_file():
        return None
    library = Path(record.read_text().strip())
    return library if library.is_file() else None


def record_row(cache_root: Path, cache_tag: str, name: str, library: Path) -> None:
    record = _row_record(cache_root, cache_tag, name)
    record.parent.mkdir(parents=True, exist_ok=True)
    tmp = record.with_name(f".{name}.{os.getpid()}")
    tmp.write_text(f"{library}\n")
    os.replace(tmp, record)


def prebuild(cache_root: Path, cache_tag: str, families: list[str], arch_dir, jobs: int | None = None,
             builder=run_ninja, compiler=jit.run_nvcc, on_row=None) -> list[Path]:
    """The core and every row of `families`' tables built ahead of their first use, `jobs`
    compiles at a time (nvcc processes: threads only wait on them), each row recorded by name as
    a first use records it: a process then runs those families' ops, forced instances included,
    with no compile. `arch_dir(arch)` is the runtime's directory of an arch's instances;
    `on_row(plan, library)` follows each row. -> the rows' libraries."""
    specs = pipeline.load()
    unknown = sorted(set(families) - {spec.family for spec in specs})
    if unknown:
        raise ValueError(f"no spec declares the families {unknown}; the specs' families are "
                         f"{sorted({spec.family for spec in specs})}")
    build(cache_root, cache_tag, builder=builder)
    plans = [plan for spec in specs if spec.family in families for plan in jit.row_plans(spec, cache_tag)]

    def one(plan: jit.Plan) -> Path:
        library = jit.build(plan, arch_dir(plan.inst.arch), compiler=compiler)
        record_row(cache_root, cache_tag, plan.inst.name, library)
        if on_row is not None:
            on_row(plan, library)
        return library

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        return list(pool.map(one, plans))
