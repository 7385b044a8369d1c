"""Paged decode beside torch (gather the pages, then SDPA) and a device copy, in one run, on
the shapes of issue 5 and ../shared/ANCHORS.md, and on issue 14's table (every group size G in
1-8 and 16 at 64 sequences, contexts 1024 and 4096; 8 sequences at 32768; Q = 4 query tokens
against Q = 1): bf16, D 128, 16-token pages behind a shuffled block table. Effective
bandwidth = bytes of K and V inside the contexts / time, each byte counted once; the copy's
(read + write) bandwidth is the ceiling. Also times each kernel kind forced, which is what the
spec's dispatch rule rests on. Writes paged.json and paged.md under --out.

  python -m bench.paged [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from attngen import paged  # noqa: E402
from bench import run_meta  # noqa: E402
from bench.causal_linear import do_bench  # noqa: E402
from codegen import dispatch, pipeline  # noqa: E402

BLOCK = 16
D = 128
# name, S, Hq, Hkv, context lengths ("uniform" draws U(1..8192) per sequence), target TB/s (issue 5),
# ANCHORS.md's torch gather + SDPA time (ms)
CASES = [
    ("64 seqs Hq32 Hkv8 ctx 4096", 64, 32, 8, 4096, 2.2, 1.120),
    ("256 seqs Hq32 Hkv8 ctx 2048", 256, 32, 8, 2048, None, 2.222),
    ("8 seqs Hq32 Hkv32 ctx 32768", 8, 32, 32, 32768, 2.0, 4.412),
    ("64 seqs Hq32 Hkv8 ctx U(1..8192)", 64, 32, 8, "uniform", 1.6, None),
]
KINDS = ("single_pass", "split_k", "grouped_mma")
# Issue 14: (G, Hkv, sequences, context, target TB/s); Q = 4 against Q = 1 at the shapes below.
GROUP_CASES = ([(G, 4 if G == 16 else 8, 64, ctx, 2.0) for ctx in (1024, 4096) for G in (1, 2, 3, 4, 5, 6, 7, 8, 16)]
               + [(G, 8, 8, 32768, 2.5) for G in (1, 4, 8)])
QUERY_CASES = [(G, 8, 64, 4096) for G in (1, 4, 8)]
FP8_CASES = [(G, 8, 64, 4096) for G in (1, 4, 8)]      # issue 14: fp8 at G 8 <= 0.6x the bf16 time


def make_case(S, Hq, Hkv, lens, dtype=torch.bfloat16, seed=0, Q=None):
    g = torch.Generator().manual_seed(seed)
    if lens == "uniform":
        lens = torch.randint(1, 8193, (S,), generator=g).tolist()
    else:
        lens = [lens] * S
    blocks = [(n + BLOCK - 1) // BLOCK for n in lens]
    max_blocks = max(blocks)
    order = torch.randperm(sum(blocks), generator=g)
    bt = torch.zeros(S, max_blocks, dtype=torch.int32)
    at = 0
    for s, nb in enumerate(blocks):
        bt[s, :nb] = order[at: at + nb].to(torch.int32)
        at += nb
    k = torch.randn(sum(blocks), BLOCK, Hkv, D, dtype=dtype, device="cuda")
    v = torch.randn(sum(blocks), BLOCK, Hkv, D, dtype=dtype, device="cuda")
    q = torch.randn(S, Hq, D, dtype=dtype, device="cuda") if Q is None else torch.randn(S, Q, Hq, D, dtype=dtype,
                                                                                        device="cuda")
    return q, k, v, bt.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


def kv_bytes(k, lens) -> int:
    return int(lens.sum()) * k.shape[2] * k.shape[3] * k.element_size() * 2


def torch_gather_sdpa(q, k_cache, v_cache, bt, lens):
    """The peer: gather each sequence's pages into a dense [S, L, Hkv, D], mask, SDPA (GQA)."""
    S = q.shape[0]
    k = k_cache[bt].flatten(1, 2).transpose(1, 2)     # [S, Hkv, L, D]
    v = v_cache[bt].flatten(1, 2).transpose(1, 2)
    mask = torch.arange(k.shape[2], device=q.device) < lens[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None, :], enable_gqa=True)
    return out.view(S, q.shape[1], q.shape[2])


def copy_tbps(nbytes=2 * 2**30) -> float:
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x))
    return 2 * nbytes / ms / 1e9


