"""The pipeline, stage by stage: load -> expand -> lower -> render -> write."""
from __future__ import annotations

from pathlib import Path

from . import expand as expand_stage
from . import ninja
from . import lower as lower_stage
from . import render
from . import tuned as tuned_table
from .spec import Spec, load_spec

ROOT = Path(__file__).resolve().parent.parent
SPECS_DIR = ROOT / "specs"
TEMPLATES_DIR = ROOT / "templates"
GENERATED_DIR = ROOT / "generated"


def spec_files(paths=None) -> list[Path]:
    if paths:
        return [Path(p) for p in paths]
    return sorted(SPECS_DIR.glob("*.yaml"))


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def load(paths=None, templates_dir: Path = TEMPLATES_DIR) -> list[Spec]:
    specs = []
    for path in spec_files(paths):
        spec = load_spec(path, templates_dir)
        specs.append(spec.__class__(**{**spec.__dict__, "file": _display(path)}))
    return specs


def expand(specs: list[Spec]):
    return [(spec, expand_stage.expand(spec)) for spec in specs]


def lower(expanded, use_tuned: bool = True, bench: bool = False):
    """Lower every instance and keep those of the build: the shipped extension's (every role
    but bench), or with `bench` the benchmark extension's (bench-role kinds only). With
    use_tuned, a spec's tuned table (tuned/<arch>/<stem>.yaml) adds its winners to the shipped
    build and its rules to the spec."""
    out = []
    for spec, instances in expanded:
        lowered, _ = lower_stage.lower_all(spec, instances, strict=True)
        lowered = [i for i in lowered if (spec.kernels[i.kind].role == "bench") == bench]
        path = tuned_table.table_path(ROOT, spec)
        use_tuned = use_tuned and not bench
        if use_tuned and path.is_file():
            extra, rules = tuned_table.load_rules(spec, path, lower_stage.lower_in(spec), _display(path))
            names = {i.name for i in lowered}
            lowered += [i for i in extra if i.name not in names and not names.add(i.name)]
            spec = tuned_table.attach(spec, rules)
        out.append((spec, lowered))
    lower_stage.check_unique_names_across([i for _, insts in out for i in insts])
    return out


def render_files(lowered, templates_dir: Path = TEMPLATES_DIR) -> dict[str, str]:
    return render.render_all(templates_dir, lowered)


def generate(paths=None, out_dir: Path = GENERATED_DIR, templates_dir: Path = TEMPLATES_DIR):
    """Run every stage; nothing is written unless all of them succeed."""
    lowered = lower(expand(load(paths, templates_dir)))
    files = render_files(lowered, templates_dir)
    return lowered, render.write_tree(out_dir, files)


BENCH_NAMESPACE = "attngen_bench"
BENCH_LAYOUT = ninja.Layout(gen="build/bench/generated", build="build/bench",
                            extension=f"build/bench/lib/{BENCH_NAMESPACE}_ext.so")


def generate_bench(paths=None, templates_dir: Path = TEMPLATES_DIR):
    """The benchmark extension's sources (bench-role kinds, op namespace attngen_bench) under
    build/bench/generated: built on demand (`python -m codegen build --bench`), never committed
    and never part of the shipped extension."""
    lowered = lower(expand(load(paths, templates_dir)), bench=True)
    files = render.render_all(templates_dir, lowered, namespace=BENCH_NAMESPACE, layout=BENCH_LAYOUT)
    return lowered, render.write_tree(ROOT / BENCH_LAYOUT.gen, files)
