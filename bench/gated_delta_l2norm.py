"""Gated DeltaNet's forward with q and k L2-normalised (use_qk_l2norm=True), bf16, state in and
out: normalised inside attngen's kernels (no gradient wanted), normalised by torch before them
(what a gradient-wanting call does), and flash-linear-attention 0.6's chunk kernel with
use_qk_l2norm_in_kernel=True, side by side.

  python -m bench.gated_delta_l2norm
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attngen  # noqa: E402
from bench.delta_rule import make_inputs  # noqa: E402

SHAPES = [(8, 4096, 16, 128), (4, 8192, 32, 128)]


def main():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    for B, T, H, K in SHAPES:
        q, k, v, g, beta, s = make_inputs("gated_delta", B, T, H, K, torch.bfloat16)
        k = (k.float() * 3).to(k.dtype)

        def in_kernel():
            with torch.no_grad():
                return attngen.gated_delta_rule(q, k, v, g, beta, state=s, use_qk_l2norm=True)

        def by_torch():
            qn, kn = (torch.nn.functional.normalize(x.float(), dim=-1).to(x.dtype) for x in (q, k))
            return attngen.gated_delta_rule(qn, kn, v, g, beta, state=s)

        def fla():
            return chunk_gated_delta_rule(q, k, v, g=g, beta=beta.to(q.dtype), initial_state=s, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
        times = {name: triton.testing.do_bench(fn, warmup=5, rep=50)
                 for name, fn in (("in_kernel", in_kernel), ("by_torch", by_torch), ("fla", fla))}
        o1, o2, o3 = in_kernel()[0].float(), by_torch()[0].float(), fla()[0].float()
        diff = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
        print(f"B{B} T{T} H{H} K=V={K} bf16: attngen in-kernel {times['in_kernel']:.3f} ms, torch-normalised "
              f"{times['by_torch']:.3f} ms, fla chunk (l2norm in kernel) {times['fla']:.3f} ms; "
              f"{times['fla'] / times['in_kernel']:.2f}x fla; rel diff in-kernel vs torch-normalised {diff(o1, o2):.1e}, "
              f"vs fla {diff(o1, o3):.1e}")


if __name__ == "__main__":
    main()
