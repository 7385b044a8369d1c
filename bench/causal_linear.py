"""Causal linear attention forward/backward beside flash-linear-attention, on the shapes of
../shared/ANCHORS.md. Writes JSON, Markdown and a PNG under bench/results/<gpu>/.

  python -m bench.causal_linear [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from attngen import causal_linear  # noqa: E402
from bench import tree_commit  # noqa: E402

# (B, H, L, E, M) and fast-transformers lmha forward fp32 from ANCHORS.md (ms, not re-measured).
SHAPES = [
    ((1, 8, 4096, 64, 64), 0.232),
    ((4, 8, 4096, 64, 64), 0.706),
    ((8, 16, 4096, 64, 64), 2.074),
    ((2, 16, 16384, 64, 64), 2.714),
    ((8, 16, 2048, 128, 128), 1.134),
    ((4, 8, 4096, 32, 32), 0.293),
]
BACKWARD_SHAPE = ((8, 16, 4096, 64, 64), 4.13)  # lmha backward, ANCHORS.md
L2_BYTES = 50 * 2**20


def do_bench(fn):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def rotating(make, nbytes_one):
    """Enough input sets that one pass over them exceeds L2: the cache cannot flatter."""
    count = max(1, min(8, math.ceil(3 * L2_BYTES / max(nbytes_one, 1))))
    sets = [make(i) for i in range(count)]
    state = {"i": 0}

    def next_set():
        state["i"] = (state["i"] + 1) % count
        return sets[state["i"]]
    return next_set


def make_inputs(B, H, L, E, M, dtype, layout, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (lambda D: (B, L, H, D)) if layout == "blhd" else (lambda D: (B, H, L, D))
    q = torch.randn(shape(E), device="cuda", generator=g).to(dtype) / math.sqrt(E)
    k = torch.randn(shape(E), device="cuda", generator=g).to(dtype) / math.sqrt(L)
    v = torch.randn(shape(M), device="cuda", generator=g).to(dtype)
    return q, k, v


def time_forward(impl, B, H, L, E, M, dtype):
    layout = "blhd" if impl.startswith("fla") else "bhld"
    nbytes = B * H * L * (2 * E + M) * torch.finfo(dtype).bits // 8
    get = rotating(lambda i: make_inputs(B, H, L, E, M, dtype, layout, i), nbytes)
    fn = forward_fn(impl)
    return do_bench(lambda: fn(*get()))


def forward_fn(impl):
    if impl == "attngen":
        return attngen.causal_dot_product
    if impl.startswith("instance:"):
        name = impl.split(":", 1)[1]
        return lambda q, k, v: attngen.causal_dot_product_with(name, q, k, v)
    from fla.ops.linear_attn import chunk_linear_attn, fused_recurrent_linear_attn
    f = chunk_linear_attn if impl == "fla_chunk" else fused_recurrent_linear_attn
    return lambda q, k, v: f(q, k, v, scale=1.0, normalize=False)[0]


def time_fwd_bwd(impl, B, H, L, E, M, dtype, backward_only=False):
    layout = "blhd" if impl.startswith("fla") else "bhld"
    q, k, v = (x.requires_grad_() for x in make_inputs(B, H, L, E, M, dtype, layout, 0))
    fn = forward_fn(impl)
    grad = torch.randn(q.shape[:-1] + (M,), device="cuda", dtype=dtype)
    if backward_only:
        out = fn(q, k, v)
        return do_bench(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
    return do_bench(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad))


def chunked_variants(E: int, M: int) -> list[str]:
    """The bf16 forward chunked instances (dispatched kind and its candidates) built for
    exactly this E and M: timed side by side to choose the chunked kind's defaults."""
    names = attngen.instances() + causal_linear.OP.bench_instances()   # the bench-role ones: `codegen build --bench`
    return [n for n in names if "_fwd_chunked" in n and f"_e{E}_m{M}_" in n and n.endswith("_bf16_sm90a")]


def have_fla() -> bool:
    try:
        import fla.ops.linear_attn  # noqa: F401
        return True
    except Exception as exc:  # noqa: BLE001 - any import failure means: no peer in this run
        print(f"flash-linear-attention unavailable: {exc}", file=sys.stderr)
        return False


