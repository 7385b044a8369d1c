"""FP8 flash attention forward (float8_e4m3fn q, k, v with per-(batch, kv head) descales, bf16
output) beside the bf16 forward of attngen and of torch SDPA's flash and cuDNN backends in one run
(SDPA has no fp8 attention), on the D64 / D128 softmax shapes of ../shared/ANCHORS.md, causal and
not. The fp8 time is the whole op: it includes making V^T (forward_ws.cu's values_t_kernel), whose
share the profiler reports beside it. Accuracy: the largest and the RMS error against float64 attention over the
same (dequantized) inputs on a slice of each shape small enough for a float64 reference, for fp8
and for bf16 (the same values rounded to bf16). TFLOP/s count 4 * B * H * N^2 * D (half when
causal). Writes flash_attention_fp8.json and .md under --out.

  python -m bench.flash_attention_fp8 [--out DIR]
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import run_meta  # noqa: E402
from bench.causal_linear import do_bench  # noqa: E402
from bench.flash_attention import PEERS, flops, geomean, sdpa  # noqa: E402

fa = importlib.import_module("attngen.flash_attention")
reference = importlib.import_module("attngen.reference")

# B, H, N, D: the D64 and D128 softmax shapes of ANCHORS.md, D128 at N 8192, and D256
SHAPES = [(4, 48, 1024, 64), (4, 48, 4096, 64), (1, 48, 16384, 64),
          (4, 24, 1024, 128), (4, 24, 4096, 128), (2, 24, 8192, 128), (1, 24, 16384, 128),
          (2, 16, 4096, 256), (1, 16, 16384, 256)]   # issue 32's d256 shape, and a long one
E4M3 = torch.float8_e4m3fn


def quantized(x):
    """x [B, N, H, D] -> (e4m3 x / descale, descale [B, H]): one factor per (batch, head)."""
    descale = (x.abs().amax(dim=(1, 3)) / 448.0).float()
    return (x / descale[:, None, :, None]).to(E4M3), descale


def errors(out, ref):
    e = (out.double() - ref).abs()
    return e.max().item(), e.pow(2).mean().sqrt().item()


def accuracy(x8, descales, N, D, causal):
    """fp8 and bf16 errors against float64 on batch 0, heads 0-1, the first min(N, 4096) rows."""
    n = min(N, 4096)
    part = [t[:1, :n, :2] for t in x8]
    scales = [f[:1, :2].contiguous() for f in descales]
    exact = [reference.dequantize(t, f) for t, f in zip(part, scales)]
    ref, _ = reference.flash_attention(*exact, causal=causal)
    out8 = fa.flash_attention(*part, causal=causal, q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
    out16 = fa.flash_attention(*(t.to(torch.bfloat16) for t in exact), causal=causal)
    return {"fp8": errors(out8, ref), "bf16": errors(out16, ref), "rows": n}


def kernel_times(fn, calls=5) -> dict:
    """Device time per call of each kernel fn launches (the profiler's CUDA activity), by short name."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():   # the kernels by their symbols' names (the op's own entry sums them)
        for short, symbol in (("values_t", "values_t_kernel"), ("forward", "forward_kernel")):
            if symbol in e.key:
                times[short] = times.get(short, 0.0) + e.self_device_time_total / 1e3 / calls
    return times


def fp8_instances(D: int) -> list:
    """The fp8 instances of head size D: shipped, and bench-role ones where `codegen build --bench` made them."""
    names = fa.instances() + fa.OP.bench_instances()
    return sorted(n for n in names if "_e4m3_" in n and fa.instance_head_size(n) == D)


def run():
    rows = []
    for B, H, N, D in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(N + D)
        x = [torch.randn(B, N, H, D, device="cuda", generator=g) for _ in range(3)]
        x8, descales = zip(*(quantized(t) for t in x))
        x16 = [t.to(torch.bfloat16) for t in x]
        x = None
        for causal in (False, True):
            work = flops(B, H, N, D, causal)
            row = {"B": B, "H": H, "N": N, "D": D, "causal": causal, "flop": work,
                   "instance_fp8": fa.selected_instance(*x8), "instance_bf16": fa.selected_instance(*x16)}
            kw = dict(q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
            row["fp8_ms"] = do_bench(lambda: fa.flash_attention(*x8, causal=causal, **kw))
            row["kernels_ms"] = kernel_times(lambda: fa.flash_attention(*x8, causal=causal, **kw))
            row["forced"] = {n: do_bench(lambda: fa.flash_attention(*x8, causal=causal, instance=n, **kw))
                             for n in fp8_instances(D)}
            mine = fa.flash_attention(*x8, causal=causal, **kw).float()
            row["forced_rel_diff"] = {n: ((fa.flash_attention(*x8, causal=causal, instance=n, **kw).float() - mine).norm()
                                          / mine.norm()).item() for n in row["forced"]}
            row["bf16_ms"] = do_bench(lambda: fa.flash_attention(*x16, causal=causal))
            for peer, backend in PEERS.items():
                try:
                    row[f"{peer}_ms"] = do_bench(lambda: sdpa(backend, *x16, causal))
                except RuntimeError as exc:
                    row[f"{peer}_error"] = str(exc).splitlines()[0]
            for key in ("fp8", "bf16", *PEERS):
                if f"{key}_ms" in row:
                    row[f"{key}_tflops"] = work / row[f"{key}_ms"] / 1e9
            row["accuracy"] = accuracy(x8, descales, N, D, causal)
            rows.append(row)
            print(json.dumps(row), flush=True)
        x8 = x16 = None
        torch.cuda.empty_cache()
    return rows


def markdown(rows, meta) -> str:
    f = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
    out = [f"# Flash attention forward, FP8 e4m3 ({meta['device']}, torch {meta['torch']}, commit {meta['commit']})", "",
           "q, k, v float8_e4m3fn with per-(batch, head) descales, bf16 output; beside the bf16 forward (attngen, "
           "SDPA flash, SDPA cuDNN) on the same values. TFLOP/s = 4 B H N^2 D / time (half when causal); the fp8 "
           "time includes making V^T; median of triton do_bench; every column from this "
           "run; the fp8 op's two kernels' device times from the profiler. `python -m bench.flash_attention_fp8`.", "",
           "| B H N D | causal | fp8 attngen | bf16 attngen | bf16 SDPA flash | bf16 SDPA cuDNN | fp8 / bf16 attngen | "
           "fp8 / cuDNN | kernels ms: V^T / attention | max err fp8 / bf16 | rms err fp8 / bf16 |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r["accuracy"]
        cudnn = r.get("sdpa_cudnn_tflops")
        vs_cudnn = f"{r['fp8_tflops'] / cudnn:.2f}x" if cudnn else "-"
        out.append(f"| {r['B']} {r['H']} {r['N']} {r['D']} | {'yes' if r['causal'] else 'no'} | **{f(r['fp8_tflops'])}** | "
                   f"{f(r['bf16_tflops'])} | {f(r.get('sdpa_flash_tflops'))} | {f(cudnn)} | "
                   f"{r['fp8_tflops'] / r['bf16_tflops']:.2f}x | {vs_cudnn} | "
                   f"{r['kernels_ms'].get('values_t', 0):.3f} / {r['kernels_ms'].get('forward', 0):.3f} | "
                   f"{a['fp8'][0]:.1e} / {a['bf16'][0]:.1e} | "
                   f"{a['fp8'][1]:.1e} / {a['bf16'][1]:.1e} |")
    out += ["", f"Geometric mean: fp8 {geomean([r['fp8_tflops'] / r['bf16_tflops'] for r in rows]):.2f}x attngen's bf16, "
            f"{geomean([r['fp8_tflops'] / r['sdpa_cudnn_tflops'] for r in rows if 'sdpa_cudnn_tflops' in r]):.2f}x "
            "SDPA cuDNN's bf16.", "",
            "Errors: against float64 attention over the dequantized inputs, on batch 0, heads 0-1 and the first "
            "min(N, 4096) query and key rows of each shape; bf16 is the same values rounded to bf16 through "
            "attngen's bf16 forward.", "",
            "Instances: " + ", ".join(sorted({f"`{r['instance_fp8']}`" for r in rows}))]
    if any(len(r.get("forced", {})) > 1 for r in rows):
        out += ["", "## Every fp8 instance forced (TFLOP/s, the whole op; its output's relative difference from the "
                "dispatched instance's)", ""]
        for r in rows:
            diff = r.get("forced_rel_diff", {})
            cells = ", ".join(f"`{n.replace('flash_attention_', '').replace('_e4m3_sm90a', '')}` {r['flop'] / ms / 1e9:.0f}"
                              + (f" (rel diff {diff[n]:.1e})" if n in diff else "")
                              for n, ms in sorted(r["forced"].items(), key=lambda x: x[1]))
            out.append(f"- {r['B']} {r['H']} {r['N']} {r['D']} {'causal' if r['causal'] else 'full'}: {cells}")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    args = ap.parse_args()
    t0 = time.time()
    rows = run()
    meta = run_meta(t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flash_attention_fp8.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / "flash_attention_fp8.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
