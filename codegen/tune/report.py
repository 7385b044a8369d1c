"""What a tuning run reports: the winners per bucket and their speed-up over the default
rules (Markdown), and a heat map of every candidate on every bucket (PNG)."""
from __future__ import annotations

import math


def markdown(header: dict, entries: list[dict], seconds: float | None) -> str:
    """seconds: the run's duration (None: the winners were chosen again from a run's measurements)."""
    took = (f"this run took {seconds:.0f} s." if seconds is not None
            else f"winners chosen again on {header.get('reselected')} from that run's measurements.")
    if header.get("retimed"):
        took += (f" It timed the buckets {', '.join(header['retimed'])} only; the others are as an earlier run "
                 f"measured them, on the day in the table's `tuned`.")
    if header.get("narrowed"):
        took += (f" The grid was narrowed since: the measurements of {len(header['narrowed'])} candidates no longer "
                 f"in it were left out ({', '.join(f'`{n}`' for n in header['narrowed'])}).")
    lines = [f"# Tuning {header['spec']} on {header['device']}", "",
             f"{header['date']}, torch {header['torch']}, CUDA {header['cuda']}, {header['compiler']}; "
             f"{header['candidates']} candidates ({header['rejected_by_passes']} rejected by the passes, "
             f"{header['failed_to_build']} failed to build); {header['timing']}; {took}", "",
             "| bucket | dtype | winner | ms | spread | default rules | ms | speed-up |", "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        speed = f"{e['speedup_vs_default']:.2f}x" if e.get("speedup_vs_default") else "-"
        default_ms = f"{e['default_ms']:.4f}" if e.get("default_ms") else "-"
        lines.append(f"| {e['bucket']} | {e['dtype']} | `{e['instance']}` | {e['time_ms']:.4f} | {e['spread_ms']:.4f} | "
                     f"`{e['default']}` | {default_ms} | {speed} |")
    speeds = [e["speedup_vs_default"] for e in entries if e.get("speedup_vs_default")]
    if speeds:
        geo = math.exp(sum(map(math.log, speeds)) / len(speeds))
        lines += ["", f"Geometric mean speed-up of the winners over the default rules: {geo:.2f}x"]
    return "\n".join(lines) + "\n"


def heat_map(rows: list[dict], path, family: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return False
    names = sorted({m["name"] for r in rows for m in r["measurements"]})
    short = [n.split("_", 3)[-1].replace("_sm90a", "") for n in names]
    grid = np.full((len(rows), len(names)), np.nan)
    for i, r in enumerate(rows):
        ok = [m["median_ms"] for m in r["measurements"] if math.isfinite(m["median_ms"])]
        best = min(ok) if ok else math.nan
        for m in r["measurements"]:
            if math.isfinite(m["median_ms"]):
                grid[i, names.index(m["name"])] = m["median_ms"] / best
    fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.09), max(3.0, 1.2 + 0.35 * len(rows))))
    im = ax.imshow(np.log2(grid), aspect="auto", cmap="viridis_r", vmin=0, vmax=2)
    ax.set_yticks(range(len(rows)), [f"{r['bucket']} {r['dtype']}" for r in rows], fontsize=7)
    ax.set_xticks(range(len(names)), short, rotation=90, fontsize=3)
    fig.colorbar(im, ax=ax, label="log2(time / best in bucket)")
    ax.set_title(f"{family} tuning: every candidate on every bucket (blank: does not cover it or failed)")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    return True
