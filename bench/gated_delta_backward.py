"""Gated DeltaNet's backward, bf16: its three paths side by side, the tensor-core op
(gated_delta_grad, what 16-bit inputs run), the chunked backward in torch
(attngen/gated_delta_chunked_grad.py) and the recurrent kernel on RWKV-7's tied vectors (the
last two what fp32 runs, either side of delta_rule.use_chunked_backward), over T at B8 H16 K=V=128 and on the issue's shapes; where
the chunked backward's time goes (its three stages, and torch.profiler's kernels); its peak
memory. Forward + backward as bench.delta_rule times it (state in and out, every input and the
initial state differentiable).

  python -m bench.gated_delta_backward [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from attngen import delta_rule  # noqa: E402
from attngen import gated_delta_chunked_grad as chunked  # noqa: E402
from bench import run_meta  # noqa: E402
from bench.causal_linear import do_bench  # noqa: E402
from bench.delta_rule import impl_fn, make_inputs, time_training  # noqa: E402

SWEEP = [(8, T, 16, 128) for T in (64, 256, 384, 512, 1024, 4096)] + [(1, T, 8, 128) for T in (512, 2048)]
SHAPES = [(8, 4096, 16, 128), (4, 8192, 32, 128)]


def train_ms(inputs, path: str) -> tuple[float, float, torch.Tensor]:
    """(forward + backward ms, peak GiB over the step, dq) with the backward on `path`:
    "tensor_cores", "chunks" (torch) or "recurrent"."""
    saved = delta_rule.use_chunked_backward, delta_rule.use_tensor_core_backward
    if path != "tensor_cores":
        delta_rule.use_tensor_core_backward = lambda args: False
        delta_rule.use_chunked_backward = lambda B, T, H: path == "chunks"
    try:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms, grad = time_training(impl_fn("attngen", "gated_delta"), inputs)
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    finally:
        delta_rule.use_chunked_backward, delta_rule.use_tensor_core_backward = saved
    return ms, peak, grad


def stage_ms(inputs) -> dict:
    """The chunked backward's stages, each timed alone on the forward's checkpoints."""
    q, k, v, g, beta, s = inputs
    B, T, H, K = q.shape
    every = delta_rule.checkpoint_every()
    ckpt = torch.empty(delta_rule.checkpoint_shape(B, T, H, K, v.shape[-1]), device="cuda")
    delta_rule.OP(q, k, v, g, beta, None, s, delta_rule.variant("gated_delta"), K ** -0.5, True, ckpt)
    d_o, d_s = torch.randn_like(v), torch.randn_like(s)
    n = ckpt.shape[2]
    qc, kc, vc, dO = (chunked._chunked(x, n, every, torch.float32) for x in (q, k, v, d_o))
    gc, bc = chunked._chunked(g, n, every, torch.float32).cumsum(-1), chunked._chunked(beta, n, every, torch.float32)
    S, G = ckpt.reshape(-1, K, v.shape[-1]), torch.randn_like(ckpt).reshape(-1, K, v.shape[-1])
    times = {"whole": do_bench(lambda: chunked.gated_delta_chunked_backward(q, k, v, g, beta, d_o, ckpt, d_s,
                                                                             K ** -0.5, True, every)),
             "chunking": do_bench(lambda: [chunked._chunked(x, n, every, torch.float32) for x in (q, k, v, d_o)])}
    mats = chunked._chunk_matrices(qc, kc, gc, bc)
    phi, psi = chunked._state_step(qc, kc, gc, dO, mats)
    phi_bh, psi_bh = phi.view(B * H, n, K, K), psi.view(B * H, n, K, -1)

    def scan():
        x = d_s.reshape(B * H, K, -1)
        for c in reversed(range(n)):
            x = torch.baddbmm(psi_bh[:, c], phi_bh[:, c], x)
    times.update({"chunk_matrices": do_bench(lambda: chunked._chunk_matrices(qc, kc, gc, bc)),
                  "stage1_state_step": do_bench(lambda: chunked._state_step(qc, kc, gc, dO, mats)),
                  "stage2_scan": do_bench(scan),
                  "stage3_input_grads": do_bench(lambda: chunked._input_grads(qc, kc, vc, gc, bc, dO, S, G, mats))})
    return times


def profile_lines(inputs, top: int = 25) -> list[str]:
    q, k, v, g, beta, s = inputs
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    fn = impl_fn("attngen", "gated_delta")
    o, final = fn(*leaves)
    d_o, d_s = torch.randn_like(o), torch.randn_like(final)
    torch.autograd.backward([o, final], [d_o, d_s])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        o, final = fn(*leaves)
        torch.autograd.backward([o, final], [d_o, d_s])
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]
    return [f"{e.device_time_total / 1000:8.3f} ms  {e.count:5d} x  {e.key[:100]}" for e in rows]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/h100")
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    result = {"sweep": [], "shapes": []}
    for B, T, H, K in SWEEP:
        inputs = make_inputs("gated_delta", B, T, H, K, torch.bfloat16)
        tc, tc_peak, g0 = train_ms(inputs, "tensor_cores")
        ch, ch_peak, g1 = train_ms(inputs, "chunks")
        rec, rec_peak, g2 = train_ms(inputs, "recurrent")
        row = {"shape": [B, T, H, K], "tensor_core_ms": tc, "chunked_ms": ch, "recurrent_ms": rec,
               "tensor_core_peak_gib": tc_peak, "chunked_peak_gib": ch_peak, "recurrent_peak_gib": rec_peak,
               "dq_rel_diff": ((g1 - g2).norm() / g2.norm()).item(),
               "tensor_core_dq_rel_diff": ((g0 - g2).norm() / g2.norm()).item()}
        result["sweep"].append(row)
        print(row, flush=True)
    for B, T, H, K in SHAPES:
        inputs = make_inputs("gated_delta", B, T, H, K, torch.bfloat16)
        ms, peak, _ = train_ms(inputs, "chunks")
        row = {"shape": [B, T, H, K], "train_ms": ms, "peak_gib": peak, "stages_ms": stage_ms(inputs),
               "profile": profile_lines(inputs)}
        result["shapes"].append(row)
        print(json.dumps(row, indent=1), flush=True)
    result["meta"] = run_meta(started)
    (out / "gated_delta_backward.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Gated DeltaNet forward + backward, bf16 ({result['meta'].get('device')}, commit "
             f"{result['meta'].get('commit')})", "",
             "The tensor-core backward (gated_delta_grad), the chunked backward in torch (batched products) and "
             "the recurrent kernel on RWKV-7's tied vectors; ms = triton do_bench median of forward + backward; "
             "peak = memory allocated above the inputs; dq rel diff against the recurrent kernel's.", "",
             "| B, T, H, K=V | tensor cores ms | chunked ms | recurrent ms | chunked speedup | tensor cores peak GiB | "
             "chunked peak GiB | recurrent peak GiB | dq rel diff (tensor cores, chunked) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["sweep"]:
        lines.append(f"| {', '.join(map(str, r['shape']))} | {r['tensor_core_ms']:.3f} | {r['chunked_ms']:.3f} | "
                     f"{r['recurrent_ms']:.3f} | {r['recurrent_ms'] / r['chunked_ms']:.2f}x | "
                     f"{r['tensor_core_peak_gib']:.2f} | {r['chunked_peak_gib']:.2f} | {r['recurrent_peak_gib']:.2f} | "
                     f"{r['tensor_core_dq_rel_diff']:.1e}, {r['dq_rel_diff']:.1e} |")
    for r in result["shapes"]:
        lines += ["", f"## B, T, H, K=V = {', '.join(map(str, r['shape']))}: forward + backward by chunks in torch "
                  f"{r['train_ms']:.3f} ms, "
                  f"peak {r['peak_gib']:.2f} GiB", "", "Backward stages alone (ms): " +
                  ", ".join(f"{k} {v:.3f}" for k, v in r["stages_ms"].items()), "", "```", *r["profile"], "```"]
    (out / "gated_delta_backward.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
