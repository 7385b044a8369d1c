"""The delta-rule forward and forward+backward (RWKV-7, Gated DeltaNet, KDA) beside
flash-linear-attention 0.6's chunk and fused_recurrent kernels, bf16, state in and out fp32, on
the shapes of the delta-rule issue. Each peer's output (and first input's gradient) is compared
with ours on the same inputs (rel err, reported). Writes delta_rule.json and delta_rule.md under
--out.

  python -m bench.delta_rule [--out DIR]
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
from attngen import delta_rule  # noqa: E402
from bench import run_meta  # noqa: E402
from bench.causal_linear import do_bench, geomean  # noqa: E402

# (variant, B, T, H, K): K = V. Decode-like and training shapes of issue 31; KDA (on RWKV-7's
# kernels) at Kimi Linear's head size, one value head per q, k head.
SHAPES = [("rwkv7", 8, 4096, 64, 64), ("rwkv7", 1, 54, 32, 64),
          ("gated_delta", 8, 4096, 16, 128), ("gated_delta", 4, 8192, 32, 128),
          ("kda", 8, 4096, 16, 128)]


def make_inputs(variant, B, T, H, K, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    state = rand(B, H, K, K) * 0.1
    if variant == "rwkv7":
        kk = torch.nn.functional.normalize(rand(B, T, H, K), dim=-1)
        w = -torch.exp(rand(B, T, H, K) - 2)
        iclr = torch.rand(B, T, H, K, device="cuda", generator=g)
        xs = (rand(B, T, H, K), w, rand(B, T, H, K) / K ** 0.5, rand(B, T, H, K), -kk, kk * iclr)
        return [x.to(dtype) for x in xs] + [state]
    k = torch.nn.functional.normalize(rand(B, T, H, K), dim=-1)
    gate = -torch.exp(rand(B, T, H, *((K,) if variant == "kda" else ())) - 3)   # KDA: per key channel
    beta = torch.rand(B, T, H, device="cuda", generator=g)
    return [rand(B, T, H, K).to(dtype), k.to(dtype), rand(B, T, H, K).to(dtype), gate, beta, state]


def impl_fn(name, variant):
    """inputs -> (o, final state)."""
    if name == "attngen":
        if variant == "rwkv7":
            return lambda r, w, k, v, a, b, s: attngen.rwkv7(r, w, k, v, a, b, state=s)
        op = attngen.kda if variant == "kda" else attngen.gated_delta_rule
        return lambda q, k, v, g, beta, s: op(q, k, v, g, beta, state=s)
    if variant == "rwkv7":
        from fla.ops.rwkv7 import chunk_rwkv7, fused_recurrent_rwkv7
        f = chunk_rwkv7 if name == "fla_chunk" else fused_recurrent_rwkv7
        return lambda r, w, k, v, a, b, s: f(r, w, k, v, a, b, scale=1.0, initial_state=s, output_final_state=True)
    if variant == "kda":
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
        f = chunk_kda if name == "fla_chunk" else fused_recurrent_kda
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        f = chunk_gated_delta_rule if name == "fla_chunk" else fused_recurrent_gated_delta_rule
    return lambda q, k, v, g, beta, s: f(q, k, v, g=g, beta=beta.to(q.dtype), initial_state=s, output_final_state=True)


def have_fla() -> str | None:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
        import fla.ops.rwkv7  # noqa: F401
        return None
    except Exception as exc:  # noqa: BLE001 - the peer is optional; say why it is missing
        return f"{type(exc).__name__}: {exc}"


FLA_GUARD_NOTE = ("fla refuses its gated chunk backward under Triton >= 3.4, < 3.7.1 on Hopper (its issue 640: "
                  "wrong results); the guard was lifted to time it, and its gradient's error against ours is shown")


def lift_fla_triton_guard(exc: RuntimeError) -> bool:
    """fla 0.6's chunk_bwd_dqkwg raises under the Triton this machine has (its #640); lift that
    guard (a module flag it reads at call time) so that its backward can be timed. True if this
    was that error."""
    if "#640" not in str(exc):
        return False
    import fla.ops.common.chunk_o as chunk_o
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return True


def time_candidates(variant, K, inputs) -> dict:
    """Every bf16 instance of this variant and key bucket, shipped or bench-role (`python -m
    codegen build --bench`), forced on the shape: what the kinds' grids are chosen from."""
    if variant == "rwkv7":
        r, w, k, v, a, b, s = inputs
        args = (r, k, v, w, a, b, s, delta_rule.variant("rwkv7"), 1.0, True, None, False)
    else:
        q, k, v, g, beta, s = inputs
        args = (q, k, v, g, beta, None, s, delta_rule.variant("gated_delta"), K ** -0.5, True, None, False)
    names = [n for n in delta_rule.OP.instances() + delta_rule.OP.bench_instances()
             if n.startswith(f"delta_rule_{variant}_") and f"_k{K}_" in n and n.endswith("_bf16_sm90a")]
    return {n: do_bench(lambda: delta_rule.delta_rule_with(n, *args)) for n in sorted(names)}


