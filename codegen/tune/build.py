"""Compile the candidates into their own extension under build/tune/<spec>/ (op namespace
attngen_tune), never touching the installed one. A candidate that fails to compile is
dropped from the extension and reported, not fatal."""
from __future__ import annotations

import re
import subprocess

from .. import ninja, render
from ..build import build_lock, ninja_command, write_toolchain
from ..pipeline import ROOT, TEMPLATES_DIR

NAMESPACE = "attngen_tune"


def layout_for(stem: str) -> ninja.Layout:
    base = f"build/tune/{stem}"
    return ninja.Layout(gen=f"{base}/generated", build=base, extension=f"{base}/lib/{NAMESPACE}_ext.so")


def render_candidates(spec, instances, layout):
    files = render.render_all(TEMPLATES_DIR, [(spec, instances)], namespace=NAMESPACE, layout=layout)
    render.write_tree(ROOT / layout.gen, files)
    return files


def _still_dirty(ninja_file: str, jobs) -> set[str]:
    out = subprocess.run(ninja_command(["objects"], jobs, ninja_file) + ["-n"], cwd=ROOT,
                         capture_output=True, text=True).stdout
    return set(re.findall(r"\] \w+ (\S+\.o)", out))


def build(spec, instances, jobs=None):
    """(extension path, {instance name: failure}, {name: rendered source})."""
    layout = layout_for(spec.stem)
    ninja_file = f"{layout.gen}/build.ninja"
    failed = {}
    with build_lock(ROOT / "build"):
        reason = write_toolchain(ROOT / "build")
        if reason:
            raise SystemExit(f"tune: cannot build candidates: {reason}")
        files = render_candidates(spec, instances, layout)
        print(f"tune: compiling {len(instances)} candidates into {layout.build}/ (ninja)", flush=True)
        subprocess.call(ninja_command(["objects"], jobs, ninja_file, keep_going=True), cwd=ROOT)
        dirty = _still_dirty(ninja_file, jobs)
        if dirty:
            for inst in instances:
                if f"{layout.build}/obj/{inst.filename[:-3]}.o" in dirty:
                    failed[inst.name] = "failed to compile"
            survivors = [i for i in instances if i.name not in failed]
            files = render_candidates(spec, survivors, layout)
            subprocess.call(ninja_command(["objects"], jobs, ninja_file, keep_going=True), cwd=ROOT)
        rc = subprocess.call(ninja_command(["extension"], jobs, ninja_file), cwd=ROOT)
        if rc != 0:
            raise SystemExit("tune: linking the candidate extension failed")
    sources = {i.name: files.get(i.filename, "") for i in instances}
    return ROOT / layout.extension, failed, sources
