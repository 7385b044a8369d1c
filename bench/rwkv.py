"""RWKV6 wkv forward and backward beside flash-linear-attention 0.6.0 (chunk_rwkv6,
fused_recurrent_rwkv6) and flash-rwkv 0.3.0 (RWKV-CUDA), on the shapes of
../shared/ANCHORS.md: bf16, r, k, v, w [B, T, H*N], u [H, N], state [B, H, N, N] fp32 in and
out. Writes rwkv.json and rwkv.md under --out.

  python -m bench.rwkv [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from attngen import rwkv  # noqa: E402
from bench import run_meta  # noqa: E402
from bench.causal_linear import do_bench, rotating  # noqa: E402

# (B, T, H, N) and the ANCHORS.md forward figures (ms: RWKV-CUDA, fla chunk, fla fused_recurrent).
SHAPES = [((1, 54, 32, 64), (0.084, 0.619, 0.051)),
          ((8, 1024, 32, 64), (1.398, 0.737, 0.942)),
          ((8, 4096, 32, 64), (5.416, 2.849, 3.722))]
TARGETS_MS = {(1, 54, 32, 64): 0.045, (8, 1024, 32, 64): 0.5, (8, 4096, 32, 64): 2.0}  # issue 4
BACKWARD_SHAPE = (8, 4096, 32, 64)


def make_inputs(B, T, H, N, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r, k, v = (torch.randn(B, T, H * N, device="cuda", generator=g).to(dtype) for _ in range(3))
    w = (-torch.exp(torch.randn(B, T, H * N, device="cuda", generator=g) - 2)).to(dtype)  # decays ~0.87
    u = (torch.randn(H, N, device="cuda", generator=g) * 0.1).to(dtype)
    state = torch.randn(B, H, N, N, device="cuda", generator=g) * 0.1
    return r, k, v, w, u, state


def impl_fn(name, H, N):
    """(r, k, v, w, u, state) with [B, T, H*N] inputs -> (o, final state)."""
    if name == "attngen":
        return attngen.wkv6
    if name.startswith("fla"):
        from fla.ops.rwkv6 import chunk_rwkv6, fused_recurrent_rwkv6
        f = chunk_rwkv6 if name == "fla_chunk" else fused_recurrent_rwkv6
        heads = lambda x: x.unflatten(-1, (H, N))  # noqa: E731
        return lambda r, k, v, w, u, s: f(heads(r), heads(k), heads(v), heads(w), u, scale=1.0,
                                          initial_state=s, output_final_state=True)
    from flash_rwkv import rwkv6_cuda_linear_attention
    # RWKV-CUDA takes the raw time_decay, decay = exp(-exp(td)): td = log(-w) gives the same decay.
    return lambda r, k, v, w, u, s: rwkv6_cuda_linear_attention(r, k, v, torch.log(-w.float()), u, s)


def available(name) -> str | None:
    try:
        if name.startswith("fla"):
            import fla.ops.rwkv6  # noqa: F401
        elif name == "flash_rwkv":
            import flash_rwkv  # noqa: F401  (compiles RWKV-CUDA on first import)
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means: no such peer in this run
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def time_forward(name, B, T, H, N, dtype):
    nbytes = 4 * B * T * H * N * torch.finfo(dtype).bits // 8
    get = rotating(lambda i: make_inputs(B, T, H, N, dtype, i), nbytes)
    fn = impl_fn(name, H, N)
    with torch.no_grad():
        return do_bench(lambda: fn(*get()))


def time_backward(name, B, T, H, N, dtype):
    """Backward alone (the forward's graph kept), and forward + backward, for r, k, v, w, u."""
    r, k, v, w, u, s = make_inputs(B, T, H, N, dtype, 0)
    leaves = [x.requires_grad_() for x in (r, k, v, w, u)]
    fn = impl_fn(name, H, N)
    d_o = torch.randn(B, T, H, N, device="cuda", dtype=dtype)
    o, _ = fn(*leaves, s)
    d_o = d_o.view(o.shape)
    bwd = do_bench(lambda: torch.autograd.grad(o, leaves, d_o, retain_graph=True))
    both = do_bench(lambda: torch.autograd.grad(fn(*leaves, s)[0], leaves, d_o))
    return bwd, both


def agreement(B, T, H, N, dtype):
    """Relative difference of our output and final state from fla's chunk_rwkv6 (a sanity check
    that the two compute the same function on the benchmark's inputs)."""
    r, k, v, w, u, s = make_inputs(B, T, H, N, dtype, 0)
    o1, s1 = attngen.wkv6(r, k, v, w, u, s)
    o2, s2 = impl_fn("fla_chunk", H, N)(r, k, v, w, u, s)
    rel = lambda a, b: ((a.double() - b.double().view(a.shape)).norm() / b.double().norm()).item()  # noqa: E731
    return rel(o1, o2), rel(s1, s2)


def run(quick: bool):
    peers = {name: available(name) for name in ("fla_chunk", "fla_recurrent", "flash_rwkv")}
    rows = []
    for (B, T, H, N), anchors in SHAPES:
        r, k, v, w, u, s = make_inputs(B, T, H, N, torch.bfloat16, 0)
        row = {"shape": dict(B=B, T=T, H=H, N=N), "dtype": "bf16",
               "anchor_ms": dict(zip(("flash_rwkv", "fla_chunk", "fla_recurrent"), anchors)),
               "target_ms": TARGETS_MS[(B, T, H, N)],
               "instance": rwkv.selected_scan(r.unflatten(-1, (H, N)), k.unflatten(-1, (H, N)),
                                              v.unflatten(-1, (H, N)), w.unflatten(-1, (H, N)))}
        row["attngen_fwd_ms"] = time_forward("attngen", B, T, H, N, torch.bfloat16)
        if not quick:
            row["attngen_fwd_fp32_ms"] = time_forward("attngen", B, T, H, N, torch.float32)
        for name, missing in peers.items():
            if missing is None:
                row[f"{name}_fwd_ms"] = time_forward(name, B, T, H, N, torch.bfloat16)
        if peers["fla_chunk"] is None:
            row["rel_diff_vs_fla_chunk"] = agreement(B, T, H, N, torch.bfloat16)
        rows.append(row)
        print(json.dumps(row), flush=True)
    B, T, H, N = BACKWARD_SHAPE
    bwd = {"shape": dict(B=B, T=T, H=H, N=N), "dtype": "bf16"}
    bwd["attngen_bwd_ms"], bwd["attngen_fwd_bwd_ms"] = time_backward("attngen", B, T, H, N, torch.bfloat16)
    if peers["fla_chunk"] is None:
        bwd["fla_chunk_bwd_ms"], bwd["fla_chunk_fwd_bwd_ms"] = time_backward("fla_chunk", B, T, H, N, torch.bfloat16)
    if peers["fla_recurrent"] is None and not quick:
        bwd["fla_recurrent_bwd_ms"], bwd["fla_recurrent_fwd_bwd_ms"] = time_backward(
            "fla_recurrent", B, T, H, N, torch.bfloat16)
    print(json.dumps(bwd), flush=True)
    return rows, bwd, peers


def markdown(rows, bwd, peers, meta) -> str:
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    out = [f"# RWKV6 wkv, bf16, state in and out ({meta['device']}, torch {meta['torch']}, commit {meta['commit']})",
           "", "Forward (ms, median of triton do_bench; same run for every column):", "",
           "| B T H N | attngen | target | fla chunk | fla fused_recurrent | flash-rwkv (RWKV-CUDA) | attngen instance |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["shape"]
        out.append(f"| {s['B']} {s['T']} {s['H']} {s['N']} | {f(r['attngen_fwd_ms'])} | <= {r['target_ms']} | "
                   f"{f(r.get('fla_chunk_fwd_ms'))} | {f(r.get('fla_recurrent_fwd_ms'))} | "
                   f"{f(r.get('flash_rwkv_fwd_ms'))} | `{r['instance']}` |")
    s = bwd["shape"]
    out += ["", f"Backward, B{s['B']} T{s['T']} H{s['H']} N{s['N']} bf16, gradients of r, k, v, w, u (ms):", "",
            "| | backward | forward + backward |", "|---|---|---|",
            f"| attngen | {f(bwd['attngen_bwd_ms'])} | {f(bwd['attngen_fwd_bwd_ms'])} |",
            f"| fla chunk_rwkv6 | {f(bwd.get('fla_chunk_bwd_ms'))} | {f(bwd.get('fla_chunk_fwd_bwd_ms'))} |"]
    if "fla_recurrent_bwd_ms" in bwd:
        out.append(f"| fla fused_recurrent_rwkv6 | {f(bwd['fla_recurrent_bwd_ms'])} | {f(bwd['fla_recurrent_fwd_bwd_ms'])} |")
    missing = {k: v for k, v in peers.items() if v}
    if missing:
        out += ["", "Peers not measured in this run: " + "; ".join(f"{k} ({v})" for k, v in missing.items())]
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the fp32 and fused_recurrent backward columns")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    args = ap.parse_args()
    t0 = time.time()
    rows, bwd, peers = run(args.quick)
    meta = run_meta(t0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rwkv.json").write_text(json.dumps({"meta": meta, "forward": rows, "backward": bwd, "peers": peers},
                                              indent=1) + "\n")
    (out / "rwkv.md").write_text(markdown(rows, bwd, peers, meta))
    print((out / "rwkv.md").read_text())


if __name__ == "__main__":
    main()
