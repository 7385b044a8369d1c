"""`python -m codegen tune SPEC`: the whole tuning run, on a machine with a GPU."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from .. import dispatch, pipeline
from ..arch import DTYPE_BYTES
from ..build import cuda_home
from .. import tuned as table
from ..families import family
from . import build, cache, candidates, report, select
from .progress import Progress


def _compiler() -> str:
    try:
        out = subprocess.run([f"{cuda_home()}/bin/nvcc", "--version"], capture_output=True, text=True).stdout
        return out.strip().splitlines()[-1]
    except (OSError, IndexError):
        return "unknown"


def _serves(spec, dtype: str) -> list[str]:
    """A bf16 winner also serves fp16 when fp16 is built but not tuned (same storage width)."""
    extra = ["fp16"] if dtype == "bf16" and "fp16" in spec.axes["dtype"] and "fp16" not in spec.tune.dtypes else []
    return [dtype] + extra


def _simplicity(spec, inst) -> tuple:
    kinds = list(spec.kernels)
    return (kinds.index(inst.kind), inst.d["threads"], inst.d["smem_bytes"], inst.name)


def _smallest_buckets(spec, cands, runtime: dict, axes: dict) -> list:
    """The candidates of `axes` (dtype and the bucket's timed axes) covering `runtime`, keeping
    per kind only its smallest bucket (the `prefer:` order): a larger bucket only adds
    zero-filled work, and dispatch tries the smallest first anyway."""
    out = []
    for kind in spec.kernels:
        members = [c for c in cands if c.kind == kind and all(c.a[a] == v for a, v in axes.items())
                   and dispatch.covers(spec, c, runtime)]
        if members:
            best = min(tuple(c.p[k] for k in spec.kernels[kind].prefer) for c in members)
            out += [c for c in members if tuple(c.p[k] for k in spec.kernels[kind].prefer) == best]
    return out


@dataclass(frozen=True)
class Device:
    """What the measurements were taken on (the table and the cache keys record it)."""
    name: str
    sm_count: int
    torch: str
    cuda: str
    compiler: str

    @staticmethod
    def current() -> "Device":
        import torch
        props = torch.cuda.get_device_properties(0)
        return Device(torch.cuda.get_device_name(), props.multi_processor_count, str(torch.__version__),
                      str(torch.version.cuda), _compiler())


# The measuring side (bench/tune_worker.py and the family's bench/workloads/<family>.py) runs
# the runtime; the compiler starts it as a process and reads its results, never importing it.
WORKER = [sys.executable, "-m", "bench.tune_worker"]
WORKLOADS = "bench/workloads"


def _measure_on_gpu(jobs, so_path, on_result):
    by_id = {job["id"]: job for job in jobs}
    with subprocess.Popen(WORKER + [so_path], cwd=pipeline.ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as worker:
        worker.stdin.write(json.dumps(jobs))
        worker.stdin.close()
        for line in worker.stdout:
            if line.startswith("{"):
                done = json.loads(line)
                on_result(by_id[done["id"]], done["result"])
    if worker.returncode != 0:
        raise SystemExit(f"tune: the measuring process ({' '.join(WORKER)}) failed with exit status {worker.returncode}")


def _workload_source(root: Path, spec) -> str:
    path = root / WORKLOADS / f"{spec.family}.py"
    if not path.is_file():
        raise SystemExit(f"tune: family {spec.family!r} has no tuning workload; add {WORKLOADS}/{spec.family}.py "
                         f"(the contract is in {WORKLOADS}/__init__.py)")
    return path.read_text()


def _runtime(spec, bucket, dtype: str, dev: Device) -> dict:
    return family(spec.family).tune.runtime(bucket.shape, DTYPE_BYTES[dtype], dev.sm_count)


def _add_defaults(spec, built, cands, dev: Device, buckets=None) -> dict:
    """The instance the default rules pick per (bucket, dtype), added to the candidates so
    that every winner's speed-up over the default is measured in the same run."""
    names, defaults = {c.name for c in cands}, {}
    for bucket in buckets or spec.tune.buckets:
        for dtype in spec.tune.dtypes:
            axes = {"dtype": dtype, **candidates.timed_axes(spec, bucket)}
            inst = dispatch.select(spec, built, _runtime(spec, bucket, dtype, dev), axes)
            defaults[(bucket.name, dtype)] = inst
            if inst is not None and inst.name not in names:
                cands.append(inst)
                names.add(inst.name)
    return defaults


def _plan(spec, cands, failed, sources, store, dev: Device, buckets):
    """(results known already: failed builds and cache hits, jobs still to time)."""
    results, todo = {}, []
    workload = _workload_source(pipeline.ROOT, spec)
    for bucket in buckets:
        for dtype in spec.tune.dtypes:
            axes = {"dtype": dtype, **candidates.timed_axes(spec, bucket)}
            for inst, k in ((i, k) for i in _smallest_buckets(spec, cands, _runtime(spec, bucket, dtype, dev), axes)
                            for k in range(len(bucket.shapes))):
                # The workload reads the axis values a bucket fixes beside its dims (the delta
                # rule's variant); the other families' shapes stay their dims. Shape k > 0 of a
                # bucket (its `also:`) is timed under the id's suffix |k.
                job = {"id": f"{bucket.name}|{dtype}|{inst.name}" + (f"|{k}" if k else ""), "family": spec.family,
                       "name": inst.name, "shape": {**bucket.shapes[k], **bucket.axes}, "dtype": dtype,
                       "timing": bucket.timing}
                if inst.name in failed:
                    results[job["id"]] = {"median_ms": math.inf, "spread_ms": 0.0, "note": failed[inst.name]}
                    continue
                # The workload's code is part of what was timed: editing it re-times everything.
                timed = job["shape"] if bucket.timing == "eager" else {**job["shape"], "timing": bucket.timing}
                job["key"] = cache.key(inst.name, sources[inst.name] + workload, dev.compiler, dev.torch, spec.arch,
                                       dev.name, timed)
                hit = store.get(job["key"])
                if hit is not None:
                    results[job["id"]] = hit
                else:
                    todo.append(job)
    return results, todo


def _entry(spec, bucket, dtype, inst, choice, default, default_ms, count) -> dict:
    """One row of the tuned table."""
    finite = math.isfinite(default_ms)
    return {
        "bucket": bucket.name, "dtype": dtype, "serves": _serves(spec, dtype), "kind": inst.kind,
        "params": dict(inst.params), "instance": inst.name,
        "time_ms": round(choice.winner.median_ms, 5), "spread_ms": round(choice.winner.spread_ms, 5),
        "runner_up": choice.runner_up.name if choice.runner_up else None,
        "runner_up_ms": round(choice.runner_up.median_ms, 5) if choice.runner_up else None,
        "default": default.name if default else None,
        "default_ms": round(default_ms, 5) if finite else None,
        "speedup_vs_default": round(default_ms / choice.winner.median_ms, 3) if finite else None,
        "candidates": count}


def _choose_all(spec, cands, results, defaults, buckets=None):
    """(tuned-table entries, report rows) from all measurements."""
    by_name = {c.name: c for c in cands}
    entries, rows = [], []
    for bucket in buckets or spec.tune.buckets:
        for dtype in spec.tune.dtypes:
            prefix = f"{bucket.name}|{dtype}|"
            per_name: dict[str, dict] = {}   # candidate -> {shape index: Measurement}
            for jid, r in results.items():
                if jid.startswith(prefix):
                    name, _, k = jid[len(prefix):].partition("|")
                    per_name.setdefault(name, {})[int(k or 0)] = select.Measurement(
                        name, r["median_ms"], r["spread_ms"], _simplicity(spec, by_name[name]), r.get("note", ""),
                        r.get("jitter_ms"))
            per_shape = {name: [by_k[k] for k in sorted(by_k)] for name, by_k in per_name.items()}
            ms = [select.combine(shapes) for shapes in per_shape.values()]
            default = defaults[(bucket.name, dtype)]
            choice = select.choose(ms, default.name if default else None)
            default_ms = next((m.median_ms for m in ms if default is not None and m.name == default.name), math.inf)
            rows.append({"bucket": bucket.name, "dtype": dtype, "shape": bucket.shape,
                         **({"also": list(bucket.also),
                             "per_shape_ms": {name: [m.median_ms for m in shapes] for name, shapes in per_shape.items()}}
                            if bucket.also else {}),
                         "measurements": [m.__dict__ for m in ms],
                         "winner": choice.winner.name if choice else None,
                         "default": default.name if default else None})
            if choice is None:
                print(f"tune: bucket {bucket.name} {dtype}: no candidate passed; the default rules stay")
                continue
            entries.append(_entry(spec, bucket, dtype, by_name[choice.winner.name], choice, default, default_ms,
                                  len(ms)))
    return entries, rows


def _chosen_buckets(spec, names) -> list:
    """The spec's buckets named in `names` (all of them for None), in dispatch order."""
    if not names:
        return list(spec.tune.buckets)
    known = [b.name for b in spec.tune.buckets]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"tune: no bucket {', '.join(map(repr, unknown))} in {spec.file}; its buckets: "
                         f"{', '.join(known)}")
    return [b for b in spec.tune.buckets if b.name in names]


