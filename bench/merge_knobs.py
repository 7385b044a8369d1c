"""Split-K merge knobs (paged `merge_rows`, `pdl`) from a paged tuning run's measurements.

Every decode configuration of the tuning grid was timed with each merge variant on each bucket
(codegen tune writes them to tune_paged.json); this groups the measurements by configuration
and prints, per bucket, the geometric mean time of each variant against a reference variant.

    python3 -m bench.merge_knobs bench/results/h100/paged_merge_sweep.json [--ref rows4_pdl1]
"""
from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict

KNOBS = re.compile(r"_merge_rows(\d+)_pdl(\d)_")


def variant_ratios(rows: list, ref: str) -> dict:
    """{bucket: {variant: geomean time / ref time over the configurations timed with both}}."""
    out = {}
    for row in rows:
        configs = defaultdict(dict)
        for m in row["measurements"]:
            knobs = KNOBS.search(m["name"])
            if knobs and knobs.group(1) != "0" and math.isfinite(m["median_ms"]):
                configs[m["name"].replace(knobs.group(0), "_")][f"rows{knobs.group(1)}_pdl{knobs.group(2)}"] = m["median_ms"]
        logs = defaultdict(list)
        for times in configs.values():
            if ref in times:
                for variant, ms in times.items():
                    logs[variant].append(math.log(ms / times[ref]))
        out[row["bucket"]] = {v: (math.exp(sum(x) / len(x)), len(x)) for v, x in sorted(logs.items())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--ref", default="rows4_pdl1")
    args = ap.parse_args()
    data = json.load(open(args.json))
    ratios = variant_ratios(data["rows"], args.ref)
    variants = sorted({v for r in ratios.values() for v in r})
    print(f"geomean time against {args.ref} (configurations timed with both)\n")
    print("| bucket | configurations | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for bucket, r in ratios.items():
        n = max(c for _, c in r.values())
        print(f"| {bucket} | {n} | " + " | ".join(f"{r[v][0]:.3f}" if v in r else "-" for v in variants) + " |")


if __name__ == "__main__":
    main()
