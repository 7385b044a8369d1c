"""Tuned dispatch against the spec's default rules, side by side in one run, on the shapes
of ../shared/ANCHORS.md: python -m bench.tune_compare [--out DIR]."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from bench.causal_linear import SHAPES, do_bench, environment, make_inputs, rotating  # noqa: E402
from codegen import dispatch, families, pipeline  # noqa: E402
from codegen.arch import DTYPE_BYTES  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    args = parser.parse_args()
    default_spec, built = pipeline.lower(pipeline.expand(pipeline.load()), use_tuned=False)[0]
    tuned_spec, all_instances = pipeline.lower(pipeline.expand(pipeline.load()))[0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for (B, H, L, E, M), _ in SHAPES:
        shape = {"B": B, "H": H, "L": L, "E": E, "M": M}
        for dname, dtype in DTYPES.items():
            runtime = families.family("causal_linear").tune.runtime(shape, DTYPE_BYTES[dname], sms)
            axes = {"dtype": dname, "direction": "fwd"}
            default = dispatch.select(default_spec, built, runtime, axes).name
            tuned = dispatch.select(tuned_spec, all_instances, runtime, axes).name
            get = rotating(lambda i: make_inputs(B, H, L, E, M, dtype, "bhld", i), B * H * L * (2 * E + M) * 4)
            generated = attngen.selected_instance(*get())
            assert generated == tuned, f"generated dispatch picked {generated}, the python mirror {tuned}"
            t_default = do_bench(lambda: attngen.causal_dot_product_with(default, *get()))
            t_tuned = do_bench(lambda: attngen.causal_dot_product(*get()))
            rows.append({"shape": shape, "dtype": dname, "default": default, "default_ms": t_default,
                         "tuned": tuned, "tuned_ms": t_tuned, "speedup": t_default / t_tuned})
            print(json.dumps(rows[-1]), flush=True)
    env = environment()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tuned_vs_default.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = [f"# Tuned dispatch vs the default rules, {env['device']}", "",
             f"commit {env['commit']}, torch {env['torch']}, {env['date']}; {env['timing']}. Both in one run; the "
             f"tuned side goes through the generated dispatch (`causal_dot_product`), the default side runs the "
             f"instance the spec's rules pick.", "",
             "| B H L E M | dtype | default rules (ms) | tuned (ms) | speed-up | tuned instance |", "|---|---|---|---|---|---|"]
    for r in rows:
        s = r["shape"]
        lines.append(f"| {s['B']} {s['H']} {s['L']} {s['E']} {s['M']} | {r['dtype']} | {r['default_ms']:.4f} | "
                     f"{r['tuned_ms']:.4f} | {r['speedup']:.2f}x | `{r['tuned']}` |")
    for dname in DTYPES:
        sp = [r["speedup"] for r in rows if r["dtype"] == dname]
        lines.append(f"\n{dname}: geometric mean {math.exp(sum(map(math.log, sp)) / len(sp)):.2f}x, "
                     f"worst {min(sp):.2f}x")
    md = "\n".join(lines) + "\n"
    (out / "tuned_vs_default.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
