"""Where a paged_decode call's time goes on the GPU's clock: the benchmark's own loop (a 256 MB
L2 flush, a start event, the call, an end event, as triton's do_bench times it) under
torch.profiler, and per iteration the gaps between the flush's end, the decode grid, the merge
and the end of the call, with when the host issued each launch. For the rows of
bench/paged_serving.py below the floor and its two small batches.

  python -m bench.paged_timeline [--out DIR]      # writes paged_timeline.md / .json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from bench import run_meta  # noqa: E402
from bench.paged import make_case  # noqa: E402

# (S, Hq, Hkv, context)
CASES = [(16, 8, 8, 1000), (16, 64, 8, 1000), (16, 64, 4, 1000), (16, 64, 4, 4000), (64, 64, 4, 1000),
         (1, 32, 8, 2000), (4, 56, 8, 1100)]
ITERATIONS = 12


def timeline(case) -> dict:
    from torch.profiler import ProfilerActivity, profile
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    call = lambda: attngen.paged_decode(*case)  # noqa: E731
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    events = []
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(ITERATIONS):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
    timed = [s.elapsed_time(e) * 1e3 for s, e in events]
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.name),
                     key=lambda e: e.time_range.start)
    launches = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU
                       and e.name.startswith("cuda") and "Launch" in e.name), key=lambda e: e.time_range.start)
    rows, i = [], 0
    flushes = [k for k in kernels if "FillFunctor" in k.name or "zero" in k.name.lower()]
    for f in flushes:
        after = [k for k in kernels if k.time_range.start >= f.time_range.end and k not in flushes]
        nxt = next((g for g in flushes if g.time_range.start > f.time_range.start), None)
        mine = [k for k in after if nxt is None or k.time_range.start < nxt.time_range.start]
        if not mine:
            continue
        decode = next((k for k in mine if "decode_kernel" in k.name), mine[0])
        merge = next((k for k in mine if "merge" in k.name), None)
        issued = [l for l in launches if f.time_range.start <= l.time_range.start and (nxt is None or l.time_range.start < nxt.time_range.start)]
        last = max(k.time_range.end for k in mine)
        rows.append({
            "flush_end_to_decode_start_us": decode.time_range.start - f.time_range.end,
            "decode_us": decode.time_range.end - decode.time_range.start,
            "decode_end_to_last_end_us": last - decode.time_range.end,
            "merge_start_after_decode_start_us": (merge.time_range.start - decode.time_range.start) if merge else None,
            "merge_us": (merge.time_range.end - merge.time_range.start) if merge else None,
            "flush_end_to_last_end_us": last - f.time_range.end,
            "host_launch_lead_us": (decode.time_range.start - issued[1].time_range.end) if len(issued) > 1 else None,
        })
        i += 1
    med = {}
    for k in (rows[0] if rows else {}):
        values = [r[k] for r in rows if r[k] is not None]
        if values:
            med[k] = statistics.median(values)
    return {"event_timed_us": statistics.median(timed), "median": med, "iterations": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    args = ap.parse_args()
    t0 = time.time()
    results = []
    for S, Hq, Hkv, ctx in CASES:
        r = {"S": S, "Hq": Hq, "Hkv": Hkv, "context": ctx, **timeline(make_case(S, Hq, Hkv, ctx, seed=S))}
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "iterations"}), flush=True)
        torch.cuda.empty_cache()
    meta = run_meta(t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paged_timeline.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=1) + "\n")
    cols = ["event_timed_us", "flush_end_to_decode_start_us", "decode_us", "merge_start_after_decode_start_us",
            "merge_us", "decode_end_to_last_end_us", "flush_end_to_last_end_us", "host_launch_lead_us"]
    md = [f"# paged_decode on the GPU's clock ({meta['device']}, commit {meta['commit']})", "",
          "The benchmark's loop (256 MB flush, start event, call, end event) under torch.profiler; medians over "
          f"{ITERATIONS} iterations, us. host_launch_lead: the decode grid's start after its launch call returned "
          "(negative: the GPU waited for the host).", "",
          "| S Hq/Hkv ctx | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for r in results:
        md.append(f"| {r['S']} {r['Hq']}/{r['Hkv']} {r['context']} | {r['event_timed_us']:.1f} | " +
                  " | ".join(f"{r['median'].get(c, float('nan')):.1f}" for c in cols[1:]) + " |")
    (out / "paged_timeline.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