def _timed_by(spec, cands, buckets, dev: Device) -> list:
    """The candidates that some bucket of `buckets` times (what a run of those buckets builds)."""
    keep = {c.name for bucket in buckets for dtype in spec.tune.dtypes
            for c in _smallest_buckets(spec, cands, _runtime(spec, bucket, dtype, dev),
                                       {"dtype": dtype, **candidates.timed_axes(spec, bucket)})}
    return [c for c in cands if c.name in keep]


def _kept_from_before(spec, root: Path, out: Path, dev: Device, timed: list) -> tuple[list, list]:
    """A run of some buckets (`timed`): the table's entries and the run JSON's rows of the other
    buckets, as an earlier run on the same device measured them; each entry kept carries the
    day it was measured (`tuned`). Refused, before anything is built or timed, where no table
    exists or another device made it."""
    path = table.table_path(root, spec)
    if not path.is_file():
        raise SystemExit(f"tune: {path} does not exist: the first run of {spec.file} times every bucket "
                         f"(leave out --bucket)")
    old = yaml.safe_load(path.read_text()) or {}
    if (old.get("device"), old.get("sm_count")) != (dev.name, dev.sm_count):
        raise SystemExit(f"tune: {path} was measured on {old.get('device')} ({old.get('sm_count')} SMs), this is "
                         f"{dev.name} ({dev.sm_count} SMs): time every bucket (leave out --bucket)")
    names = {b.name for b in timed}
    entries = [{**e, "tuned": e.get("tuned", old.get("date"))} for e in old.get("buckets", [])
               if e["bucket"] not in names]
    run_json = out / f"tune_{spec.stem}.json"
    rows = ([r for r in json.loads(run_json.read_text())["rows"] if r["bucket"] not in names]
            if run_json.is_file() else [])
    return entries, rows


