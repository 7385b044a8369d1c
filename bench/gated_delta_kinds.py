"""Every Gated DeltaNet forward instance of a shape's key bucket (shipped, and the bench-role
ones where `python -m codegen build --bench` built them), forced, beside
flash-linear-attention 0.6's chunk kernel (bf16, state in and out); prints ms, the ratio and the
instance the dispatch picks. What the chunked kind's grid and dispatch rules are chosen from.

  python -m bench.gated_delta_kinds
"""
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attngen  # noqa: E402
from attngen import delta_rule  # noqa: E402
from bench.delta_rule import make_inputs  # noqa: E402
from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402
for (B, T, H, K) in [(8, 4096, 16, 128), (4, 8192, 32, 128), (1, 4096, 8, 128), (8, 2048, 16, 64)]:
    q, k, v, g, beta, s = make_inputs("gated_delta", B, T, H, K, torch.bfloat16)
    args = (q, k, v, g, beta, None, s, delta_rule.variant("gated_delta"), K ** -0.5, True, None)
    names = [n for n in delta_rule.instances() + delta_rule.OP.bench_instances()
             if "gated_delta" in n and f"_k{K}_" in n and n.endswith("_bf16_sm90a")]
    res = {}
    for n in names:
        res[n.replace("delta_rule_gated_delta_", "").replace("_bf16_sm90a", "")] = triton.testing.do_bench(lambda: delta_rule.delta_rule_with(n, *args), warmup=5, rep=30)
    f = lambda: chunk_gated_delta_rule(q, k, v, g=g, beta=beta.to(q.dtype), initial_state=s, output_final_state=True)
    f()
    fla = triton.testing.do_bench(f, warmup=5, rep=30)
    pick = delta_rule.OP.select(*args)
    o, st = attngen.gated_delta_rule(q, k, v, g, beta, state=s)
    of, sf = f()
    err = ((o.float() - of.float()).norm() / of.float().norm()).item()
    print(f"B{B} T{T} H{H} K{K}: fla chunk {fla:.3f} ms; dispatch {pick}; rel diff vs fla {err:.2e}")
    for n, t in sorted(res.items(), key=lambda x: x[1]):
        print(f"   {n:45s} {t:.3f} ms  {fla / t:.2f}x fla")