def time_grad_candidates(variant, K, inputs) -> dict:
    """Every backward instance of the key bucket, shipped or bench-role, forced on the shape with
    the forward's checkpoints: RWKV-7's delta_rule_grad instances in bf16; Gated DeltaNet's
    tensor-core gated_delta_grad instances in bf16 (K = V) and the recurrent delta_rule_grad
    ones on its tied vectors in fp32 (what fp32 inputs run)."""
    g = torch.Generator(device="cuda").manual_seed(8)
    times = {}
    if variant == "gated_delta":
        q, k, v, gate, beta, s = inputs
        B, T, H, _ = q.shape
        ckpt = torch.empty(delta_rule.checkpoint_shape(B, T, H, K, v.shape[-1]), device="cuda")
        delta_rule.OP(q, k, v, gate, beta, None, s, delta_rule.variant("gated_delta"), K ** -0.5, True, ckpt)
        d_o = torch.randn(v.shape, device="cuda", generator=g).to(v.dtype)
        d_s = torch.randn(s.shape, device="cuda", generator=g)
        args = (q, k, v, gate, beta, d_o, ckpt, d_s, K ** -0.5, True)
        names = [n for n in delta_rule.GATED_GRAD.instances() + delta_rule.GATED_GRAD.bench_instances()
                 if f"_k{K}_v{v.shape[-1]}_" in n and n.endswith("_bf16_sm90a")]
        times = {n: do_bench(lambda: delta_rule.GATED_GRAD.forced(n, *args)) for n in sorted(names)}
        # A bench-role point has no GPU tier: its gradients against the dispatched instance's.
        want = delta_rule.GATED_GRAD(*args)
        for n in names:
            got = delta_rule.GATED_GRAD.forced(n, *args)
            diff = max(((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()
                       for x, y in zip(got, want))
            if not diff <= 1e-2:
                times[n] = float("nan")
                print(f"{n}: gradients differ from the dispatched instance's by {diff:.1e}; its time is dropped")
    if variant == "rwkv7":
        r, w, k, v, a, b, s = inputs
        scale, dtype = 1.0, "bf16"
    else:
        q, k, v, gate, beta, s = inputs
        r, k, v, w, a, b = delta_rule.gated_delta_as_rwkv7(q, k, v, gate, beta)
        scale, dtype = K ** -0.5, "fp32"
    B, T, H, _ = r.shape
    ckpt = torch.empty(delta_rule.checkpoint_shape(B, T, H, K, v.shape[-1]), device="cuda")
    delta_rule.OP(r, k, v, w, a, b, s, delta_rule.variant("rwkv7"), scale, True, ckpt)
    d_o = torch.randn(v.shape, device="cuda", generator=g).to(v.dtype)
    d_s = torch.randn(s.shape, device="cuda", generator=g)
    args = (r, k, v, w, a, b, d_o, ckpt, d_s, scale, True)
    names = [n for n in delta_rule.GRAD.instances() + delta_rule.GRAD.bench_instances()
             if f"_k{K}_" in n and n.endswith(f"_{dtype}_sm90a")]
    return times | {n: do_bench(lambda: delta_rule.GRAD.forced(n, *args)) for n in sorted(names)}


def time_training(fn, inputs) -> tuple[float, torch.Tensor]:
    """Forward and backward (every input and the initial state differentiable; gradients of o
    and of the final state given): (ms, the first input's gradient as float)."""
    g = torch.Generator(device="cuda").manual_seed(7)
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, s = fn(*leaves)
    d_o = torch.randn(o.shape, device="cuda", generator=g).to(o.dtype)
    d_s = torch.randn(s.shape, device="cuda", generator=g)

    def step():  # as a training step after optimizer.zero_grad() (set_to_none): gradients assigned, not added
        for x in leaves:
            x.grad = None
        out, final = fn(*leaves)
        torch.autograd.backward([out, final], [d_o, d_s])
    for x in leaves:
        x.grad = None
    step()
    grad = leaves[0].grad.float().clone()
    return do_bench(step), grad


def run(only: str | None = None, forced: bool = True, on_row=None, training: bool = True) -> tuple[list, str | None]:
    """The rows of every shape (of `only`'s variant): attngen and fla side by side, forward and
    forward + backward, and with `forced` every instance of the key bucket forced (the longest
    part: RWKV-7's backward instances take 30-55 ms a call at B8 T4096 H64); training=False
    leaves out forward + backward (fla's chunk backward compiles for minutes). `on_row(rows,
    missing)` after each shape, so that a run stopped at a time limit keeps what it measured."""
    missing = have_fla()
    names = ["attngen"] + ([] if missing else ["fla_chunk", "fla_fused_recurrent"])
    rows = []
    for variant, B, T, H, K in SHAPES:
        if only and variant != only:
            continue
        inputs = make_inputs(variant, B, T, H, K, torch.bfloat16)
        row = {"variant": variant, "shape": [B, T, H, K], "ms": {}, "rel_err_vs_attngen": {}}
        ours = None
        for name in names:
            fn = impl_fn(name, variant)
            try:
                out = fn(*inputs)[0].float()
                row["ms"][name] = do_bench(lambda: fn(*inputs))
            except Exception as exc:  # noqa: BLE001 - a peer failing on a shape is recorded
                row["ms"][name] = None
                row.setdefault("errors", {})[name] = str(exc).splitlines()[0][:200]
                continue
            if name == "attngen":
                ours = out
            elif ours is not None:
                row["rel_err_vs_attngen"][name] = ((out - ours).norm() / ours.norm()).item()
        row["train_ms"], row["grad_rel_err_vs_attngen"] = {}, {}
        ours = None
        for name in names if training else ():
            try:
                try:
                    row["train_ms"][name], grad = time_training(impl_fn(name, variant), inputs)
                except RuntimeError as exc:
                    if not (name == "fla_chunk" and lift_fla_triton_guard(exc)):
                        raise
                    row.setdefault("train_notes", {})[name] = FLA_GUARD_NOTE
                    row["train_ms"][name], grad = time_training(impl_fn(name, variant), inputs)
            except Exception as exc:  # noqa: BLE001 - a peer without a backward is recorded
                row["train_ms"][name] = None
                row.setdefault("train_errors", {})[name] = str(exc).splitlines()[0][:200]
                continue
            if name == "attngen":
                ours = grad
            elif ours is not None:
                row["grad_rel_err_vs_attngen"][name] = ((grad - ours).norm() / ours.norm()).item()
        if forced and variant != "kda":   # KDA runs RWKV-7's instances, forced on RWKV-7's rows
            row["forced_ms"] = time_candidates(variant, K, inputs)
            row["grad_forced_ms"] = time_grad_candidates(variant, K, inputs)
        rows.append(row)
        if on_row:
            on_row(rows, missing)
        print(variant, row["shape"], row["ms"], row["rel_err_vs_attngen"], row["train_ms"],
              row["grad_rel_err_vs_attngen"], flush=True)
    return rows, missing


def markdown(rows, missing, meta) -> str:
    lines = [f"# Delta-rule forward, bf16 ({meta['device']}, torch {meta['torch']}, commit {meta['commit']})", "",
             "Forward with state in and out; ms = triton.testing.do_bench median. Peers: flash-linear-attention 0.6 "
             "(chunk = WY/UT chunked Triton kernel, fused_recurrent = its step-by-step kernel).", ""]
    if missing:
        lines += [f"fla not importable: {missing}", ""]
    lines += ["| variant | B, T, H, K=V | attngen ms | fla chunk ms | fla recurrent ms | vs chunk | vs recurrent | rel err (chunk, rec) |",
              "|---|---|---|---|---|---|---|---|"]
    ratios = []
    for row in rows:
        ms = row["ms"]
        mine = ms.get("attngen")
        def ratio(peer):  # three decimals: a ratio of 1.995 against a 2x target is not 2.00
            return f"{ms[peer] / mine:.3f}x" if mine and ms.get(peer) else "-"
        if mine and ms.get("fla_chunk"):
            ratios.append(ms["fla_chunk"] / mine)
        err = row["rel_err_vs_attngen"]
        fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        lines.append(f"| {row['variant']} | {', '.join(map(str, row['shape']))} | {fmt(mine)} | {fmt(ms.get('fla_chunk'))} | "
                     f"{fmt(ms.get('fla_fused_recurrent'))} | {ratio('fla_chunk')} | {ratio('fla_fused_recurrent')} | "
                     f"{err.get('fla_chunk', float('nan')):.1e}, {err.get('fla_fused_recurrent', float('nan')):.1e} |")
    if ratios:
        lines += ["", f"Geometric mean over fla chunk: {geomean(ratios):.3f}x"]
    lines += ["", "Forward + backward (every input and the initial state differentiable, o's and the final state's "
              "gradients given, the leaves' gradients set to None before each step as optimizer.zero_grad() "
              "leaves them; rel err of the first input's gradient against ours):", "",
              "| variant | B, T, H, K=V | attngen ms | fla chunk ms | fla recurrent ms | vs chunk | vs recurrent | "
              "grad rel err (chunk, rec) |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ms, err = row.get("train_ms", {}), row.get("grad_rel_err_vs_attngen", {})
        mine = ms.get("attngen")
        fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        vs = lambda peer: f"{ms[peer] / mine:.3f}x" if mine and ms.get(peer) else "-"  # noqa: E731
        lines.append(f"| {row['variant']} | {', '.join(map(str, row['shape']))} | {fmt(mine)} | {fmt(ms.get('fla_chunk'))} | "
                     f"{fmt(ms.get('fla_fused_recurrent'))} | {vs('fla_chunk')} | {vs('fla_fused_recurrent')} | "
                     f"{err.get('fla_chunk', float('nan')):.1e}, {err.get('fla_fused_recurrent', float('nan')):.1e} |")
    for row in rows:
        for name, why in row.get("train_errors", {}).items():
            lines.append(f"- {row['variant']} {', '.join(map(str, row['shape']))}: {name} backward failed: {why}")
        for name, why in row.get("train_notes", {}).items():
            lines.append(f"- {row['variant']} {', '.join(map(str, row['shape']))}: {name}: {why}")
    lines += ["", "Every bf16 instance of the shape's key bucket, forced (ms; the shipped kinds and the bench-role "
              "`candidates` kind):", ""]
    for row in rows:
        best = sorted(row.get("forced_ms", {}).items(), key=lambda kv: kv[1])
        lines.append(f"- {row['variant']} {', '.join(map(str, row['shape']))}: " +
                     ", ".join(f"{n.split('_', 3)[3].rsplit('_bf16', 1)[0]} {ms:.3f}" for n, ms in best[:6]))
    lines += ["", "Every backward instance of the shape's key bucket, forced on the forward's checkpoints (ms; RWKV-7 in "
              "bf16, Gated DeltaNet's tied vectors in fp32; the shipped kind and the bench-role `candidates`):", ""]
    for row in rows:
        best = sorted(row.get("grad_forced_ms", {}).items(), key=lambda kv: kv[1])
        lines.append(f"- {row['variant']} {', '.join(map(str, row['shape']))}: " +
                     ", ".join(f"{n.split('_', 3)[3].rsplit('_', 2)[0]} {ms:.3f}" for n, ms in best[:8]))
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "h100"))
    parser.add_argument("--only", choices=["rwkv7", "gated_delta", "kda"], help="one variant's shapes")
    parser.add_argument("--no-forced", action="store_true",
                        help="skip forcing every instance of the key bucket (the peers and the dispatched kinds only)")
    parser.add_argument("--forward-only", action="store_true",
                        help="the forward alone (no forward + backward rows): a quick A/B of forward kernels")
    args = parser.parse_args()
    started = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"delta_rule{'_' + args.only if args.only else ''}"

    def write(rows, missing):
        meta = run_meta(started)
        (out / f"{name}.json").write_text(json.dumps({"meta": meta, "fla_missing": missing, "rows": rows}, indent=1)
                                          + "\n")
        (out / f"{name}.md").write_text(markdown(rows, missing, meta))
    run(args.only, forced=not args.no_forced, on_row=write, training=not args.forward_only)
    print((out / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
