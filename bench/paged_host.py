"""Where an eager paged_decode call spends its host time (issue 30: the eager call's host overhead
is reported beside the CUDA-graph time): each layer of the call path timed alone on the host
clock, 20 calls between synchronizations so the launch queue never fills, for issue 30's two
small batches.

  python -m bench.paged_host [--out DIR]      # writes paged_host.json / .md
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from attngen import paged  # noqa: E402
from bench import host_us, run_meta  # noqa: E402
from bench.paged import make_case  # noqa: E402
from bench.paged_serving import SMALL_CASES  # noqa: E402

ROUNDS, CALLS = 20, 20


def layers(case) -> dict:
    """The call path, outermost first: the public function, the Op wrapper (first-use builds),
    the torch custom op alone, the Python checks alone, the C++ dispatch key and selection
    alone; and what torch itself costs: an empty allocation and a one-kernel op."""
    args = paged._prepare(*case, None, None, None, "NHD", False)
    raw = paged.OP.packet()   # torch.ops.attngen.paged_decode, the extension loaded
    q = case[0]
    return {
        "paged_decode (public)": host_us(lambda: attngen.paged_decode(*case)),
        "OP(*args) (Op wrapper)": host_us(lambda: paged.OP(*args)),
        "torch.ops.attngen.paged_decode": host_us(lambda: raw(*args)),
        "_prepare (Python checks)": host_us(lambda: paged._prepare(*case, None, None, None, "NHD", False)),
        "paged_decode_select (C++ key + select)": host_us(lambda: paged.OP.select(*args)),
        "torch.empty_like(q)": host_us(lambda: torch.empty_like(q)),
        "q.mul(1.0) (one torch kernel)": host_us(lambda: q.mul(1.0)),
    }


def python_profile(case, calls: int = 400) -> str:
    """cProfile of the public call: the Python functions on the path by their own time."""
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        attngen.paged_decode(*case)
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return f"cProfile of {calls} eager paged_decode calls (S 1 Hq 32 / Hkv 8 x 2000, bf16)\n" + text.getvalue()


def runtime_calls(case, calls: int = 200) -> dict:
    """The CUDA runtime calls an eager public call makes, by name: host us per call (torch
    profiler's CPU-side runtime events, CUPTI). Tells the launches apart: the decode grid's
    <<<>>> (cudaLaunchKernel), the merge's cudaLaunchKernelEx with or without PDL's attribute."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(20):
        attngen.paged_decode(*case)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            attngen.paged_decode(*case)
        torch.cuda.synchronize()
    per_call = {}
    for e in prof.key_averages():
        if e.key.startswith("cuda") and e.key != "cudaDeviceSynchronize":
            per_call[e.key] = (e.cpu_time_total / calls, e.count / calls)
    return dict(sorted(per_call.items(), key=lambda kv: -kv[1][0]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    args = ap.parse_args()
    t0 = time.time()
    rows = []
    for S, Hq, Hkv, ctx in SMALL_CASES:
        row = {"S": S, "Hq": Hq, "Hkv": Hkv, "context": ctx, "host_us": layers(make_case(S, Hq, Hkv, ctx, seed=S))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = run_meta(t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paged_host_profile.txt").write_text(python_profile(make_case(*SMALL_CASES[0], seed=1)))
    (out / "paged_host.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    names = list(rows[0]["host_us"])
    md = [f"# Host time of an eager paged_decode call, by layer ({meta['device']})", "",
          f"commit {meta['commit']}, torch {meta['torch']}; bf16, D 128; median over {ROUNDS} rounds of {CALLS} calls "
          "issued back to back between synchronizations (host clock, us per call).", "",
          "| layer | " + " | ".join(f"S {r['S']} Hq {r['Hq']} / Hkv {r['Hkv']} x {r['context']}" for r in rows) + " |",
          "|---|" + "---|" * len(rows)]
    md += [f"| {n} | " + " | ".join(f"{r['host_us'][n]:.1f}" for r in rows) + " |" for n in names]
    md += ["", "CUDA runtime calls of one eager public call (torch profiler, host us per call; calls per call):", "",
           "| runtime call | " + " | ".join(f"S {r['S']}" for r in rows) + " |", "|---|" + "---|" * len(rows)]
    apis = {S: runtime_calls(make_case(S, Hq, Hkv, ctx, seed=S)) for S, Hq, Hkv, ctx in SMALL_CASES}
    for name in dict.fromkeys(n for calls in apis.values() for n in calls):
        md.append(f"| {name} | " + " | ".join(
            f"{apis[r['S']][name][0]:.1f} ({apis[r['S']][name][1]:g})" if name in apis[r["S"]] else "-" for r in rows) + " |")
    (out / "paged_host.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
