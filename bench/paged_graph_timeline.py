"""Where issue 30's small batches spend a call inside a CUDA graph: the serving bench's graph of
20 back-to-back paged_decode calls (bench/paged_serving.py: S 1 x 2000 and S 4 x 1100 tokens),
replayed without an L2 flush (the cache stays resident, as between the calls of a graph), under
torch.profiler; per call the decode grid's and the merge's durations on the GPU's clock, the
merge's tail after the grid, and the gap from one call's last kernel to the next call's grid.

  python -m bench.paged_graph_timeline [--out DIR]    # writes paged_graph_timeline.md / .json
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
from attngen import paged  # noqa: E402
from bench import run_meta  # noqa: E402
from bench.paged import make_case  # noqa: E402
from bench.paged_serving import GRAPH_CALLS as CALLS, SMALL_CASES, graph_of  # noqa: E402

REPLAYS = 10   # replays profiled


def per_call(kernels: list) -> list:
    """Splits a replay's kernels (sorted by start) into calls, each starting at a decode grid."""
    calls, current = [], []
    for k in kernels:
        if "decode_kernel" in k["name"] and current:
            calls.append(current)
            current = []
        current.append(k)
    if current:
        calls.append(current)
    return calls


def timeline(case) -> dict:
    from torch.profiler import ProfilerActivity, profile
    call = lambda: attngen.paged_decode(*case)  # noqa: E731
    graph = graph_of(call)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    replay_us = start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(({"name": e.name, "start": e.time_range.start, "end": e.time_range.end} for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA and e.name), key=lambda k: k["start"])
    calls = per_call(kernels)
    rows = []
    for i, c in enumerate(calls):
        decode = c[0]
        merge = next((k for k in c if "merge" in k["name"]), None)
        last = max(k["end"] for k in c)
        nxt = calls[i + 1][0]["start"] if i + 1 < len(calls) else None
        rows.append({
            "decode_us": decode["end"] - decode["start"],
            "merge_us": merge["end"] - merge["start"] if merge else None,
            "merge_start_after_decode_start_us": merge["start"] - decode["start"] if merge else None,
            "tail_after_decode_us": last - decode["end"],
            "gap_to_next_decode_us": nxt - last if nxt is not None else None,
            "period_us": nxt - decode["start"] if nxt is not None else None,
        })
    med = {}
    for key in rows[0] if rows else {}:
        values = [r[key] for r in rows if r[key] is not None]
        if values:
            med[key] = statistics.median(values)
    return {"replay_us_per_call": replay_us, "calls_seen": len(calls), "median": med,
            "kernel_names": sorted({k["name"][:80] for k in kernels})}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    args = ap.parse_args()
    t0 = time.time()
    results = []
    for S, Hq, Hkv, ctx in SMALL_CASES:
        case = make_case(S, Hq, Hkv, ctx, seed=S)
        r = {"S": S, "Hq": Hq, "Hkv": Hkv, "context": ctx, "instance": paged.selected_instance(*case),
             **timeline(case)}
        results.append(r)
        print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()
    meta = run_meta(t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paged_graph_timeline.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=1) + "\n")
    cols = ["decode_us", "merge_us", "merge_start_after_decode_start_us", "tail_after_decode_us",
            "gap_to_next_decode_us", "period_us"]
    md = [f"# paged_decode calls inside a CUDA graph ({meta['device']}, commit {meta['commit']})", "",
          f"A graph of {CALLS} calls replayed {REPLAYS} times, L2 not flushed, under torch.profiler; medians per "
          "call, us. replay: CUDA events around the replays, per call.", "",
          "| S Hq/Hkv ctx | replay | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for r in results:
        md.append(f"| {r['S']} {r['Hq']}/{r['Hkv']} {r['context']} | {r['replay_us_per_call']:.1f} | " +
                  " | ".join(f"{r['median'].get(c, float('nan')):.1f}" for c in cols) + " |")
    md += ["", "Instances: " + ", ".join(f"S {r['S']} `{r['instance']}`" for r in results)]
    (out / "paged_graph_timeline.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
