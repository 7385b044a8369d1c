"""What a "cold" paged_decode call costs depends on how the cache was made cold. triton's
do_bench (every paged benchmark here) zeroes a 256 MB buffer before each call: the L2 (50 MB,
write-back) is then full of dirty lines, and the call's misses write them back to DRAM while it
reads its own bytes. A model's decode step instead reads one layer's cache after another, each
cold, with little dirty data left by the kernels between. This times the same calls four ways,
beside a plain streaming read of the same byte count (torch's sum) as calibration:

- flush_zero: do_bench, as bench/paged_serving.py does (L2 dirty before each call);
- flush_read: the same loop with the flush reading 256 MB instead (L2 clean, none of the call's
  bytes in it);
- rotate: one CUDA graph of back-to-back calls over enough distinct caches (each its own
  block table and pages) that a pass over them is 3x the L2: the layers of a decode step;
- warm: a CUDA graph of calls over one cache (what L2 can hold of it, it holds).

Effective bandwidth = bytes of K and V inside the contexts / time per call.

  python -m bench.paged_cold [--out DIR]      # writes paged_cold.md / .json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from bench import run_meta  # noqa: E402
from bench.causal_linear import L2_BYTES, do_bench  # noqa: E402
from bench.paged import D, kv_bytes, make_case  # noqa: E402

# (S, Hq, Hkv, context): bench/paged_serving.py's rows below its 2.2 TB/s floor, one above, and its small batches.
CASES = [(16, 8, 8, 1000), (16, 64, 8, 1000), (16, 64, 4, 1000), (16, 64, 4, 4000), (64, 64, 4, 1000),
         (64, 64, 8, 4000), (1, 32, 8, 2000), (4, 56, 8, 1100)]
FLUSH_BYTES = 256 * 2**20
REPS = 100


def flush_read_ms(fn) -> float:
    """Median of fn's time between two events, a 256 MB read (a sum) before each call."""
    buf = torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    fn()
    times = []
    for _ in range(REPS):
        buf.sum()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def graph_ms(calls: list) -> float:
    """Time per call of one CUDA graph of `calls` back to back (do_bench over its replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    return do_bench(graph.replay) / len(calls)


def methods(make, nbytes: int) -> dict:
    """The four timings (ms per call) of the call `make(seed)` builds."""
    one = make(0)
    copies = max(2, math.ceil(3 * L2_BYTES / nbytes))
    rotation = [one] + [make(i) for i in range(1, copies)]
    calls = rotation * max(1, math.ceil(20 / copies))
    out = {"flush_zero": do_bench(one), "flush_read": flush_read_ms(one),
           "rotate": graph_ms(calls), "warm": graph_ms([one] * 20), "copies": copies}
    return out


def paged_call(S, Hq, Hkv, ctx):
    def make(seed):
        case = make_case(S, Hq, Hkv, ctx, seed=seed)
        return lambda: attngen.paged_decode(*case)
    case = make_case(S, Hq, Hkv, ctx, seed=0)
    return make, kv_bytes(case[1], case[4])


def sum_call(nbytes):
    def make(seed):
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        return lambda: x.sum()
    return make, nbytes


def run() -> list:
    rows = []
    for S, Hq, Hkv, ctx in CASES:
        for what, (make, nbytes) in (("paged_decode", paged_call(S, Hq, Hkv, ctx)),
                                     ("torch.sum, same bytes", sum_call(kv_bytes_of(S, Hkv, ctx)))):
            ms = methods(make, nbytes)
            row = {"S": S, "Hq": Hq, "Hkv": Hkv, "context": ctx, "what": what, "bytes": nbytes,
                   "copies": ms.pop("copies"), "us": {k: v * 1e3 for k, v in ms.items()},
                   "tbps": {k: nbytes / v / 1e9 for k, v in ms.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    return rows


def kv_bytes_of(S, Hkv, ctx) -> int:
    """What kv_bytes counts for make_case's bf16 cache (K and V, D each), without making one."""
    return S * ctx * Hkv * D * 2 * 2


METHODS = ("flush_zero", "flush_read", "rotate", "warm")


def markdown(meta: dict, rows: list) -> str:
    out = [f"# Paged decode, cold four ways, on {meta['device']}", "",
           f"commit {meta['commit']}, torch {meta['torch']}, {meta['seconds']} s; bf16, D 128, 16-token pages shuffled, "
           "equal contexts. TB/s = K and V bytes inside the contexts / time per call (us in brackets). flush_zero: "
           "do_bench's 256 MB zero_ before each call (L2 left dirty); flush_read: a 256 MB read instead (L2 clean); "
           "rotate: a CUDA graph cycling over `copies` distinct caches (3x L2 a pass); warm: a CUDA graph over one cache.",
           "", "| S | Hq / Hkv | context | MB | what | " + " | ".join(METHODS) + " | copies |",
           "|---|---|---|---|---|" + "---|" * len(METHODS) + "---|"]
    for r in rows:
        cells = " | ".join(f"{r['tbps'][m]:.2f} ({r['us'][m]:.1f})" for m in METHODS)
        out.append(f"| {r['S']} | {r['Hq']} / {r['Hkv']} | {r['context']} | {r['bytes'] / 1e6:.1f} | {r['what']} | "
                   f"{cells} | {r['copies']} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    args = ap.parse_args()
    t0 = time.time()
    rows = run()
    meta = run_meta(t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paged_cold.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "paged_cold.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
