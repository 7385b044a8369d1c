"""Instances built on first use, measured: the first call's time (plan, render, nvcc, load,
run) for head sizes no prebuilt instance covers, each in a fresh cache; a second process's
first call from the same cache; and causal linear at E = M = 256 in fp32, which the prebuilt
build serves with the generic kind, against the recurrent instance built for it (both forced
in this run). Writes jit_first_use.json and .md under --out.

  python -m bench.jit_first_use [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import run_meta  # noqa: E402
from bench.causal_linear import do_bench  # noqa: E402

# Each first call runs in a process of its own (a fresh cache, nothing loaded before).
FIRST_CALL = {
    "paged_decode D=48 bf16": """
from attngen import paged
q = torch.randn(64, 32, 48, device="cuda", dtype=torch.bfloat16)
k = torch.randn(64 * 64, 16, 8, 48, device="cuda", dtype=torch.bfloat16)
bt = torch.arange(64 * 64, device="cuda", dtype=torch.int32).view(64, 64)
cl = torch.full((64,), 1024, device="cuda", dtype=torch.int32)
run = lambda: paged.paged_decode(q, k, k, bt, cl)
""",
    "wkv6 N=96 bf16": """
from attngen import rwkv
r = torch.randn(4, 1024, 8, 96, device="cuda", dtype=torch.bfloat16)
w = -torch.rand_like(r)
u = torch.randn(8, 96, device="cuda", dtype=torch.bfloat16)
run = lambda: rwkv.wkv6(r, r, r, w, u)
""",
    "flash_attention D=80 bf16": """
import importlib
fa = importlib.import_module("attngen.flash_attention")
q = torch.randn(2, 1024, 16, 80, device="cuda", dtype=torch.bfloat16)
run = lambda: fa.flash_attention(q, q, q, causal=True)
""",
}
TIMED = """
import time, torch
{setup}
torch.cuda.synchronize()
t0 = time.monotonic()
run()
torch.cuda.synchronize()
print("SECONDS", time.monotonic() - t0)
"""
CAUSAL_SHAPES = [(4, 8, 4096, 256, 256), (8, 16, 2048, 256, 256), (1, 4, 16384, 256, 256)]


def first_calls(cache: Path) -> list:
    rows = []
    env = {**os.environ, "ATTNGEN_CACHE": str(cache), "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    for name, setup in FIRST_CALL.items():
        row = {"case": name}
        for which in ("first_process_s", "second_process_s"):
            done = subprocess.run([sys.executable, "-c", TIMED.format(setup=setup)], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                row["error"] = done.stderr.strip().splitlines()[-1]
                break
            row[which] = round(float(done.stdout.split("SECONDS")[1]), 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def causal_e256() -> list:
    import torch
    from attngen import causal_linear as cl
    rows = []
    for B, H, L, E, M in CAUSAL_SHAPES:
        q, k = (torch.randn(B, H, L, E, device="cuda") * 0.1 for _ in range(2))
        v = torch.randn(B, H, L, M, device="cuda")
        # the generic kind serves E = 256 in the prebuilt dispatch (before any build in this process)
        generic = next(n for n in cl.instances() if "_fwd_generic_" in n and n.endswith("_fp32_sm90a"))
        cl.causal_dot_product(q, k, v)              # builds the recurrent instance (first use)
        built = cl.selected_instance(q, k, v)
        out = cl.causal_dot_product(q, k, v)
        ref = cl.causal_dot_product_with(generic, q, k, v)
        row = {"B": B, "H": H, "L": L, "E": E, "M": M, "dtype": "fp32", "generic": generic, "built": built,
               "rel_diff": ((out - ref).norm() / ref.norm()).item(),
               "generic_ms": do_bench(lambda: cl.causal_dot_product_with(generic, q, k, v)),
               "built_ms": do_bench(lambda: cl.causal_dot_product(q, k, v))}
        row["speedup"] = row["generic_ms"] / row["built_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def markdown(first, causal, meta) -> str:
    lines = [f"# Instances built on first use ({meta['device']}, torch {meta['torch']}, commit {meta['commit']})", "",
             "First call of a head size no prebuilt instance covers, in a fresh process and a fresh cache (plan, "
             "render, nvcc, load, run), then in a second process that finds it in the cache:", "",
             "| case | first process (s) | second process (s) |", "|---|---|---|"]
    for r in first:
        lines.append(f"| {r['case']} | {r.get('first_process_s', r.get('error'))} | {r.get('second_process_s', '-')} |")
    lines += ["", "Causal linear, fp32, E = M = 256 (past the recurrent kinds' buckets): the generic kind the prebuilt "
              "dispatch picks against the recurrent instance built on first use, both timed in this run "
              "(median of triton do_bench, ms):", "",
              "| B H L E M | generic | built on first use | speedup | instance built | rel. diff |",
              "|---|---|---|---|---|---|"]
    for r in causal:
        lines.append(f"| {r['B']} {r['H']} {r['L']} {r['E']} {r['M']} | {r['generic_ms']:.3f} | {r['built_ms']:.3f} | "
                     f"**{r['speedup']:.2f}x** | `{r['built']}` | {r['rel_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    args = ap.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory() as cache:
        first = first_calls(Path(cache) / "first")
        os.environ["ATTNGEN_CACHE"] = str(Path(cache) / "causal")
        causal = causal_e256()
    meta = run_meta(started)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "jit_first_use.json").write_text(json.dumps({"meta": meta, "first_calls": first, "causal_e256": causal},
                                                       indent=1) + "\n")
    (out / "jit_first_use.md").write_text(markdown(first, causal, meta))
    print(markdown(first, causal, meta))


if __name__ == "__main__":
    main()