_SPEC = None


def forced(case, kind):
    """The instance of `kind` the spec's covers rule takes for this case (codegen/dispatch.py),
    and a call through it."""
    global _SPEC
    if _SPEC is None:
        _SPEC = [x for x in pipeline.lower(pipeline.expand(pipeline.load())) if x[0].family == "paged"][0]
    spec, insts = _SPEC
    q, k, v, bt, lens = case
    Q = 1 if q.dim() == 3 else q.shape[1]
    runtime = {"D": D, "G": q.shape[-2] // k.shape[2], "S": q.shape[0], "Q": Q, "KVE": 0, "Hq": q.shape[-2], "Hkv": k.shape[2],
               "L": bt.shape[1] * BLOCK, "align": 8, "sm_count": torch.cuda.get_device_properties(0).multi_processor_count}
    best = dispatch.first_covering(spec, insts, kind, runtime, {"dtype": "bf16"}).name
    return best, lambda: paged.paged_decode_with(best, q, k, v, bt, lens)


def run(quick: bool):
    rows = []
    copy = copy_tbps()
    print(f"copy: {copy:.3f} TB/s", flush=True)
    for name, S, Hq, Hkv, lens, target, anchor in CASES:
        case = make_case(S, Hq, Hkv, lens)
        q, k, v, bt, cl = case
        nbytes = kv_bytes(k, cl)
        row = {"case": name, "S": S, "Hq": Hq, "Hkv": Hkv, "D": D, "block_size": BLOCK, "dtype": "bf16",
               "context_tokens": int(cl.sum()), "kv_bytes": nbytes, "target_tbps": target, "anchor_torch_ms": anchor,
               "instance": paged.selected_instance(q, k, v, bt, cl)}
        out = attngen.paged_decode(*case)
        want = torch_gather_sdpa(*case)
        row["rel_diff_vs_torch"] = ((out.float() - want.float()).norm() / want.float().norm()).item()
        row["attngen_ms"] = do_bench(lambda: attngen.paged_decode(*case))
        for kind in KINDS:
            inst, fn = forced(case, kind)
            row[f"{kind}_ms"] = do_bench(fn)
            row[f"{kind}_instance"] = inst
        row["candidates_tbps"] = {short(name): nbytes / do_bench(lambda: paged.paged_decode_with(name, *case)) / 1e9
                                  for name in candidates()}
        if not (quick and S * max(cl.tolist()) > 2**20):     # the gather of 8 x 32768 tokens is slow
            row["torch_ms"] = do_bench(lambda: torch_gather_sdpa(*case))
        for key in ("attngen", *KINDS, "torch"):
            if f"{key}_ms" in row:
                row[f"{key}_tbps"] = nbytes / row[f"{key}_ms"] / 1e9
        row["fraction_of_copy"] = row["attngen_tbps"] / copy
        rows.append(row)
        print(json.dumps(row), flush=True)
        case = q = k = v = out = want = None  # free the cache before the next case
        torch.cuda.empty_cache()
    return copy, rows


def group_table(quick: bool) -> list:
    """Issue 14's table: dispatched and forced kinds per group size, one row per shape."""
    rows = []
    for G, Hkv, S, ctx, target in GROUP_CASES:
        case = make_case(S, G * Hkv, Hkv, ctx, seed=G)
        nbytes = kv_bytes(case[1], case[4])
        row = {"G": G, "Hq": G * Hkv, "Hkv": Hkv, "S": S, "context": ctx, "target_tbps": target,
               "instance": paged.selected_instance(*case), "attngen_ms": do_bench(lambda: attngen.paged_decode(*case))}
        for kind in KINDS:
            row[f"{kind}_ms"] = do_bench(forced(case, kind)[1])
        row["candidates_tbps"] = {short(name): nbytes / do_bench(lambda: paged.paged_decode_with(name, *case)) / 1e9
                                  for name in candidates()}
        if not quick and S * ctx <= 2**18:
            row["torch_ms"] = do_bench(lambda: torch_gather_sdpa(*case))
        for key in ("attngen", *KINDS, "torch"):
            if f"{key}_ms" in row:
                row[f"{key}_tbps"] = nbytes / row[f"{key}_ms"] / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
        case = None
        torch.cuda.empty_cache()
    return rows


