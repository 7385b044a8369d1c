"""Flash attention backward beside torch SDPA's flash (FlashAttention-2) and cuDNN backends, in one
run: backward alone (autograd.grad of a saved forward, retain_graph) and forward+backward, bf16,
causal and not, on the softmax shapes of ../shared/ANCHORS.md plus GQA (Hq 32 / Hkv 8, D128, N
8192) and D 96 and 256 rows. TFLOP/s count the backward as 2.5x the forward's 4 B Hq N^2 D
(half when causal), as FlashAttention reports it. Every compiled backward instance of the head
size (the bench-role kinds too: `codegen build --bench`) is also timed forced, backward alone on
the saved forward, which is what the spec's choice of kind rests on. Writes
flash_attention_grad.json, .md and .png under --out.

  python -m bench.flash_attention_grad [--out DIR] [--shapes I ...] [--no-forced: the dispatched backward only]
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import run_meta  # noqa: E402
from bench.causal_linear import do_bench  # noqa: E402
from bench.flash_attention import PEERS, SHAPES, geomean, matmul_tflops  # noqa: E402

fa = importlib.import_module("attngen.flash_attention")

# B, Hq, Hkv, N, D
GRAD_SHAPES = [(B, H, H, N, D) for B, H, N, D in SHAPES] + [   # SHAPES holds the D256 row already
    (1, 32, 8, 8192, 128), (4, 32, 32, 4096, 96)]
BACKWARD_FACTOR = 2.5


def forward_flops(B, H, N, D, causal):
    return 4 * B * H * N * N * D / (2 if causal else 1)


def sdpa(backend, q, k, v, causal):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=causal, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)


def timings(forward, q, k, v, d_out):
    """(backward alone, forward + backward) in ms of one implementation."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = forward(*leaves)
    backward = do_bench(lambda: torch.autograd.grad(out, leaves, d_out, retain_graph=True))
    both = do_bench(lambda: torch.autograd.grad(forward(*leaves), leaves, d_out))
    return backward, both, torch.autograd.grad(out, leaves, d_out)


def forced(names, q, k, v, d_out, causal):
    """Backward alone through each named instance, on the saved out and lse: ms per instance, and
    the largest relative difference of its gradients from the dispatched instance's."""
    out, lse = fa.flash_attention(q, k, v, causal=causal, return_lse=True)
    N, Nk, D = q.shape[1], k.shape[1], q.shape[-1]
    args = (q, k, v, out, d_out, lse, None, None, None, N, Nk, D ** -0.5, -1, 0 if causal else -1, None, 0.0, False)
    want = fa.GRAD(*args)
    times, diffs = {}, {}
    for n in names:
        got = fa.GRAD.forced(n, *args)
        diffs[n] = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, want))
        times[n] = do_bench(lambda: fa.GRAD.forced(n, *args))
    return times, diffs


