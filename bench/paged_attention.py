"""Prefill over a paged KV cache (paged_attention) beside flash_attention_varlen on the same keys
and values stored contiguously (the cost of paging) and beside torch gathering the pages and
running SDPA (cuDNN, else flash) per call, in one run. H100, bf16, D128, causal, GQA 32/8, block
size 16, pages shuffled; S sequences of N query tokens each, a pure prefill (the context is the
N tokens), and a chunk of N tokens onto a cached context of 4N. TFLOP/s count the visible
(i, j) pairs: 4 * D * Hq * sum over sequences of the causal rows' keys. Decode-shaped batches
(1 to 16 query tokens per sequence) beside paged_decode, in TB/s of the cache read. An fp8 (e4m3)
copy of each cache, per-tensor scales, through dispatch (hopper_ws_fp8_cache) beside the bf16
cache through dispatch, and on the mma_sync_fp8_cache kind forced. Mixed
batches (decodes first, then prefill chunks) whole on the prefill kernels against split by
num_decodes. Writes paged_attention.json, .md and .png under --out.

  python -m bench.paged_attention [--out DIR]
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
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import run_meta  # noqa: E402
from bench.causal_linear import do_bench  # noqa: E402

import attngen  # noqa: E402

pa = importlib.import_module("attngen.paged_attention")
fa = importlib.import_module("attngen.flash_attention")

HQ, HKV, D, BLOCK = 32, 8, 128, 16
# (S sequences, N query tokens each, cached tokens before them as a multiple of N)
SHAPES = [(4, 8192, 0), (16, 2048, 0), (64, 512, 0), (16, 8192, 0), (64, 2048, 0), (4, 2048, 4), (16, 512, 4)]


def case(S, N, before, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ctx = N * (1 + before)
    pages_per = (ctx + BLOCK - 1) // BLOCK
    blocks = S * pages_per
    table = torch.randperm(blocks, generator=g, device="cuda").to(torch.int32).reshape(S, pages_per)
    k_cache = torch.randn(blocks, BLOCK, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(blocks, BLOCK, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(S * N, HQ, D, generator=g, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.arange(0, S * N + 1, N, dtype=torch.int32, device="cuda")
    lens = torch.full((S,), ctx, dtype=torch.int32, device="cuda")
    # The same keys and values, contiguous per sequence (what flash_attention_varlen reads).
    k = k_cache[table.long()].reshape(S, -1, HKV, D)[:, :ctx].reshape(-1, HKV, D).contiguous()
    v = v_cache[table.long()].reshape(S, -1, HKV, D)[:, :ctx].reshape(-1, HKV, D).contiguous()
    cu_k = torch.arange(0, S * ctx + 1, ctx, dtype=torch.int32, device="cuda")
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=table, cu_seqlens_q=cu_q, context_lens=lens,
                max_seqlen_q=N, max_context_len=ctx), (q, k, v, cu_q, cu_k, N, ctx)


def flops(S, N, ctx):
    pairs = sum(ctx - N + i + 1 for i in range(N))   # row i sees ctx - N + i + 1 keys
    return 4 * D * HQ * S * pairs


def gather_sdpa(paged, S, N, ctx):
    """torch: gather each sequence's pages, then SDPA over [S, H, ctx, D] (bottom-right causal mask)."""
    table = paged["block_table"].long()
    k = paged["k_cache"][table].reshape(S, -1, HKV, D)[:, :ctx].transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    v = paged["v_cache"][table].reshape(S, -1, HKV, D)[:, :ctx].transpose(1, 2).repeat_interleave(HQ // HKV, 1)
    q = paged["q"].reshape(S, N, HQ, D).transpose(1, 2)
    if N == ctx:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.ones(N, ctx, dtype=torch.bool, device="cuda").tril(ctx - N)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def copies_twin(instance: str):
    """The dispatched warp-specialized instance's twin that loads every tile by cp.async (tma0, a
    bench-role candidate: `python -m codegen build --bench`), to time the pages' TMA boxes against
    it; None without the benchmark extension or such a twin."""
    twin = instance.replace("_hopper_ws_", "_hopper_ws_candidates_").replace("_tma1_", "_tma0_")
    return twin if twin != instance and twin in fa.OP.bench_instances() else None


def fp8_twin(paged):
    """The case's cache in e4m3 (per-tensor scales that put it mid-range) and the scales."""
    scales = {}
    out = dict(paged)
    for name, scale_name in (("k_cache", "k_scale"), ("v_cache", "v_scale")):
        scale = paged[name].float().abs().amax() / 224.0
        out[name] = (paged[name].float() / scale).to(torch.float8_e4m3fn)
        scales[scale_name] = scale.reshape(1)
    return out, scales


def fp8_mma_sync_instance():
    """The mma.sync kind's e4m3-cache instance at D for bf16 q, or None."""
    names = [n for n in fa.instances()
             if n.startswith(f"flash_attention_mma_sync_fp8_cache_d{D}_") and n.endswith("_kv_e4_bf16_sm90a")]
    return names[0] if names else None


def measure(S, N, before) -> dict:
    paged, contiguous = case(S, N, before, seed=S + N)
    q, k, v, cu_q, cu_k, max_q, ctx = contiguous
    out = pa.paged_attention(**paged)
    want = fa.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, ctx, causal=True)
    row = {"S": S, "N": N, "context": ctx, "diff_vs_varlen": (out.float() - want.float()).abs().max().item(),
           "instance": fa.OP.select(q, paged["k_cache"], paged["v_cache"], cu_q, None, max_q, ctx, D ** -0.5,
                                    -1, 0, None, 0.0, False, paged["block_table"], paged["context_lens"])}
    work = flops(S, N, ctx)
    times = {"paged": do_bench(lambda: pa.paged_attention(**paged, validate=False)),
             "varlen": do_bench(lambda: fa.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, ctx, causal=True,
                                                                  validate=False))}
    copies = copies_twin(row["instance"])
    if copies is not None:
        row["copies_instance"] = copies
        times["copies"] = do_bench(lambda: pa.paged_attention(**paged, validate=False, instance=copies))
    fp8, scales = fp8_twin(paged)
    got = pa.paged_attention(**fp8, **scales)
    row["fp8_diff_vs_varlen"] = (got.float() - want.float()).abs().max().item()   # quantization included
    row["fp8_instance"] = fa.OP.select(q, fp8["k_cache"], fp8["v_cache"], cu_q, None, max_q, ctx, D ** -0.5, -1, 0, None,
                                       0.0, False, paged["block_table"], paged["context_lens"], None, scales["k_scale"],
                                       scales["v_scale"])
    times["fp8"] = do_bench(lambda: pa.paged_attention(**fp8, **scales, validate=False))
    mma_sync = fp8_mma_sync_instance()
    if mma_sync is not None:
        times["fp8_mma_sync"] = do_bench(lambda: pa.paged_attention(**fp8, **scales, validate=False, instance=mma_sync))
    del fp8
    try:
        times["gather_sdpa"] = do_bench(lambda: gather_sdpa(paged, S, N, ctx))
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        row["gather_sdpa_error"] = str(exc).splitlines()[0][:120]
    for name, ms in times.items():
        row[f"{name}_ms"] = ms
        row[f"{name}_tflops"] = work / ms / 1e9
    row["paged_vs_varlen"] = times["varlen"] / times["paged"]
    row["fp8_vs_bf16"] = times["paged"] / times["fp8"]
    if "copies" in times:
        row["paged_vs_copies"] = times["copies"] / times["paged"]
    if "gather_sdpa" in times:
        row["paged_vs_gather_sdpa"] = times["gather_sdpa"] / times["paged"]
    return row


