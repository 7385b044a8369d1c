"""bf16 forward: the chunked tensor-core kind against the recurrent kind the spec's rules would
pick without it, forced side by side on short sequences and few (b, h), where a 64-step chunk
is mostly padding or B * H leaves SMs idle. The evidence for the `chunked` rule's `when:`.

  python -m bench.chunked_vs_recurrent [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from bench import ROOT, run_meta
from bench.causal_linear import do_bench, make_inputs, rotating
import attngen
from codegen import dispatch, families, pipeline

# (B, H, L, E, M)
SHAPES = [(1, 1, 16, 64, 64), (1, 1, 64, 64, 64), (1, 1, 256, 64, 64), (1, 1, 1024, 64, 64),
          (1, 1, 16384, 64, 64), (1, 8, 64, 64, 64), (1, 8, 512, 64, 64), (4, 32, 16, 64, 64),
          (4, 32, 64, 64, 64), (4, 32, 256, 64, 64), (32, 32, 64, 64, 64), (32, 32, 128, 64, 64),
          (64, 16, 1024, 64, 64), (8, 16, 256, 128, 128), (2, 4, 128, 32, 32), (16, 32, 64, 128, 128),
          (8, 16, 2048, 256, 256), (2, 8, 4096, 256, 64), (1, 4, 1024, 200, 24)]  # E > 128: generic before


def recurrent_choice(spec, built, runtime) -> str:
    """The instance the rules pick with the chunked rule left out (what 16-bit ran before it)."""
    rules = tuple(r for r in spec.dispatch if r.kind != "chunked")
    inst = dispatch.select(dataclasses.replace(spec, dispatch=rules, tuned=()), built, runtime,
                           {"dtype": "bf16", "direction": "fwd"})
    return inst.name


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    args = parser.parse_args()
    import time
    started = time.time()
    spec, built = pipeline.lower(pipeline.expand(pipeline.load()))[0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for B, H, L, E, M in SHAPES:
        runtime = families.family("causal_linear").tune.runtime({"B": B, "H": H, "L": L, "E": E, "M": M}, 2, sms)
        get = rotating(lambda i: make_inputs(B, H, L, E, M, torch.bfloat16, "bhld", i), B * H * L * (2 * E + M) * 2)
        chunked = attngen.selected_instance(*get())
        recurrent = recurrent_choice(spec, built, runtime)
        row = {"shape": dict(B=B, H=H, L=L, E=E, M=M), "chunked": chunked, "recurrent": recurrent,
               "chunked_ms": do_bench(lambda: attngen.causal_dot_product_with(chunked, *get())),
               "recurrent_ms": do_bench(lambda: attngen.causal_dot_product_with(recurrent, *get()))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = run_meta(started)
    lines = [f"# bf16 forward: chunked against the recurrent kinds, {meta['device']}", "",
             f"commit {meta['commit']}, torch {meta['torch']}; triton do_bench medians, ms. The recurrent "
             "instance is the one the spec's rules pick with the chunked rule left out.", "",
             "| B H L E M | chunked | recurrent | recurrent / chunked | recurrent instance |", "|---|---|---|---|---|"]
    for r in rows:
        s = r["shape"]
        lines.append(f"| {s['B']} {s['H']} {s['L']} {s['E']} {s['M']} | {r['chunked_ms']:.4f} | "
                     f"{r['recurrent_ms']:.4f} | {r['recurrent_ms'] / r['chunked_ms']:.2f}x | `{r['recurrent']}` |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chunked_vs_recurrent.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "chunked_vs_recurrent.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
