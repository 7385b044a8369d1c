"""Where a training step through flash attention spends its time off the GPU: the host time of
the forward, the backward and the whole step (forward, then autograd.grad) on a small shape
where the GPU waits for the host, beside SDPA's flash and cuDNN backends; at the benchmark's
small rows, the step's wall time against the GPU time of its kernels (torch profiler), the
kernels it launches and the CUDA runtime calls it makes; and a cProfile and an op profile of attngen's step.

  python -m bench.flash_grad_host [--out DIR]      # writes flash_grad_host.json / .md / _profile.txt
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import host_us, run_meta  # noqa: E402
from bench.flash_attention import PEERS  # noqa: E402
from bench.flash_attention_grad import sdpa  # noqa: E402

fa = importlib.import_module("attngen.flash_attention")

TINY = (1, 8, 128, 64)                                  # B, H, N, D: microseconds of GPU work
ROWS = [(4, 48, 1024, 64), (4, 24, 1024, 128)]          # the backward bench's smallest rows
STEPS = 20


def implementations(causal: bool) -> dict:
    impls = {"attngen": lambda q, k, v: fa.flash_attention(q, k, v, causal=causal)}
    impls.update({peer: (lambda q, k, v, b=backend: sdpa(b, q, k, v, causal)) for peer, backend in PEERS.items()})
    return impls


def tensors(B, H, N, D):
    g = torch.Generator(device="cuda").manual_seed(N + D)
    q, k, v, d_out = (torch.randn(B, N, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], d_out


def host_layers(fwd, leaves, d_out) -> dict:
    """Host us per call of the forward without autograd, the forward recording the graph, the
    backward alone (retain_graph) and the whole step."""
    plain = [t.detach() for t in leaves]
    out = fwd(*leaves)
    return {"forward, no grad": host_us(lambda: fwd(*plain)),
            "forward, recording": host_us(lambda: fwd(*leaves)),
            "backward (autograd.grad)": host_us(lambda: torch.autograd.grad(out, leaves, d_out, retain_graph=True)),
            "step (forward + backward)": host_us(lambda: torch.autograd.grad(fwd(*leaves), leaves, d_out))}


def step_profile(fwd, leaves, d_out) -> dict:
    """Over STEPS steps issued back to back: wall us per step (host clock, one sync at the end),
    GPU us per step (the kernels' device time), the kernels and the runtime calls per step."""
    def step():
        return torch.autograd.grad(fwd(*leaves), leaves, d_out)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / STEPS * 1e6
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    kernels, runtime = {}, {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key[:90]] = (e.self_device_time_total / STEPS, e.count / STEPS)
        elif e.key.startswith("cuda") and e.key != "cudaDeviceSynchronize":
            runtime[e.key] = (e.cpu_time_total / STEPS, e.count / STEPS)
    return {"wall_us": wall, "gpu_us": sum(t for t, _ in kernels.values()),
            "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1][0])),
            "runtime": dict(sorted(runtime.items(), key=lambda kv: -kv[1][0]))}


def python_profile(fwd, leaves, d_out, steps: int = 200) -> str:
    """cProfile of attngen's step (the Python functions on the path by their own time), then torch
    profiler's ops of the step by their own host time (the C++ side: allocations, fills, launches)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        torch.autograd.grad(fwd(*leaves), leaves, d_out)
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(50):
            torch.autograd.grad(fwd(*leaves), leaves, d_out)
        torch.cuda.synchronize()
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    return (f"cProfile of {steps} attngen training steps, B H N D {TINY} causal, bf16\n" + text.getvalue() +
            "\ntorch profiler of 50 steps, ops by their own host time\n" + ops)


def markdown(meta, host, rows) -> str:
    impls = list(host)
    md = [f"# Host time of a training step through flash attention ({meta['device']})", "",
          f"commit {meta['commit']}, torch {meta['torch']}; bf16, causal.", "",
          f"Host us per call at B H N D {TINY} (GPU work of microseconds): median over rounds of 20 calls issued "
          "back to back between synchronizations.", "",
          "| layer | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
    md += [f"| {layer} | " + " | ".join(f"{host[i][layer]:.0f}" for i in impls) + " |" for layer in host[impls[0]]]
    md += ["", f"A step (forward, then autograd.grad) at the benchmark's smallest rows, {STEPS} steps back to back: wall us "
           "per step (host clock) and the device time of its kernels (torch profiler).", "",
           "| B H N D | " + " | ".join(f"{i} wall / GPU" for i in impls) + " |", "|---|" + "---|" * len(impls)]
    for r in rows:
        md.append(f"| {' '.join(map(str, r['shape']))} | " + " | ".join(
            f"{r[i]['wall_us']:.0f} / {r[i]['gpu_us']:.0f}" for i in impls) + " |")
    for i in impls:
        md += ["", f"{i}, B H N D {' '.join(map(str, rows[0]['shape']))}: kernels (GPU us per step; launches per step) and "
               "CUDA runtime calls (host us per step; calls per step):", ""]
        md += [f"- `{k}` {t:.1f} ({n:g})" for k, (t, n) in rows[0][i]["kernels"].items()]
        md += [f"- {k} {t:.1f} ({n:g})" for k, (t, n) in rows[0][i]["runtime"].items()]
    return "\n".join(md) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    args = ap.parse_args()
    t0 = time.time()
    impls = implementations(causal=True)
    leaves, d_out = tensors(*TINY)
    host = {name: host_layers(fwd, leaves, d_out) for name, fwd in impls.items()}
    print(json.dumps(host), flush=True)
    rows = []
    for shape in ROWS:
        leaves, d_out = tensors(*shape)
        rows.append({"shape": shape, **{name: step_profile(fwd, leaves, d_out) for name, fwd in impls.items()}})
        print(json.dumps({n: (r["wall_us"], r["gpu_us"]) for n, r in rows[-1].items() if n != "shape"}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    leaves, d_out = tensors(*TINY)
    (out / "flash_grad_host_profile.txt").write_text(python_profile(impls["attngen"], leaves, d_out))
    meta = run_meta(t0)
    (out / "flash_grad_host.json").write_text(json.dumps({"meta": meta, "host_us": host, "rows": rows}, indent=1) + "\n")
    md = markdown(meta, host, rows)
    (out / "flash_grad_host.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
