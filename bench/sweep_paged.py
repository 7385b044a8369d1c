"""Time every bf16 D128 paged decode instance on the issue's shapes (the evidence behind the
spec's grid and dispatch choices). Writes sweep_paged.json and sweep_paged.md under --out.

  python -m bench.sweep_paged [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attngen import paged  # noqa: E402
from bench.causal_linear import do_bench  # noqa: E402
from bench.paged import CASES, D, kv_bytes, make_case  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    args = ap.parse_args()
    names = [n for n in paged.instances() if f"_d{D}_" in n and n.endswith("_bf16_sm90a")]
    results = []
    for case_name, S, Hq, Hkv, lens, _target, _anchor in CASES:
        case = make_case(S, Hq, Hkv, lens)
        nbytes = kv_bytes(case[1], case[4])
        for name in names:
            try:
                paged.paged_decode_with(name, *case)
            except ValueError as err:       # the instance does not cover this group (its packing)
                if "does not cover" not in str(err):
                    raise
                continue
            ms = do_bench(lambda: paged.paged_decode_with(name, *case))
            results.append({"case": case_name, "instance": name, "ms": ms, "tbps": nbytes / ms / 1e9})
            print(json.dumps(results[-1]), flush=True)
        case = None  # free the cache before the next case
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_paged.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"# paged decode sweep, bf16 D{D} ({torch.cuda.get_device_name()})", ""]
    for case_name, *_ in CASES:
        rows = sorted((r for r in results if r["case"] == case_name), key=lambda r: -r["tbps"])
        lines += [f"## {case_name}", "", "| TB/s | ms | instance |", "|---|---|---|"]
        lines += [f"| {r['tbps']:.3f} | {r['ms']:.3f} | `{r['instance']}` |" for r in rows[:12]]
        lines.append("")
    (out / "sweep_paged.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