def _in_dispatch_order(spec, items: list) -> list:
    """Table entries or report rows ordered as the spec's buckets, then its tuned dtypes."""
    order = {b.name: i for i, b in enumerate(spec.tune.buckets)}
    return sorted(items, key=lambda x: (order.get(x["bucket"], len(order)),
                                        spec.tune.dtypes.index(x["dtype"]) if x["dtype"] in spec.tune.dtypes else 0))


def run(spec_path: str, jobs: int | None = None, out_dir: str | None = None, *, root: Path = pipeline.ROOT,
        device: Device | None = None, build_fn=build.build, measure_fn=_measure_on_gpu,
        buckets: list[str] | None = None) -> dict:
    """Tune `spec_path`; returns the table header. `device`, `build_fn` and `measure_fn` are
    the GPU-facing parts (the CPU tests pass stand-ins with a deterministic cost). `buckets`:
    time only these (by name) and keep the table's other entries as measured before."""
    t_start = time.monotonic()
    spec = pipeline.load([spec_path])[0]
    if spec.tune is None:
        raise SystemExit(f"tune: {spec.file} has no tune: section")
    if family(spec.family).tune.runtime is None:
        raise SystemExit(f"tune: the {spec.family} family declares no tuning plan (its TunePlan's runtime, "
                         f"codegen/families/{spec.family}.py)")
    timed = _chosen_buckets(spec, buckets)
    dev = device or Device.current()
    out = Path(out_dir) if out_dir else root / "bench" / "results" / ("h100" if "H100" in dev.name else "gpu")
    kept_entries, kept_rows = _kept_from_before(spec, root, out, dev, timed) if buckets else ([], [])
    built = pipeline.lower(pipeline.expand([spec]), use_tuned=False)[0][1]
    cands, rejected = candidates.candidates(spec)
    if buckets:
        cands = _timed_by(spec, cands, timed, dev)
        print(f"tune: buckets {', '.join(b.name for b in timed)} only", flush=True)
    defaults = _add_defaults(spec, built, cands, dev, timed)
    print(f"tune: {len(cands)} candidates ({len(rejected)} rejected by the passes)", flush=True)
    for rej in rejected[:5]:
        print(f"  rejected {rej.instance.name}: {rej.param}: {rej.reason}")

    so_path, failed, sources = build_fn(spec, cands, jobs)
    for name, why in failed.items():
        print(f"  {name}: {why} (scored as infinitely slow)")
    store = cache.Cache(root / build.layout_for(spec.stem).build / "cache.jsonl")
    results, todo = _plan(spec, cands, failed, sources, store, dev, timed)
    print(f"tune: {len(results)} measurements cached, {len(todo)} to time", flush=True)
    progress = Progress(len(todo), "time")

    def on_result(job, result):
        store.put(job["key"], {"name": job["name"], "shape": job["shape"], "dtype": job["dtype"], **result})
        results[job["id"]] = result
        progress.step(note=job["name"])
    if todo:
        measure_fn(sorted(todo, key=lambda j: j["id"]), str(so_path), on_result)

    entries, rows = _choose_all(spec, cands, results, defaults, timed)
    header = {"spec": spec.file, "arch": spec.arch, "device": dev.name, "sm_count": dev.sm_count,
              "torch": dev.torch, "cuda": dev.cuda, "compiler": dev.compiler,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "candidates": len(cands), "rejected_by_passes": len(rejected), "failed_to_build": len(failed),
              "measured_now": len(todo),
              "timing": "triton.testing.do_bench median of 3 repeats (spread = max - min), inputs rotated beyond L2"
                        + ("; buckets marked `timing: graph` by replays of CUDA graphs of one call each"
                           if any(b.timing == "graph" for b in spec.tune.buckets) else "")
                        + ("; a bucket with `also:` shapes scores the geometric mean over its shapes"
                           if any(b.also for b in spec.tune.buckets) else "")}
    if buckets:
        header["retimed"] = [b.name for b in timed]
        entries, rows = _in_dispatch_order(spec, entries + kept_entries), _in_dispatch_order(spec, rows + kept_rows)
    _write(spec, root, header, entries, rows, out, time.monotonic() - t_start)
    return header


