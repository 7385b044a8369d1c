"""An A/B call's per-kernel times side by side, so that nobody copies them by hand: each side's
`ab_<side>/*.txt` and step log `ab_<side>.log` holding per_kernel listings
(bench.gated_delta_profile.per_kernel: a title line ending in "per call:", then one
"<ms> ms  <n> x  <kernel>" line a kernel, a rate after it ignored) become one
Markdown table, a row per (title, kernel), a column per side in the order gpu_check ran them
(before, after_1, ..., after), and the last side's time over the first's. Prints nothing where
no side holds such a listing (an AB_CMD of another kind).

  python -m bench.ab_table DIR [--min-ms X]   # DIR holds ab_before/, ab_after_1/, ..., ab_after/
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# A trailing rate (bench.flash_grad_profile's "  524 TFLOP/s") is no part of the kernel's name:
# with it each side's row stood alone.
KERNEL_LINE = re.compile(r"^\s*([0-9.]+) ms\s+\d+ x\s+(.+?)(?:\s+[0-9.]+ TFLOP/s)?\s*$")
TITLE_END = "per call:"


def side_order(name: str) -> tuple:
    """before first, then after_1, after_2, ..., then after."""
    if name == "before":
        return (0, 0)
    if name == "after":
        return (2, 0)
    return (1, int(name.rsplit("_", 1)[1]))


def short_kernel(name: str) -> str:
    """`attngen::delta_rule::(anonymous namespace)::chunk_kernel(attngen::...` -> `attngen::delta_rule::chunk_kernel`."""
    return name.replace("(anonymous namespace)::", "").split("(", 1)[0].strip()


def read_side(folder: Path) -> dict:
    """{(title, kernel): ms} from every per_kernel listing in the folder's .txt files and in the
    side's step log beside it (`ab_<side>.log`: what AB_CMD printed, where a profile printing to
    stdout, as bench.flash_grad_profile does, leaves its listing)."""
    times, title = {}, None
    log = folder.parent / f"{folder.name}.log"
    for path in sorted(folder.glob("*.txt")) + ([log] if log.is_file() else []):
        title = None
        for line in path.read_text(errors="replace").splitlines():
            if line.rstrip().endswith(TITLE_END):
                title = line.rstrip()[: -len(TITLE_END)].rstrip(" ,")
                continue
            m = KERNEL_LINE.match(line)
            if m and title is not None:
                times[(title, short_kernel(m.group(2)))] = float(m.group(1))
    return times


def table(root: Path, min_ms: float = 0.005) -> str:
    sides = sorted((p.name[3:] for p in root.glob("ab_*") if p.is_dir() and re.fullmatch(r"ab_(before|after(_\d+)?)", p.name)),
                   key=side_order)
    data = {side: read_side(root / f"ab_{side}") for side in sides}
    rows = []
    for side in sides:
        rows += [key for key in data[side] if key not in rows]
    rows = [key for key in rows if max(data[s].get(key, 0.0) for s in sides) >= min_ms]
    if not rows:
        return ""
    first, last = sides[0], sides[-1]
    lines = ["| shape | kernel | " + " | ".join(sides) + f" | {last} / {first} |",
             "|---|---|" + "---|" * (len(sides) + 1)]
    for title, kernel in rows:
        cells = [f"{data[s][(title, kernel)]:.3f} ms" if (title, kernel) in data[s] else "-" for s in sides]
        a, b = data[first].get((title, kernel)), data[last].get((title, kernel))
        ratio = f"{b / a:.3f}" if a and b else "-"
        lines.append(f"| {title} | `{kernel}` | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--min-ms", type=float, default=0.005, help="leave out kernels under this on every side")
    args = ap.parse_args(argv)
    sys.stdout.write(table(args.root, args.min_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