def candidates(kv_e: int = 0) -> list:
    """The bench-role grouped_mma_candidates instances (other stages and split targets, never dispatched;
    the benchmark extension: `python -m codegen build --bench`)
    reading a cache in q's dtype (kv_e 0) or fp8 e4m3 (kv_e 4)."""
    return [n for n in paged.OP.bench_instances() if f"_kv_e{kv_e}_" in n and n.endswith("_bf16_sm90a")]


def short(name: str) -> str:
    """warps4_tile64_stages3_waves2_fill90_unsplit0_part256_rows4_pdl1 out of a grouped_mma instance name."""
    return "_".join(part for part in name.split("_")
                    if part.startswith(("warps", "tile", "stages", "waves", "fill", "unsplit", "part", "rows", "pdl")))


def query_table() -> list:
    """Q = 4 query tokens against Q = 1 at one shape (the same cache), dispatched."""
    rows = []
    for G, Hkv, S, ctx in QUERY_CASES:
        one = make_case(S, G * Hkv, Hkv, ctx, seed=G)
        four = (torch.randn(S, 4, G * Hkv, D, dtype=torch.bfloat16, device="cuda"), *one[1:])
        row = {"G": G, "Hkv": Hkv, "S": S, "context": ctx, "q1_ms": do_bench(lambda: attngen.paged_decode(*one)),
               "q4_ms": do_bench(lambda: attngen.paged_decode(*four)), "q4_instance": paged.selected_instance(*four)}
        row["ratio"] = row["q4_ms"] / row["q1_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        one = four = None
        torch.cuda.empty_cache()
    return rows


def fp8_table() -> list:
    """The same shapes with the cache in bf16 and in fp8 (e4m3, e5m2; per-kv-head scales),
    dispatched, in one run."""
    rows = []
    for G, Hkv, S, ctx in FP8_CASES:
        case = make_case(S, G * Hkv, Hkv, ctx, seed=G)
        q, k, v, bt, cl = case
        scale = torch.full((Hkv,), 0.05, device="cuda")
        row = {"G": G, "Hkv": Hkv, "S": S, "context": ctx, "bf16_ms": do_bench(lambda: attngen.paged_decode(*case))}
        for name, dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
            k8, v8 = (x.float().div_(0.05).to(dt) for x in (k, v))
            args = (q, k8, v8, bt, cl)
            row[f"{name}_ms"] = do_bench(lambda: attngen.paged_decode(*args, k_scale=scale, v_scale=scale))
            row[f"{name}_ratio"] = row[f"{name}_ms"] / row["bf16_ms"]
            row[f"{name}_instance"] = paged.selected_instance(*args)
            row[f"{name}_tbps"] = kv_bytes(k8, cl) / row[f"{name}_ms"] / 1e9
            if name == "e4m3":
                row["e4m3_candidates_ms"] = {
                    short(n): do_bench(lambda: paged.paged_decode_with(n, *args, k_scale=scale, v_scale=scale))
                    for n in candidates(4)}
            k8 = v8 = args = None
        rows.append(row)
        print(json.dumps(row), flush=True)
        case = q = k = v = None
        torch.cuda.empty_cache()
    return rows


def markdown(copy, rows, meta, groups=(), queries=(), fp8=()) -> str:
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    out = [f"# Paged decode, bf16, D {D}, block {BLOCK}, shuffled pages ({meta['device']}, torch {meta['torch']}, "
           f"commit {meta['commit']})", "",
           f"Copy bandwidth in this run (read + write of 2 GiB): **{copy:.3f} TB/s** (the ceiling).", "",
           "Effective bandwidth = bytes of K and V inside the contexts / time (TB/s); times in ms, "
           "median of triton do_bench, same run for every column:", "",
           "| case | attngen | target | ms | single_pass forced | split_k forced | grouped_mma forced | "
           "torch gather + SDPA | ANCHORS torch ms | attngen / copy | instance |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        torch_cell = f"{f(r.get('torch_tbps'))} ({f(r.get('torch_ms'))} ms)" if "torch_ms" in r else "-"
        out.append(f"| {r['case']} | **{f(r['attngen_tbps'])}** | {'>= ' + str(r['target_tbps']) if r['target_tbps'] else '-'} | "
                   f"{f(r['attngen_ms'])} | {f(r['single_pass_tbps'])} | {f(r['split_k_tbps'])} | "
                   f"{f(r['grouped_mma_tbps'])} | {torch_cell} | "
                   f"{f(r['anchor_torch_ms'])} | {r['fraction_of_copy']:.0%} | `{r['instance']}` |")
    out += ["", "rel. difference attngen vs torch (bf16 outputs): "
            + ", ".join(f"{r['rel_diff_vs_torch']:.1e}" for r in rows)]
    if groups:
        out += ["", "## Every group size (issue 14): TB/s of K and V, each byte counted once", "",
                "| G | Hq/Hkv | seqs | context | attngen | target | " + " | ".join(f"{k} forced" for k in KINDS)
                + " | best grouped_mma candidate | torch gather + SDPA | instance |", "|---" * (8 + len(KINDS)) + "|"]
        for r in groups:
            best = max(r["candidates_tbps"].items(), key=lambda kv: kv[1], default=("-", None))
            out.append(f"| {r['G']} | {r['Hq']}/{r['Hkv']} | {r['S']} | {r['context']} | **{f(r['attngen_tbps'])}** | "
                       f">= {r['target_tbps']} | " + " | ".join(f(r[f'{k}_tbps']) for k in KINDS)
                       + f" | {f(best[1])} ({best[0]}) | {f(r.get('torch_tbps'))} | `{r['instance']}` |")
        names = sorted({n for r in groups + rows for n in r["candidates_tbps"]})
        if names:
            out += ["", "grouped_mma candidates forced (TB/s; the default is warps4_tile64_stages2_waves1_fill90_rows1_pdl1):", "",
                    "| case | " + " | ".join(names) + " |", "|---" + "|---" * len(names) + "|"]
            for r in rows + groups:
                label = r["case"] if "case" in r else f"G {r['G']}, {r['S']} seqs, context {r['context']}"
                out.append(f"| {label} | " + " | ".join(f(r["candidates_tbps"].get(n)) for n in names) + " |")
    if queries:
        out += ["", "## Q = 4 query tokens against Q = 1 (same cache, dispatched; target ratio <= 1.3)", "",
                "| G | Hkv | seqs | context | Q=1 ms | Q=4 ms | ratio | Q=4 instance |", "|---|---|---|---|---|---|---|---|"]
        for r in queries:
            out.append(f"| {r['G']} | {r['Hkv']} | {r['S']} | {r['context']} | {f(r['q1_ms'])} | {f(r['q4_ms'])} | "
                       f"**{r['ratio']:.2f}** | `{r['q4_instance']}` |")
    if fp8:
        out += ["", "## fp8 cache against bf16 (same shapes, dispatched, per-kv-head scales; target e4m3 / bf16 <= 0.6 at G 8)",
                "", "| G | Hkv | seqs | context | bf16 ms | e4m3 ms | e4m3 / bf16 | e4m3 TB/s (fp8 bytes) | e5m2 ms | "
                "e5m2 / bf16 | instance |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in fp8:
            out.append(f"| {r['G']} | {r['Hkv']} | {r['S']} | {r['context']} | {f(r['bf16_ms'])} | {f(r['e4m3_ms'])} | "
                       f"**{r['e4m3_ratio']:.2f}** | {f(r['e4m3_tbps'])} | {f(r['e5m2_ms'])} | {r['e5m2_ratio']:.2f} | "
                       f"`{r['e4m3_instance']}` |")
        out += ["", "e4m3 candidates forced (ms; the default is warps4_tile128_stages3_waves1_fill90_rows1_pdl1): " + "; ".join(
            f"G {r['G']}: " + ", ".join(f"{k} {v:.3f}" for k, v in r["e4m3_candidates_ms"].items()) for r in fp8)]
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the torch peer on the 8 x 32768 case")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    args = ap.parse_args()
    t0 = time.time()
    copy, rows = run(args.quick)
    groups, queries, fp8 = group_table(args.quick), query_table(), fp8_table()
    meta = run_meta(t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paged.json").write_text(json.dumps({"meta": meta, "copy_tbps": copy, "rows": rows, "groups": groups,
                                                "queries": queries, "fp8": fp8}, indent=1) + "\n")
    (out / "paged.md").write_text(markdown(copy, rows, meta, groups, queries, fp8))
    print((out / "paged.md").read_text())


if __name__ == "__main__":
    main()
