"""Command line of the compiler.

  python -m codegen gen   [--dump STAGE] [SPEC ...]  generate generated/ from specs/
  python -m codegen list  [--filter GLOB]       instances a build would contain
  python -m codegen dump  STAGE [SPEC ...]      print what a stage holds (load, expand, lower,
                                                render, dispatch)
  python -m codegen build [--target T] [-j N]   ninja build (extension, or cubins without CUDA torch)
  python -m codegen tune  SPEC [--out DIR] [--bucket NAME ...]
                                               autotune SPEC's grids on the GPU -> tuned/<arch>/
  python -m codegen tune --reselect RUN.json [--narrowed]
                                                choose again from a run's measurements (no GPU)
  python -m codegen report [--out DIR]          static resource report of the built cubins (no GPU; build/report)

A bad spec exits with status 2 and a message naming file:line and the field.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import sys

from . import expand as expand_stage
from . import pipeline
from .errors import SpecError

STAGES = ["load", "expand", "lower", "render", "dispatch"]


def _cmd_gen(args) -> int:
    if args.dump:
        args.stage = args.dump
        return _cmd_dump(args)
    lowered, result = pipeline.generate(args.specs or None)
    count = sum(len(insts) for _, insts in lowered)
    print(f"generated {count} kernel instances from {len(lowered)} spec(s): "
          f"{len(result['changed'])} file(s) written, {len(result['removed'])} removed, "
          f"the rest unchanged")
    for rel in result["changed"]:
        print(f"  wrote generated/{rel}")
    for rel in result["removed"]:
        print(f"  removed generated/{rel}")
    for spec, _ in lowered:
        for warning in expand_stage.unused_grid_values(spec):
            print(f"warning: {warning}", file=sys.stderr)
    return 0


def _cmd_list(args) -> int:
    lowered = pipeline.lower(pipeline.expand(pipeline.load(args.specs or None)), bench=args.bench)
    shown = 0
    for _, instances in lowered:
        for inst in instances:
            if fnmatch.fnmatch(inst.name, args.filter):
                d = inst.d
                print(f"{inst.name}  threads={d['threads']} smem={d['smem_bytes']}")
                shown += 1
    print(f"{shown} instance(s)", file=sys.stderr)
    return 0


def _cmd_dump(args) -> int:
    specs = pipeline.load(args.specs or None)
    if args.stage == "load":
        for spec in specs:
            print(f"{spec.file}: family={spec.family} arch={spec.arch} op={spec.op.name}")
            print(f"  axes: {spec.axes}")
            for kind in spec.kernels.values():
                print(f"  kind {kind.name} ({kind.template}) grid={kind.grid} "
                      f"where={[w.text for w in kind.where]} covers={kind.covers.text!r}")
            for rule in spec.dispatch:
                print(f"  rule line {rule.line}: when {rule.when.text!r} -> {rule.kind}")
        return 0
    expanded = pipeline.expand(specs)
    if args.stage == "expand":
        for _, instances in expanded:
            for inst in instances:
                print(inst.name, json.dumps(inst.p))
        return 0
    lowered = pipeline.lower(expanded)
    if args.stage == "lower":
        for _, instances in lowered:
            for inst in instances:
                print(inst.name, json.dumps(inst.d, default=str))
        return 0
    files = pipeline.render_files(lowered)
    if args.stage == "render":
        for rel, text in sorted(files.items()):
            print(f"{rel}  {len(text)} bytes")
        return 0
    if args.stage == "dispatch":
        for rel, text in sorted(files.items()):
            if rel.endswith("dispatch.cpp"):
                start = text.index("_select(")
                print(f"// generated/{rel}\n" + text[text.rfind("\n", 0, start) + 1:])
        return 0
    raise AssertionError(args.stage)


def _cmd_tune(args) -> int:
    from .tune.runner import reselect, run
    if args.reselect:
        if args.bucket:
            print("error: --bucket times buckets again; --reselect chooses from a run's measurements", file=sys.stderr)
            return 2
        reselect(args.spec, args.out, narrowed=args.narrowed)
    else:
        run(args.spec, args.jobs, args.out, buckets=args.bucket)
    return 0


def _cmd_build(args) -> int:
    from .build import build, build_bench
    if args.bench:
        return build_bench(args.jobs, args.spec)
    if args.spec:
        print("error: --spec selects the benchmark extension's specs: it needs --bench", file=sys.stderr)
        return 2
    return build(args.target, args.jobs)


def _cmd_report(args) -> int:
    from pathlib import Path

    from .report import write
    path = write(pipeline.ROOT, Path(args.out) if args.out else pipeline.ROOT / "build" / "report")
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codegen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("gen")
    p.add_argument("--dump", choices=STAGES, help="print what this stage holds instead of writing files")
    p.add_argument("specs", nargs="*")
    p.set_defaults(func=_cmd_gen)
    p = sub.add_parser("list")
    p.add_argument("--filter", default="*")
    p.add_argument("--bench", action="store_true", help="the benchmark extension's instances (bench-role kinds)")
    p.add_argument("specs", nargs="*")
    p.set_defaults(func=_cmd_list)
    p = sub.add_parser("dump")
    p.add_argument("stage", choices=STAGES)
    p.add_argument("specs", nargs="*")
    p.set_defaults(func=_cmd_dump)
    p = sub.add_parser("build")
    p.add_argument("--target", default=None)
    p.add_argument("--bench", action="store_true",
                   help="the benchmark extension instead (bench-role kinds, build/bench/; op namespace attngen_bench)")
    p.add_argument("--spec", action="append", default=None,
                   help="with --bench: only this spec's bench-role kinds (repeatable; default every spec)")
    p.add_argument("-j", "--jobs", type=int, default=None)
    p.set_defaults(func=_cmd_build)
    p = sub.add_parser("tune")
    p.add_argument("spec")
    p.add_argument("-j", "--jobs", type=int, default=None)
    p.add_argument("--out", default=None, help="report directory (default bench/results/<gpu>)")
    p.add_argument("--bucket", action="append", default=None, metavar="NAME",
                   help="time only this bucket (repeatable); the table's other entries stay as measured before "
                        "(on the same device), each with the day it was")
    p.add_argument("--reselect", action="store_true",
                   help="SPEC is a tuning run's tune_<spec>.json: choose the winners again from its measurements "
                        "(no GPU) and rewrite the table and report (next to the JSON unless --out)")
    p.add_argument("--narrowed", action="store_true",
                   help="with --reselect: the spec's tune grid was narrowed since the run; leave out the measurements "
                        "of candidates no longer in it (recorded in the table's header) instead of refusing")
    p.set_defaults(func=_cmd_tune)
    p = sub.add_parser("report")
    p.add_argument("--out", default=None, help="directory of report.md/.json (default build/report; the committed "
                                               "copy is bench/results/h100, `make report REFRESH=1`)")
    p.set_defaults(func=_cmd_report)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head`: stop quietly
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
