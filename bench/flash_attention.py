"""Flash attention forward beside torch SDPA's flash (FlashAttention-2) and cuDNN backends, in one
run, on the softmax shapes of ../shared/ANCHORS.md (bf16, causal and not), and every compiled
instance of the head size forced (the `candidates` kind is timed here, which is what the spec's
choice of tiling rests on). TFLOP/s count 4 * B * H * Lq * Lk * D (half when causal); the bf16
matmul rate measured in the same run is the ceiling. Writes flash_attention.json, .md and .png
under --out.

  python -m bench.flash_attention [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import run_meta  # noqa: E402
from bench.causal_linear import do_bench  # noqa: E402

fa = importlib.import_module("attngen.flash_attention")

# B, H, N, D: the softmax shapes of ANCHORS.md (each causal and not)
SHAPES = [(4, 48, 1024, 64), (4, 48, 4096, 64), (1, 48, 16384, 64),
          (4, 24, 1024, 128), (4, 24, 4096, 128), (1, 24, 16384, 128),
          (4, 32, 2048, 96), (2, 16, 4096, 256)]   # issue 32's weak head sizes
PEERS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def flops(B, H, N, D, causal):
    return 4 * B * H * N * N * D / (2 if causal else 1)


def matmul_tflops(n=8192):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n ** 3 / do_bench(lambda: a @ b) / 1e9


def sdpa(backend, q, k, v, causal):
    """SDPA on the same [B, N, H, D] tensors (viewed [B, H, N, D], no copy)."""
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=causal).transpose(1, 2)


def run(quick: bool, head_sizes=None):
    rows = []
    peak = matmul_tflops()
    print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s", flush=True)
    names = fa.instances() + fa.OP.bench_instances()   # the bench-role ones: `codegen build --bench`
    for B, H, N, D in (shape for shape in SHAPES if not head_sizes or shape[3] in head_sizes):
        g = torch.Generator(device="cuda").manual_seed(N + D)
        q, k, v = (torch.randn(B, N, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
        mine = [n for n in names if fa.instance_head_size(n) == D and n.endswith("_bf16_sm90a")
                and not fa.cache_exponent_bits(n)]   # those read a paged fp8 cache: bench.paged_attention
        for causal in (False, True):
            work = flops(B, H, N, D, causal)
            row = {"B": B, "H": H, "N": N, "D": D, "causal": causal, "dtype": "bf16", "flop": work,
                   "instance": fa.selected_instance(q, k, v)}
            out = fa.flash_attention(q, k, v, causal=causal)
            want = sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal)
            row["rel_diff_vs_sdpa_flash"] = ((out.float() - want.float()).norm() / want.float().norm()).item()
            row["attngen_ms"] = do_bench(lambda: fa.flash_attention(q, k, v, causal=causal))
            for peer, backend in PEERS.items():
                try:
                    row[f"{peer}_ms"] = do_bench(lambda: sdpa(backend, q, k, v, causal))
                except RuntimeError as exc:   # a backend that refuses the shape
                    row[f"{peer}_error"] = str(exc).splitlines()[0]
            if not quick:
                row["forced"] = {n: do_bench(lambda: fa.flash_attention(q, k, v, causal=causal, instance=n))
                                 for n in mine}
                # Each forced instance's output against SDPA flash's (bench-role kinds have no GPU tier).
                row["forced_rel_diff"] = {n: ((fa.flash_attention(q, k, v, causal=causal, instance=n).float()
                                               - want.float()).norm() / want.float().norm()).item() for n in mine}
            for key in ("attngen", *PEERS):
                if f"{key}_ms" in row:
                    row[f"{key}_tflops"] = work / row[f"{key}_ms"] / 1e9
            row["fraction_of_matmul"] = row["attngen_tflops"] / peak
            rows.append(row)
            print(json.dumps(row), flush=True)
        q = k = v = out = want = None
        torch.cuda.empty_cache()
    return peak, rows


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def markdown(peak, rows, meta) -> str:
    f = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    out = [f"# Flash attention forward, bf16 ({meta['device']}, torch {meta['torch']}, commit {meta['commit']})", "",
           f"bf16 matmul 8192^3 in this run: **{peak:.0f} TFLOP/s**. TFLOP/s = 4 B H N^2 D / time (half when "
           "causal); median of triton do_bench; every column from this run.", "",
           "| B H N D | causal | attngen | SDPA flash (FA2) | SDPA cuDNN | vs flash | vs cuDNN | of matmul | instance |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = lambda peer: (f"{r['attngen_tflops'] / r[peer + '_tflops']:.2f}x"  # noqa: E731
                           if peer + "_tflops" in r else "-")
        out.append(f"| {r['B']} {r['H']} {r['N']} {r['D']} | {'yes' if r['causal'] else 'no'} | "
                   f"**{f(r['attngen_tflops'])}** | {f(r.get('sdpa_flash_tflops'))} | {f(r.get('sdpa_cudnn_tflops'))} | "
                   f"{vs('sdpa_flash')} | {vs('sdpa_cudnn')} | {r['fraction_of_matmul']:.0%} | `{r['instance']}` |")
    ratio = lambda peer: geomean([r["attngen_tflops"] / r[peer + "_tflops"] for r in rows if peer + "_tflops" in r])  # noqa: E731
    out += ["", f"Geometric mean over the {len(rows)} cases: {ratio('sdpa_flash'):.2f}x SDPA flash, "
            f"{ratio('sdpa_cudnn'):.2f}x SDPA cuDNN.", "",
            "rel. difference attngen vs SDPA flash (bf16 outputs): "
            + ", ".join(f"{r['rel_diff_vs_sdpa_flash']:.1e}" for r in rows)]
    if rows and "forced" in rows[0]:
        out += ["", "## Every instance forced (TFLOP/s; its output's relative difference from SDPA flash's)", ""]
        for r in rows:
            diff = r.get("forced_rel_diff", {})
            cells = ", ".join(f"`{n.replace('flash_attention_', '').replace('_bf16_sm90a', '')}` "
                              f"{r['flop'] / ms / 1e9:.0f}" + (f" (rel diff {diff[n]:.1e})" if n in diff else "")
                              for n, ms in sorted(r["forced"].items(), key=lambda x: x[1]))
            out.append(f"- {r['B']} {r['H']} {r['N']} {r['D']} {'causal' if r['causal'] else 'full'}: {cells}")
    return "\n".join(out) + "\n"


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{r['B']}x{r['H']}x{r['N']}\nD{r['D']}{' c' if r['causal'] else ''}" for r in rows]
    fig, ax = plt.subplots(figsize=(12, 4))
    width = 0.27
    for i, (key, name) in enumerate((("attngen", "attngen"), ("sdpa_flash", "SDPA flash"), ("sdpa_cudnn", "SDPA cuDNN"))):
        ax.bar([x + (i - 1) * width for x in range(len(rows))], [r.get(f"{key}_tflops", 0) for r in rows], width, label=name)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip timing every instance forced")
    ap.add_argument("--head-sizes", type=int, nargs="*", help="only the shapes of these head sizes")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    args = ap.parse_args()
    t0 = time.time()
    peak, rows = run(args.quick, args.head_sizes)
    meta = run_meta(t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flash_attention.json").write_text(json.dumps({"meta": meta, "matmul_tflops": peak, "rows": rows}, indent=1) + "\n")
    (out / "flash_attention.md").write_text(markdown(peak, rows, meta))
    plot(rows, out / "flash_attention.png")
    print((out / "flash_attention.md").read_text())


if __name__ == "__main__":
    main()
