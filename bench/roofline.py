"""Where each benchmarked kernel stands against the H100's limits, from the committed benchmark
results (no GPU): for every case, the fewest bytes the op must move (inputs read once, outputs
written once) and its FLOPs, both from the shape; the two floors they give at the measured copy
bandwidth and the arithmetic rate of the unit that does the work; and the achieved fraction of
the binding (larger) floor.

  python -m bench.roofline [--results DIR] [--out DIR]   writes OUT/roofline.md and .png (run by `make report`;
                                                         OUT defaults to build/report)

Limits: the copy bandwidth and the bf16 matmul rate measured in the benchmark runs that the
results record (paged.json, flash_attention.json), and the fp32 CUDA-core rate of
../shared/ANCHORS.md (cuBLAS fp32 8192^3 without TF32 on the same H100, 51 TFLOP/s).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FP32_CUDA_CORE_TFLOPS = 51.0   # ../shared/ANCHORS.md, measured on the lent H100
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def floors(nbytes: float, flop: float, tbps: float, tflops: float) -> dict:
    memory_ms, compute_ms = nbytes / tbps / 1e9, flop / tflops / 1e9
    bound = "memory" if memory_ms >= compute_ms else "compute"
    return {"bytes": nbytes, "flop": flop, "memory_floor_ms": memory_ms, "compute_floor_ms": compute_ms,
            "bound": bound, "floor_ms": max(memory_ms, compute_ms)}


def causal_linear_rows(d: dict, copy: float, matmul_tflops: float) -> list:
    """Forward: read q, k (E) and v (M), write o (M). fp32 runs the recurrence on CUDA cores:
    per step the state update and the output each take E*M FMAs (4 E M FLOPs). fp16/bf16 run
    the chunked kind on tensor cores: the same 4 E M per step plus the causal half of a
    chunk x chunk score block and its product with V, about chunk (E + M) FLOPs per step (the
    chunk from the dispatched instance's name: 16 steps per warp)."""
    out = []
    for r in d["forward"]:
        s = r["shape"]
        tokens = s["B"] * s["H"] * s["L"]
        for dt in ("fp32", "bf16", "fp16"):
            ms = r.get(f"attngen_fwd_{dt}_ms")
            if ms is None:
                continue
            if dt == "fp32":
                flop, rate = 4.0 * tokens * s["E"] * s["M"], FP32_CUDA_CORE_TFLOPS
            else:
                chunk = 16 * int(r["instance_bf16"].split("_warps")[1].split("_")[0])  # 16 steps per warp
                flop, rate = tokens * (4.0 * s["E"] * s["M"] + chunk * (s["E"] + s["M"])), matmul_tflops
            f = floors(tokens * (2 * s["E"] + 2 * s["M"]) * BYTES[dt], flop, copy, rate)
            out.append({"op": f"causal_linear fwd {dt}", "shape": f"B{s['B']} H{s['H']} L{s['L']} E{s['E']} M{s['M']}",
                        "ms": ms, **f})
    return out


def rwkv_rows(d: dict, copy: float) -> list:
    """wkv forward: read r, k, v, w, write o (N per token each), the N x N fp32 state in and out;
    per step and head 2 N^2 FMAs (decay and update, output) plus the bonus: ~4 N^2 FLOPs, fp32."""
    out = []
    for r in d["forward"]:
        s = r["shape"]
        tokens = s["B"] * s["T"] * s["H"]
        nbytes = tokens * 5 * s["N"] * BYTES[r["dtype"]] + 2 * s["B"] * s["H"] * s["N"] ** 2 * 4
        f = floors(nbytes, 4.0 * tokens * s["N"] ** 2, copy, FP32_CUDA_CORE_TFLOPS)
        out.append({"op": f"wkv6 fwd {r['dtype']}", "shape": f"B{s['B']} T{s['T']} H{s['H']} N{s['N']}",
                    "ms": r["attngen_fwd_ms"], **f})
    return out


def paged_rows(d: dict, copy: float) -> list:
    """Decode: the K and V bytes inside the contexts (the benchmark's own count); 4 D FLOPs per
    (query head, token), on CUDA cores."""
    out = []
    for r in d["rows"]:
        flop = 4.0 * r["Hq"] * r["context_tokens"] * r["D"]
        f = floors(r["kv_bytes"], flop, copy, FP32_CUDA_CORE_TFLOPS)
        out.append({"op": f"paged decode {r['dtype']}", "shape": r["case"], "ms": r["attngen_ms"], **f})
    return out


def flash_rows(d: dict, copy: float) -> list:
    """Softmax attention forward: read q, k, v, write o; 4 B H N^2 D FLOPs (half when causal) on
    the tensor cores at the measured bf16 matmul rate."""
    out = []
    for r in d["rows"]:
        nbytes = 4 * r["B"] * r["N"] * r["H"] * r["D"] * BYTES[r["dtype"]]
        f = floors(nbytes, r["flop"], copy, d["matmul_tflops"])
        out.append({"op": f"flash attention {r['dtype']}{' causal' if r['causal'] else ''}",
                    "shape": f"B{r['B']} H{r['H']} N{r['N']} D{r['D']}", "ms": r["attngen_ms"], **f})
    return out


def build(results: Path) -> tuple[list, dict]:
    load = lambda name: json.loads((results / f"{name}.json").read_text())  # noqa: E731
    paged, flash = load("paged"), load("flash_attention")
    copy = paged["copy_tbps"]
    limits = {"copy_tbps": copy, "bf16_matmul_tflops": flash["matmul_tflops"], "fp32_fma_tflops": FP32_CUDA_CORE_TFLOPS,
              "commits": {"paged": paged["meta"]["commit"], "flash_attention": flash["meta"]["commit"],
                          "causal_linear": load("causal_linear")["env"]["commit"], "rwkv": load("rwkv")["meta"]["commit"]}}
    rows = (causal_linear_rows(load("causal_linear"), copy, flash["matmul_tflops"]) + rwkv_rows(load("rwkv"), copy) + paged_rows(paged, copy)
            + flash_rows(flash, copy))
    for r in rows:
        r["fraction"] = r["floor_ms"] / r["ms"]
    return rows, limits


def markdown(rows: list, limits: dict) -> str:
    lines = ["# Roofline of the benchmarked kernels (H100)", "",
             f"Limits: copy {limits['copy_tbps']:.2f} TB/s (read + write, paged run), bf16 matmul "
             f"{limits['bf16_matmul_tflops']:.0f} TFLOP/s (flash run), fp32 CUDA-core FMA {limits['fp32_fma_tflops']:.0f} "
             "TFLOP/s (../shared/ANCHORS.md). Times are the committed benchmark medians (commits: "
             + ", ".join(f"{k} {v}" for k, v in limits["commits"].items()) + "). Bytes: inputs read once, outputs "
             "written once; FLOPs from the shape (bench/roofline.py says how per op). `fraction` = the binding floor "
             "/ measured time.", "",
             "| op | shape | ms | memory floor ms | compute floor ms | bound | fraction |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['shape']} | {r['ms']:.3f} | {r['memory_floor_ms']:.3f} | "
                     f"{r['compute_floor_ms']:.3f} | {r['bound']} | {r['fraction']:.0%} |")
    return "\n".join(lines) + "\n"


def draw(rows: list, limits: dict, path: Path) -> Path:
    """The classic roofline: achieved TFLOP/s against FLOPs per byte, one point per benchmarked
    case (colored by op and dtype), under the copy-bandwidth slope and the two compute roofs."""
    from codegen.report_figure import _pyplot
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 6))
    intensity = [r["flop"] / r["bytes"] for r in rows]
    span = [min(intensity) / 2, max(intensity) * 4]
    copy = limits["copy_tbps"]
    for peak, label in ((limits["bf16_matmul_tflops"], "bf16 MMA"), (limits["fp32_fma_tflops"], "fp32 FMA")):
        knee = peak / copy
        xs = [span[0], knee, max(span[1], knee * 2)]
        ax.plot(xs, [min(copy * x, peak) for x in xs], color="gray", lw=1)
        ax.annotate(f"{label} {peak:.0f} TFLOP/s", (xs[-1], peak), ha="right", va="bottom", fontsize=8)
    for i, op in enumerate(dict.fromkeys(r["op"] for r in rows)):
        rs = [r for r in rows if r["op"] == op]
        ax.scatter([r["flop"] / r["bytes"] for r in rs], [r["flop"] / r["ms"] / 1e9 for r in rs], s=22,
                   color=f"C{i}", label=op)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FLOPs per byte moved (inputs read once, outputs written once)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"Roofline of the benchmarked kernels (H100, copy {copy:.2f} TB/s)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "h100"), help="the benchmark records read")
    ap.add_argument("--out", default=str(ROOT / "build" / "report"),
                    help="where roofline.md and .png go (the committed copy: --out bench/results/h100)")
    args = ap.parse_args()
    rows, limits = build(Path(args.results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "roofline.md").write_text(markdown(rows, limits))
    draw(rows, limits, out / "roofline.png")
    print(f"wrote {out / 'roofline.md'} and roofline.png")


if __name__ == "__main__":
    main()
