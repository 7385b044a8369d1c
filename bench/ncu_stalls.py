"""Where a kernel's warps wait, from Nsight Compute's warp stall samples per SASS instruction.

SourceCounters samples each warp's program counter and why it did not issue. Summed by reason
they say what bounds the kernel (barrier: warps of a CTA waiting for each other; short
scoreboard: shared memory; long scoreboard: global memory; wait: fixed-latency dependencies);
summed over runs of consecutive instructions they say where (a barrier's samples sit on the
instruction after it); cut at the barriers, the executed counts say what a warp issues between
two of them each pass (the chunked RWKV-7 kernels' loads and step 1 were found so:
bench/results/h200/rwkv7_fwd_warps8_dropped.md). The first kernel of the chunked Gated
DeltaNet kinds was reworked from such a summary (bench/results/h100/gated_delta_prepare_ncu.txt).

  ncu --section SourceCounters --section WarpStateStats -k regex:NAME -o DIR/profile python ...
  ncu -i DIR/profile.ncu-rep --page source --csv --print-source sass > DIR/sass.csv
  python -m bench.ncu_stalls DIR/sass.csv [--kernel REGEX] [--window 40] [--top 12]
(`STEPS=ncu_gated_delta make gpu-check` profiles the Gated DeltaNet kernels so.)
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bank_check import opcode, parse_source_csv  # noqa: E402


def reasons(rows: list) -> Counter:
    """Stall samples by reason over a kernel's instructions."""
    total = Counter()
    for row in rows:
        total.update(row["stalls"])
    return total


def windows(rows: list, width: int) -> list:
    """Runs of `width` consecutive instructions: (first index, share of the kernel's samples,
    instructions executed, the most frequent opcodes), in program order."""
    total = sum(r["samples"] for r in rows) or 1.0
    out = []
    for start in range(0, len(rows), width):
        run = rows[start:start + width]
        ops = Counter(opcode(r["sass"]).split(".")[0] for r in run)
        out.append((start, sum(r["samples"] for r in run) / total, sum(r["executed"] for r in run), ops.most_common(5)))
    return out


def phases(rows: list) -> list:
    """The kernel cut at its barriers (a run ends with its BAR instruction): (first index, last
    index, share of the samples, instructions a warp executes in it per pass of the hottest
    barrier, the most frequent opcodes). A loop's barrier runs once a warp a pass, so the middle
    column is what a warp issues between two barriers of one pass (a chunk, a tile): the cost of
    a kernel whose warps wait on each other's chains."""
    total = sum(r["samples"] for r in rows) or 1.0
    passes = max((r["executed"] for r in rows if opcode(r["sass"]).startswith("BAR")), default=0) or 1.0
    out, start = [], 0
    for index, row in enumerate(rows):
        if opcode(row["sass"]).startswith("BAR") or index == len(rows) - 1:
            run = rows[start:index + 1]
            ops = Counter(opcode(r["sass"]).split(".")[0] for r in run)
            out.append((start, index, sum(r["samples"] for r in run) / total,
                        sum(r["executed"] for r in run) / passes, ops.most_common(5)))
            start = index + 1
    return out


def hottest(rows: list, count: int) -> list:
    """The `count` instructions with the most samples, in program order: (index, share, sass,
    its two main reasons)."""
    total = sum(r["samples"] for r in rows) or 1.0
    top = sorted(range(len(rows)), key=lambda i: -rows[i]["samples"])[:count]
    return [(i, rows[i]["samples"] / total, rows[i]["sass"], Counter(rows[i]["stalls"]).most_common(2))
            for i in sorted(top)]


def report(kernels: dict, pattern: str, width: int, top: int, floor: float = 0.015) -> str:
    """Per kernel whose name matches `pattern`: the reasons, the runs holding at least `floor`
    of the samples, and the hottest instructions."""
    lines = []
    for name, rows in kernels.items():
        if not re.search(pattern, name) or not any(r["samples"] for r in rows):
            continue
        total = sum(r["samples"] for r in rows)
        lines.append(f"{name}: {len(rows)} instructions, {total:.0f} samples")
        lines.append("  by reason: " + ", ".join(f"{k} {v / total:.0%}" for k, v in reasons(rows).most_common(8) if v))
        lines.append(f"  runs of {width} instructions with {floor:.1%} of the samples or more:")
        for start, share, executed, ops in windows(rows, width):
            if share >= floor:
                lines.append(f"    {start:5d} {share:6.1%}  executed {executed:10.0f}  " +
                             " ".join(f"{op}x{n}" for op, n in ops))
        lines.append("  between barriers (instructions a warp a pass of the hottest barrier):")
        for first, last, share, per_pass, ops in phases(rows):
            if share >= floor or per_pass >= 1:
                lines.append(f"    {first:5d}-{last:<5d} {share:6.1%}  a warp a pass {per_pass:7.1f}  " +
                             " ".join(f"{op}x{n}" for op, n in ops))
        lines.append(f"  the {top} hottest instructions:")
        for index, share, sass, main in hottest(rows, top):
            lines.append(f"    {index:5d} {share:6.1%}  {sass[:56]:56s} " + ", ".join(f"{k} {v:.0f}" for k, v in main))
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path, help="ncu's source page as CSV (--page source --csv --print-source sass)")
    parser.add_argument("--kernel", default=".", help="regular expression over the kernel names")
    parser.add_argument("--window", type=int, default=40, help="instructions a run")
    parser.add_argument("--top", type=int, default=12, help="hottest instructions listed")
    args = parser.parse_args()
    print(report(parse_source_csv(args.csv.read_text()), args.kernel, args.window, args.top), end="")


if __name__ == "__main__":
    main()