def run(quick: bool, variants: bool):
    fla = have_fla()
    rows = []
    for (B, H, L, E, M), lmha_ms in SHAPES:
        shape = dict(B=B, H=H, L=L, E=E, M=M)
        row = {"shape": shape, "lmha_fwd_fp32_anchor_ms": lmha_ms,
               "instance_fp32": attngen.selected_instance(*make_inputs(B, H, 16, E, M, torch.float32, "bhld", 0))}
        row["attngen_fwd_fp32_ms"] = time_forward("attngen", B, H, L, E, M, torch.float32)
        row["attngen_fwd_bf16_ms"] = time_forward("attngen", B, H, L, E, M, torch.bfloat16)
        row["attngen_fwd_fp16_ms"] = time_forward("attngen", B, H, L, E, M, torch.float16)
        row["instance_bf16"] = attngen.selected_instance(*make_inputs(B, H, L, E, M, torch.bfloat16, "bhld", 0))
        if fla:
            row["fla_chunk_fwd_fp32_ms"] = time_forward("fla_chunk", B, H, L, E, M, torch.float32)
            row["fla_chunk_fwd_bf16_ms"] = time_forward("fla_chunk", B, H, L, E, M, torch.bfloat16)
            if not quick:
                row["fla_fused_recurrent_fwd_fp32_ms"] = time_forward("fla_recurrent", B, H, L, E, M, torch.float32)
        row["chunked_bf16_ms"] = {name: time_forward(f"instance:{name}", B, H, L, E, M, torch.bfloat16)
                                  for name in (chunked_variants(E, M) if variants else [])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (B, H, L, E, M), lmha_bwd = BACKWARD_SHAPE
    bwd = {"shape": dict(B=B, H=H, L=L, E=E, M=M), "lmha_bwd_fp32_anchor_ms": lmha_bwd,
           "attngen_bwd_fp32_ms": time_fwd_bwd("attngen", B, H, L, E, M, torch.float32, backward_only=True),
           "attngen_fwd_bwd_fp32_ms": time_fwd_bwd("attngen", B, H, L, E, M, torch.float32)}
    bwd["attngen_fwd_bwd_bf16_ms"] = time_fwd_bwd("attngen", B, H, L, E, M, torch.bfloat16)
    if fla:
        bwd["fla_chunk_fwd_bwd_fp32_ms"] = time_fwd_bwd("fla_chunk", B, H, L, E, M, torch.float32)
        bwd["fla_chunk_fwd_bwd_bf16_ms"] = time_fwd_bwd("fla_chunk", B, H, L, E, M, torch.bfloat16)
    print(json.dumps(bwd), flush=True)
    return rows, bwd


def environment() -> dict:
    commit = tree_commit()
    fla_version = None
    try:
        import importlib.metadata as md
        fla_version = md.version("fla-core")
    except Exception:  # noqa: BLE001
        pass
    return {"device": torch.cuda.get_device_name(), "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
            "torch": torch.__version__, "cuda": torch.version.cuda, "fla_core": fla_version,
            "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "timing": "triton.testing.do_bench median, inputs rotated beyond L2"}


def geomean(xs) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def fmt(x):
    return f"{x:.3f}" if isinstance(x, (int, float)) else "-"


def markdown(env, rows, bwd) -> str:
    lines = [f"# Causal linear attention, {env['device']}", "",
             f"commit {env['commit']}, torch {env['torch']}, CUDA {env['cuda']}, fla-core {env['fla_core']}, "
             f"{env['date']}; {env['timing']}. Times in ms. lmha figures are from ANCHORS.md "
             f"(fast-transformers, same GPU model), not re-measured here.", "",
             "| B H L E M | lmha fp32 (anchor) | attngen fp32 | speed-up vs lmha | attngen bf16 | fla chunk fp32 | fla chunk bf16 | fla fused_recurrent fp32 | instance (fp32) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["shape"]
        lines.append(f"| {s['B']} {s['H']} {s['L']} {s['E']} {s['M']} | {fmt(r['lmha_fwd_fp32_anchor_ms'])} | "
                     f"{fmt(r['attngen_fwd_fp32_ms'])} | {r['lmha_fwd_fp32_anchor_ms'] / r['attngen_fwd_fp32_ms']:.2f}x | "
                     f"{fmt(r['attngen_fwd_bf16_ms'])} | {fmt(r.get('fla_chunk_fwd_fp32_ms'))} | "
                     f"{fmt(r.get('fla_chunk_fwd_bf16_ms'))} | {fmt(r.get('fla_fused_recurrent_fwd_fp32_ms'))} | "
                     f"`{r['instance_fp32']}` |")
    ratios = [r["lmha_fwd_fp32_anchor_ms"] / r["attngen_fwd_fp32_ms"] for r in rows]
    lines += ["", f"Geometric mean speed-up of the fp32 forward over the lmha anchors: {geomean(ratios):.2f}x", ""]
    lines += ["| B H L E M | attngen bf16 | attngen fp16 | fla chunk bf16 | fla / attngen bf16 | fp16 / bf16 | instance (bf16) |",
              "|---|---|---|---|---|---|---|"]
    vs_fla = []
    for r in rows:
        s = r["shape"]
        fla_bf16 = r.get("fla_chunk_fwd_bf16_ms")
        ratio = fla_bf16 / r["attngen_fwd_bf16_ms"] if fla_bf16 else None
        if ratio:
            vs_fla.append(ratio)
        lines.append(f"| {s['B']} {s['H']} {s['L']} {s['E']} {s['M']} | {fmt(r['attngen_fwd_bf16_ms'])} | "
                     f"{fmt(r['attngen_fwd_fp16_ms'])} | {fmt(fla_bf16)} | {f'{ratio:.2f}x' if ratio else '-'} | "
                     f"{r['attngen_fwd_fp16_ms'] / r['attngen_fwd_bf16_ms']:.3f} | `{r['instance_bf16']}` |")
    if vs_fla:
        lines += ["", f"Geometric mean of fla chunk bf16 time over attngen bf16 time: {geomean(vs_fla):.2f}x", ""]
    lines += [
              "| backward B8 H16 L4096 E64 M64 fp32 | ms |", "|---|---|",
              f"| lmha backward (anchor) | {fmt(bwd['lmha_bwd_fp32_anchor_ms'])} |",
              f"| attngen backward | {fmt(bwd['attngen_bwd_fp32_ms'])} |",
              f"| attngen forward + backward | {fmt(bwd['attngen_fwd_bwd_fp32_ms'])} |",
              f"| fla chunk forward + backward | {fmt(bwd.get('fla_chunk_fwd_bwd_fp32_ms'))} |",
              "", "| forward + backward B8 H16 L4096 E64 M64 bf16 | ms |", "|---|---|",
              f"| attngen | {fmt(bwd['attngen_fwd_bwd_bf16_ms'])} |",
              f"| fla chunk | {fmt(bwd.get('fla_chunk_fwd_bwd_bf16_ms'))} |"]
    lines += ["", "Chunked bf16 forward, each built variant forced (ms):", "",
              "| B H L E M | instance | ms |", "|---|---|---|"]
    for r in rows:
        s = r["shape"]
        for name, ms in sorted(r["chunked_bf16_ms"].items(), key=lambda kv: kv[1]):
            lines.append(f"| {s['B']} {s['H']} {s['L']} {s['E']} {s['M']} | `{name}` | {fmt(ms)} |")
    return "\n".join(lines) + "\n"


def plot(rows, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"B{r['shape']['B']}H{r['shape']['H']}\nL{r['shape']['L']}E{r['shape']['E']}" for r in rows]
    series = [("lmha fp32 (anchor)", "lmha_fwd_fp32_anchor_ms"), ("attngen fp32", "attngen_fwd_fp32_ms"),
              ("attngen bf16", "attngen_fwd_bf16_ms"), ("fla chunk fp32", "fla_chunk_fwd_fp32_ms"),
              ("fla chunk bf16", "fla_chunk_fwd_bf16_ms")]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.16
    for i, (label, key) in enumerate(series):
        ax.bar([x + i * width for x in range(len(rows))], [r.get(key) or 0 for r in rows], width, label=label)
    ax.set_xticks([x + 2 * width for x in range(len(rows))], labels, fontsize=8)
    ax.set_ylabel("forward time (ms, lower is better)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("causal linear attention forward, H100")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="skip the slow fused_recurrent peer")
    parser.add_argument("--no-variants", action="store_true",
                        help="skip forcing every built chunked variant (chunked_candidates)")
    parser.add_argument("--out", default=None, help="directory (default bench/results/<gpu>)")
    args = parser.parse_args()
    env = environment()
    gpu = "h100" if "H100" in env["device"] else env["device"].split()[-1].lower()
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / gpu
    out.mkdir(parents=True, exist_ok=True)
    rows, bwd = run(args.quick, not args.no_variants)
    (out / "causal_linear.json").write_text(json.dumps({"env": env, "forward": rows, "backward": bwd}, indent=1))
    md = markdown(env, rows, bwd)
    (out / "causal_linear.md").write_text(md)
    plot(rows, out / "causal_linear.png")
    print(md)


if __name__ == "__main__":
    main()