def _write(spec, root: Path, header: dict, entries: list, rows: list, out: Path, seconds: float | None) -> None:
    """The tuned table, and the run's JSON (every measurement), Markdown and heat map under `out`."""
    path = table.table_path(root, spec)
    table.write(path, header, entries)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"tune_{spec.stem}.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1, default=str))
    md = report.markdown(header, entries, seconds)
    (out / f"tune_{spec.stem}.md").write_text(md)
    report.heat_map(rows, out / f"tune_{spec.stem}.png", spec.family)
    print(md)
    print(f"tune: wrote {path}; run `make gen` to emit its dispatch")


def reselect(run_json: str, out_dir: str | None = None, *, root: Path = pipeline.ROOT, narrowed: bool = False) -> dict:
    """The tuned table chosen again from a tuning run's recorded measurements (its
    tune_<spec>.json), with no GPU: for a change of the selection rules (codegen/tune/select.py)
    or of what the spec's dispatch picks by default. The header keeps the run's device, date
    and counts; `reselected` records the day of the new choice. `narrowed`: the spec's tune grid
    lost points since the run (say, candidates not yet checked on the GPU); their measurements
    are left out and named in the header's `narrowed` instead of refusing. A grid that gained
    points needs a new run."""
    run = json.loads(Path(run_json).read_text())
    header = dict(run["header"])
    spec = pipeline.load([header["spec"]])[0]
    dev = Device(header["device"], header["sm_count"], header["torch"], header["cuda"], header["compiler"])
    built = pipeline.lower(pipeline.expand([spec]), use_tuned=False)[0][1]
    cands, _ = candidates.candidates(spec)
    defaults = _add_defaults(spec, built, cands, dev)
    names = {c.name for c in cands}
    results, left_out = {}, set()
    for row in run["rows"]:
        for m in row["measurements"]:
            if m["name"] not in names:
                if not narrowed:
                    raise SystemExit(f"tune: {run_json}: {m['name']} is no longer a candidate of {spec.file}; tune "
                                     f"again (or --narrowed, if the grid only lost points)")
                left_out.add(m["name"])
                continue
            results[f"{row['bucket']}|{row['dtype']}|{m['name']}"] = {
                "median_ms": m["median_ms"], "spread_ms": m["spread_ms"], "note": m.get("note", ""),
                "jitter_ms": m.get("jitter_ms")}
    entries, rows = _choose_all(spec, cands, results, defaults)
    recorded = {(r["bucket"], r["dtype"]): r for r in run["rows"]}   # the scores above are combined already:
    for row in rows:                                                  # keep the run's times per shape
        if "per_shape_ms" in recorded.get((row["bucket"], row["dtype"]), {}):
            row["per_shape_ms"] = recorded[(row["bucket"], row["dtype"])]["per_shape_ms"]
    header["reselected"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if left_out:
        header["narrowed"] = sorted(left_out)
    _write(spec, root, header, entries, rows, Path(out_dir) if out_dir else Path(run_json).parent, None)
    return header