# Decode-shaped batches (Q query tokens per sequence, a context of ctx): paged_attention's
# kernels beside paged_decode's, in TB/s of the cache read (K and V of every context once).
DECODE_SHAPES = [(32, 1, 3000), (32, 4, 3000), (128, 1, 1000), (4, 16, 4000)]


def measure_decode(S, Q, ctx) -> dict:
    paged, _ = case(S, ctx, 0, seed=S + Q)
    q = torch.randn(S * Q, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.arange(0, S * Q + 1, Q, dtype=torch.int32, device="cuda")
    paged.update(q=q, cu_seqlens_q=cu_q, max_seqlen_q=Q)
    out = pa.paged_attention(**paged)
    want = attngen.paged_decode(q.view(S, Q, HQ, D), paged["k_cache"], paged["v_cache"], paged["block_table"],
                                paged["context_lens"])
    cache_bytes = 2 * S * ctx * HKV * D * 2
    row = {"S": S, "Q": Q, "context": ctx, "diff_vs_decode": (out.float() - want.float().reshape(out.shape)).abs().max().item()}
    for name, fn in (("paged_attention", lambda: pa.paged_attention(**paged, validate=False)),
                     ("paged_decode", lambda: attngen.paged_decode(q.view(S, Q, HQ, D), paged["k_cache"],
                                                                   paged["v_cache"], paged["block_table"],
                                                                   paged["context_lens"]))):
        ms = do_bench(fn)
        row[f"{name}_us"] = ms * 1e3
        row[f"{name}_tbps"] = cache_bytes / ms / 1e9
    return row


# Mixed batches as a serving engine schedules them (decodes first, then prefill chunks):
# (decodes, their query tokens, their context, [(chunk tokens, context)...]). The whole batch on
# the prefill kernels against num_decodes splitting it between paged_decode and the prefill kernels.
MIXED_SHAPES = [(64, 1, 2000, [(2048, 6144)]), (128, 1, 1000, [(512, 4096)]), (32, 4, 3000, [(1024, 1024), (1024, 5120)]),
                (16, 1, 8000, [(256, 8192)])]


def mixed_case(decodes, Qd, ctx_d, chunks, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    seqs = [(Qd, ctx_d)] * decodes + chunks
    pages = [(n + BLOCK - 1) // BLOCK for _, n in seqs]
    width, blocks = max(pages), sum(pages)
    perm = torch.randperm(blocks, generator=g, device="cuda").to(torch.int32)
    table = torch.zeros(len(seqs), width, dtype=torch.int32, device="cuda")
    start = 0
    for s, p in enumerate(pages):
        table[s, :p] = perm[start:start + p]
        start += p
    k_cache = torch.randn(blocks, BLOCK, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(blocks, BLOCK, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16)
    total = sum(lq for lq, _ in seqs)
    q = torch.randn(total, HQ, D, generator=g, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0] + [sum(lq for lq, _ in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32, device="cuda")
    lens = torch.tensor([n for _, n in seqs], dtype=torch.int32, device="cuda")
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=table, cu_seqlens_q=cu, context_lens=lens,
                max_seqlen_q=max(lq for lq, _ in seqs), max_context_len=max(n for _, n in seqs))


def measure_mixed(decodes, Qd, ctx_d, chunks) -> dict:
    paged = mixed_case(decodes, Qd, ctx_d, chunks, seed=decodes)
    whole = pa.paged_attention(**paged)
    split = pa.paged_attention(**paged, num_decodes=decodes, decode_query_tokens=Qd)
    row = {"decodes": decodes, "Q": Qd, "decode_context": ctx_d, "chunks": chunks,
           "max_diff": (whole.float() - split.float()).abs().max().item()}
    row["whole_us"] = do_bench(lambda: pa.paged_attention(**paged, validate=False)) * 1e3
    row["split_us"] = do_bench(lambda: pa.paged_attention(**paged, validate=False, num_decodes=decodes,
                                                          decode_query_tokens=Qd)) * 1e3
    row["split_speedup"] = row["whole_us"] / row["split_us"]
    return row


def run():
    rows = []
    for S, N, before in SHAPES:
        rows.append(measure(S, N, before))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    decode = []
    for S, Q, ctx in DECODE_SHAPES:
        decode.append(measure_decode(S, Q, ctx))
        print(json.dumps(decode[-1]), flush=True)
    mixed = []
    for shape in MIXED_SHAPES:
        mixed.append(measure_mixed(*shape))
        print(json.dumps(mixed[-1]), flush=True)
    return rows, decode, mixed


def markdown(rows, decode, meta, mixed=()) -> str:
    lines = [f"# paged_attention (prefill over a paged KV cache) on {meta['device']}, commit {meta['commit']}", "",
             f"bf16, D{D}, Hq {HQ} / Hkv {HKV}, block size {BLOCK} (pages shuffled), causal. `varlen`: "
             "flash_attention_varlen on the same keys stored contiguously; `gather+SDPA`: torch gathers the pages "
             "and runs SDPA. TFLOP/s over the visible (query, key) pairs. `python -m bench.paged_attention`.", "",
             "| S | query tokens | context | paged TFLOP/s | varlen TFLOP/s | paged / varlen | gather+SDPA TFLOP/s "
             "| paged vs gather+SDPA | pages by cp.async TFLOP/s | TMA boxes vs cp.async | max diff vs varlen |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sdpa = f"{r['gather_sdpa_tflops']:.0f}" if "gather_sdpa_tflops" in r else r.get("gather_sdpa_error", "-")
        vs = f"{r['paged_vs_gather_sdpa']:.2f}x" if "paged_vs_gather_sdpa" in r else "-"
        copies = f"{r['copies_tflops']:.0f} | {r['paged_vs_copies']:.2f}x" if "copies_tflops" in r else "- | -"
        lines.append(f"| {r['S']} | {r['N']} | {r['context']} | {r['paged_tflops']:.0f} | {r['varlen_tflops']:.0f} | "
                     f"{r['paged_vs_varlen']:.3f}x | {sdpa} | {vs} | {copies} | {r['diff_vs_varlen']:.2e} |")
    lines += ["", f"Instance: `{rows[0]['instance']}`." if rows else ""]
    if rows and "copies_instance" in rows[0]:
        lines += ["", f"Pages by cp.async: `{rows[0]['copies_instance']}` (the same schedule, every tile copied by "
                  "the producer's threads: what the paged path did before the pages' TMA boxes)."]
    if rows and "fp8_tflops" in rows[0]:
        lines += ["", f"An fp8 cache (e4m3, per-tensor scales) through dispatch (`{rows[0]['fp8_instance']}`), beside the "
                  "bf16 cache through dispatch and the fp8 cache on the mma.sync kind forced; the max diff (against "
                  "varlen on the bf16 rows) includes the cache's quantization.", "",
                  "| S | query tokens | context | fp8 cache TFLOP/s | bf16 cache TFLOP/s | fp8 / bf16 | "
                  "fp8 on mma_sync_fp8_cache TFLOP/s | max diff vs varlen |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ms = f"{r['fp8_mma_sync_tflops']:.0f}" if "fp8_mma_sync_tflops" in r else "-"
            lines.append(f"| {r['S']} | {r['N']} | {r['context']} | {r['fp8_tflops']:.0f} | {r['paged_tflops']:.0f} | "
                         f"{r['fp8_vs_bf16']:.2f}x | {ms} | {r['fp8_diff_vs_varlen']:.2e} |")
    if decode:
        lines += ["", "Decode-shaped batches (Q query tokens per sequence): the cache read (K and V of every "
                  "context once) per second, paged_attention's prefill kernels beside paged_decode's.", "",
                  "| S | Q | context | paged_attention us | TB/s | paged_decode us | TB/s | max diff |", "|---|---|---|---|---|---|---|---|"]
        for r in decode:
            lines.append(f"| {r['S']} | {r['Q']} | {r['context']} | {r['paged_attention_us']:.1f} | "
                         f"{r['paged_attention_tbps']:.2f} | {r['paged_decode_us']:.1f} | {r['paged_decode_tbps']:.2f} | "
                         f"{r['diff_vs_decode']:.2e} |")
    if mixed:
        lines += ["", "Mixed batches, decodes first (as engines order them): the whole batch on the prefill kernels "
                  "against `num_decodes` splitting it, the decodes on paged_decode's kinds and the chunks on the prefill "
                  "kernels (two launches).", "",
                  "| decodes x Q | decode context | prefill chunks (tokens / context) | whole us | split us | speedup | "
                  "max diff |", "|---|---|---|---|---|---|---|"]
        for r in mixed:
            chunks = ", ".join(f"{n} / {c}" for n, c in r["chunks"])
            lines.append(f"| {r['decodes']} x {r['Q']} | {r['decode_context']} | {chunks} | {r['whole_us']:.1f} | "
                         f"{r['split_us']:.1f} | {r['split_speedup']:.2f}x | {r['max_diff']:.2e} |")
    return "\n".join(lines) + "\n"


def plot(rows, path) -> bool:
    """Prefill TFLOP/s per shape: paged, varlen on contiguous rows, torch gather + SDPA."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{r['S']} x {r['N']}\nctx {r['context']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.27
    for i, (key, name) in enumerate((("paged", "paged_attention"), ("varlen", "flash_attention_varlen (contiguous)"),
                                     ("gather_sdpa", "gather + SDPA"))):
        ax.bar([x + (i - 1) * width for x in range(len(rows))], [r.get(f"{key}_tflops", 0) for r in rows], width, label=name)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("TFLOP/s (visible pairs)")
    ax.set_title("Prefill over a paged cache, bf16 D128, Hq 32 / Hkv 8, causal")
    ax.set_ylim(0, 1.3 * max(r.get("varlen_tflops", 0) for r in rows))
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    ap.add_argument("--plot-only", action="store_true", help="redraw paged_attention.png from --out's JSON")
    args = ap.parse_args()
    if args.plot_only:
        out = Path(args.out)
        plot(json.loads((out / "paged_attention.json").read_text())["rows"], out / "paged_attention.png")
        return
    t0 = time.time()
    rows, decode, mixed = run()
    meta = run_meta(t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paged_attention.json").write_text(json.dumps({"meta": meta, "rows": rows, "decode": decode, "mixed": mixed},
                                                         indent=1) + "\n")
    (out / "paged_attention.md").write_text(markdown(rows, decode, meta, mixed))
    plot(rows, out / "paged_attention.png")
    print((out / "paged_attention.md").read_text())


if __name__ == "__main__":
    main()
