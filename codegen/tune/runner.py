"""`python -m codegen tune SPEC`: the whole tuning run, on a machine with a GPU."""
from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

from .. import dispatch, pipeline
from ..arch import DTYPE_BYTES
from ..build import cuda_home
from . import build, cache, candidates, report, select, table
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


def _smallest_buckets(spec, cands, runtime: dict, dtype: str) -> list:
    """The candidates covering `runtime`, keeping per kind only its smallest bucket (the
    `prefer:` order): a larger bucket only adds zero-filled work, and dispatch tries the
    smallest first anyway."""
    out = []
    for kind in spec.kernels:
        members = [c for c in cands if c.kind == kind and c.a["dtype"] == dtype and dispatch.covers(spec, c, runtime)]
        if members:
            best = min(tuple(c.p[k] for k in spec.kernels[kind].prefer) for c in members)
            out += [c for c in members if tuple(c.p[k] for k in spec.kernels[kind].prefer) == best]
    return out


def run(spec_path: str, jobs: int | None = None, out_dir: str | None = None) -> int:
    import torch

    t_start = time.monotonic()
    spec = pipeline.load([spec_path])[0]
    if spec.tune is None:
        raise SystemExit(f"tune: {spec.file} has no tune: section")
    built = pipeline.lower(pipeline.expand([spec]), use_tuned=False)[0][1]
    device = torch.cuda.get_device_name()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count

    cands, rejected = candidates.candidates(spec)
    names = {c.name for c in cands}
    defaults = {}
    for bucket in spec.tune.buckets:
        for dtype in spec.tune.dtypes:
            runtime = dispatch.runtime_for(bucket.shape, DTYPE_BYTES[dtype], sm_count)
            inst = dispatch.select(spec, built, runtime, {"dtype": dtype, "direction": "fwd"})
            defaults[(bucket.name, dtype)] = inst
            if inst is not None and inst.name not in names:
                cands.append(inst)
                names.add(inst.name)
    print(f"tune: {len(cands)} candidates ({len(rejected)} rejected by the passes)", flush=True)
    for rej in rejected[:5]:
        print(f"  rejected {rej.instance.name}: {rej.param}: {rej.reason}")

    so_path, failed, sources = build.build(spec, cands, jobs)
    for name, why in failed.items():
        print(f"  {name}: {why} (scored as infinitely slow)")

    store = cache.Cache(Path(build.layout_for(spec.stem).build) / "cache.jsonl")
    compiler, torch_version = _compiler(), str(torch.__version__)
    results, todo = {}, []
    for bucket in spec.tune.buckets:
        for dtype in spec.tune.dtypes:
            runtime = dispatch.runtime_for(bucket.shape, DTYPE_BYTES[dtype], sm_count)
            for inst in _smallest_buckets(spec, cands, runtime, dtype):
                job = {"id": f"{bucket.name}|{dtype}|{inst.name}", "name": inst.name, "shape": bucket.shape,
                       "dtype": dtype}
                if inst.name in failed:
                    results[job["id"]] = {"median_ms": math.inf, "spread_ms": 0.0, "note": failed[inst.name]}
                    continue
                job["key"] = cache.key(inst.name, sources[inst.name], compiler, torch_version, spec.arch, device,
                                       bucket.shape)
                hit = store.get(job["key"])
                if hit is not None:
                    results[job["id"]] = hit
                else:
                    todo.append(job)
    print(f"tune: {len(results)} measurements cached, {len(todo)} to time", flush=True)
    progress = Progress(len(todo), "time")

    def on_result(job, result):
        store.put(job["key"], {"name": job["name"], "shape": job["shape"], "dtype": job["dtype"], **result})
        results[job["id"]] = result
        progress.step(note=job["name"])
    if todo:
        from . import measure
        measure.measure_all(sorted(todo, key=lambda j: j["id"]), str(so_path), on_result)

    by_name = {c.name: c for c in cands}
    entries, rows = [], []
    for bucket in spec.tune.buckets:
        for dtype in spec.tune.dtypes:
            prefix = f"{bucket.name}|{dtype}|"
            ms = [select.Measurement(jid[len(prefix):], r["median_ms"], r["spread_ms"],
                                     _simplicity(spec, by_name[jid[len(prefix):]]), r.get("note", ""))
                  for jid, r in results.items() if jid.startswith(prefix)]
            choice = select.choose(ms)
            default = defaults[(bucket.name, dtype)]
            default_ms = next((m.median_ms for m in ms if default is not None and m.name == default.name), math.inf)
            rows.append({"bucket": bucket.name, "dtype": dtype, "shape": bucket.shape,
                         "measurements": [m.__dict__ for m in ms],
                         "winner": choice.winner.name if choice else None,
                         "default": default.name if default else None})
            if choice is None:
                print(f"tune: bucket {bucket.name} {dtype}: no candidate passed; the default rules stay")
                continue
            w = by_name[choice.winner.name]
            entries.append({
                "bucket": bucket.name, "dtype": dtype, "serves": _serves(spec, dtype), "kind": w.kind,
                "params": dict(w.params), "instance": w.name,
                "time_ms": round(choice.winner.median_ms, 5), "spread_ms": round(choice.winner.spread_ms, 5),
                "runner_up": choice.runner_up.name if choice.runner_up else None,
                "runner_up_ms": round(choice.runner_up.median_ms, 5) if choice.runner_up else None,
                "default": default.name if default else None,
                "default_ms": round(default_ms, 5) if math.isfinite(default_ms) else None,
                "speedup_vs_default": round(default_ms / choice.winner.median_ms, 3) if math.isfinite(default_ms) else None,
                "candidates": len(ms)})
    header = {"spec": spec.file, "arch": spec.arch, "device": device, "sm_count": sm_count,
              "torch": torch_version, "cuda": torch.version.cuda, "compiler": compiler,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "candidates": len(cands), "rejected_by_passes": len(rejected), "failed_to_build": len(failed),
              "timing": "triton.testing.do_bench median of 3 repeats (spread = max - min), inputs rotated beyond L2"}
    path = table.table_path(pipeline.ROOT, spec)
    table.write(path, header, entries)
    out = Path(out_dir) if out_dir else pipeline.ROOT / "bench" / "results" / ("h100" if "H100" in device else "gpu")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"tune_{spec.stem}.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1, default=str))
    md = report.markdown(header, entries, time.monotonic() - t_start)
    (out / f"tune_{spec.stem}.md").write_text(md)
    report.heat_map(rows, out / f"tune_{spec.stem}.png")
    print(md)
    print(f"tune: wrote {path.relative_to(pipeline.ROOT)}; run `make gen` to emit its dispatch")
    return 0