def run(shapes=None, with_forced=True):
    rows = []
    peak = matmul_tflops()
    print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s", flush=True)
    names = fa.GRAD.instances() + fa.GRAD.bench_instances()
    for B, Hq, Hkv, N, D in (s for i, s in enumerate(GRAD_SHAPES) if shapes is None or i in shapes):
        g = torch.Generator(device="cuda").manual_seed(N + D)
        q, d_out = (torch.randn(B, N, Hq, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(B, N, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
        for causal in (False, True):
            fwd = forward_flops(B, Hq, N, D, causal)
            row = {"B": B, "Hq": Hq, "Hkv": Hkv, "N": N, "D": D, "causal": causal, "dtype": "bf16",
                   "backward_flop": BACKWARD_FACTOR * fwd, "flop": (1 + BACKWARD_FACTOR) * fwd}
            row["attngen_bwd_ms"], row["attngen_fwdbwd_ms"], mine = timings(
                lambda a, b, c: fa.flash_attention(a, b, c, causal=causal), q, k, v, d_out)
            row["attngen_deterministic_bwd_ms"], _, _ = timings(
                lambda a, b, c: fa.flash_attention(a, b, c, causal=causal, deterministic=True), q, k, v, d_out)
            for peer, backend in PEERS.items():
                try:
                    row[f"{peer}_bwd_ms"], row[f"{peer}_fwdbwd_ms"], theirs = timings(
                        lambda a, b, c: sdpa(backend, a, b, c, causal), q, k, v, d_out)
                except RuntimeError as exc:   # a backend that refuses the shape
                    row[f"{peer}_error"] = str(exc).splitlines()[0]
                    continue
                if peer == "sdpa_flash":
                    row["rel_diff_vs_sdpa_flash"] = {
                        name: ((a.float() - b.float()).norm() / b.float().norm()).item()
                        for name, a, b in zip(("dq", "dk", "dv"), mine, theirs)}
            if with_forced:
                row["forced"], row["forced_rel_diff"] = forced(
                    [n for n in names if fa.instance_head_size(n) == D and n.endswith("_bf16_sm90a")], q, k, v, d_out,
                    causal)
            for key in ("attngen", *PEERS):
                if f"{key}_bwd_ms" in row:
                    row[f"{key}_bwd_tflops"] = row["backward_flop"] / row[f"{key}_bwd_ms"] / 1e9
                    row[f"{key}_fwdbwd_tflops"] = row["flop"] / row[f"{key}_fwdbwd_ms"] / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)
        q = k = v = d_out = mine = None
        torch.cuda.empty_cache()
    return peak, rows


def markdown(peak, rows, meta) -> str:
    f = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    out = [f"# Flash attention backward, bf16 ({meta['device']}, torch {meta['torch']}, commit {meta['commit']})", "",
           f"bf16 matmul 8192^3 in this run: **{peak:.0f} TFLOP/s**. Backward TFLOP/s = 2.5 x 4 B Hq N^2 D / time "
           "(half when causal), forward+backward 3.5 x; median of triton do_bench; every column from this run.", "",
           "| B Hq/Hkv N D | causal | bwd attngen | bwd SDPA flash | bwd SDPA cuDNN | vs flash | vs cuDNN "
           "| fwd+bwd attngen | flash | cuDNN | deterministic bwd / default |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = lambda peer: (f"{r['attngen_bwd_tflops'] / r[peer + '_bwd_tflops']:.2f}x"  # noqa: E731
                           if peer + "_bwd_tflops" in r else "-")
        out.append(f"| {r['B']} {r['Hq']}/{r['Hkv']} {r['N']} {r['D']} | {'yes' if r['causal'] else 'no'} | "
                   f"**{f(r['attngen_bwd_tflops'])}** | {f(r.get('sdpa_flash_bwd_tflops'))} | "
                   f"{f(r.get('sdpa_cudnn_bwd_tflops'))} | {vs('sdpa_flash')} | {vs('sdpa_cudnn')} | "
                   f"{f(r['attngen_fwdbwd_tflops'])} | {f(r.get('sdpa_flash_fwdbwd_tflops'))} | "
                   f"{f(r.get('sdpa_cudnn_fwdbwd_tflops'))} | "
                   f"{r['attngen_deterministic_bwd_ms'] / r['attngen_bwd_ms']:.2f}x |")
    ratio = lambda peer: geomean([r["attngen_bwd_tflops"] / r[peer + "_bwd_tflops"]  # noqa: E731
                                  for r in rows if peer + "_bwd_tflops" in r])
    out += ["", f"Backward alone, geometric mean over the cases each peer ran: {ratio('sdpa_flash'):.2f}x SDPA flash, "
            f"{ratio('sdpa_cudnn'):.2f}x SDPA cuDNN. deterministic=True costs "
            f"{geomean([r['attngen_deterministic_bwd_ms'] / r['attngen_bwd_ms'] for r in rows]):.2f}x the default's "
            "backward time (geometric mean)."]
    errors = sorted({r[k] for r in rows for k in r if k.endswith("_error")})
    if errors:
        out += ["", "Peers that refused a shape: " + "; ".join(errors)]
    out += ["", "rel. difference of the gradients, attngen vs SDPA flash (dq / dk / dv): "
            + ", ".join("/".join(f"{x:.1e}" for x in r["rel_diff_vs_sdpa_flash"].values())
                        for r in rows if "rel_diff_vs_sdpa_flash" in r)]
    if not any("forced" in r for r in rows):
        return "\n".join(out) + "\n"
    out += ["", "## Every backward instance forced, backward alone on the saved forward (TFLOP/s; the largest "
            "relative difference of its dq, dk, dv from the dispatched instance's)", ""]
    for r in (r for r in rows if "forced" in r):
        cells = ", ".join(f"`{n.replace('flash_attention_grad_', '').replace('_bf16_sm90a', '')}` "
                          f"{r['backward_flop'] / ms / 1e9:.0f} (diff {r['forced_rel_diff'][n]:.0e})"
                          for n, ms in sorted(r["forced"].items(), key=lambda x: x[1]))
        out.append(f"- {r['B']} {r['Hq']}/{r['Hkv']} {r['N']} {r['D']} {'causal' if r['causal'] else 'full'}: {cells}")
    return "\n".join(out) + "\n"


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{r['B']}x{r['Hq']}/{r['Hkv']}x{r['N']}\nD{r['D']}{' c' if r['causal'] else ''}" for r in rows]
    fig, ax = plt.subplots(figsize=(14, 4))
    width = 0.27
    for i, (key, name) in enumerate((("attngen", "attngen"), ("sdpa_flash", "SDPA flash"), ("sdpa_cudnn", "SDPA cuDNN"))):
        ax.bar([x + (i - 1) * width for x in range(len(rows))], [r.get(f"{key}_bwd_tflops", 0) for r in rows], width,
               label=name)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("backward TFLOP/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    ap.add_argument("--shapes", type=int, nargs="*", help="only these rows of GRAD_SHAPES (indices from 0)")
    ap.add_argument("--no-forced", action="store_true",
                    help="time the dispatched backward and the peers only (no instance forced: nothing else to build)")
    args = ap.parse_args()
    t0 = time.time()
    peak, rows = run(set(args.shapes) if args.shapes else None, with_forced=not args.no_forced)
    meta = run_meta(t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flash_attention_grad.json").write_text(
        json.dumps({"meta": meta, "matmul_tflops": peak, "rows": rows}, indent=1) + "\n")
    (out / "flash_attention_grad.md").write_text(markdown(peak, rows, meta))
    plot(rows, out / "flash_attention_grad.png")
    print((out / "flash_attention_grad.md").read_text())


if __name__ == "__main__":
    main()
