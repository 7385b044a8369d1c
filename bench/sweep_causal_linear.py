"""Times every compiled fp32 forward instance that covers each ANCHORS shape (one run), to
set the dispatch rules from measurements: python -m bench.sweep_causal_linear."""
import json
import sys

import torch

from bench.causal_linear import SHAPES, do_bench, make_inputs, rotating
import attngen


def main():
    rows = []
    names = [n for n in attngen.instances() if "_fwd_" in n and n.endswith("fp32_sm90a")]
    for (B, H, L, E, M), _ in SHAPES:
        nbytes = B * H * L * (2 * E + M) * 4
        get = rotating(lambda i: make_inputs(B, H, L, E, M, torch.float32, "bhld", i), nbytes)
        times = {}
        for name in names:
            try:
                attngen.causal_dot_product_with(name, *get())
            except ValueError:
                continue  # does not cover this shape
            times[name] = do_bench(lambda: attngen.causal_dot_product_with(name, *get()))
        best = sorted(times.items(), key=lambda kv: kv[1])
        row = {"shape": [B, H, L, E, M], "dispatch": attngen.selected_instance(*get()), "times": dict(best)}
        rows.append(row)
        print(f"B{B} H{H} L{L} E{E} M{M}: dispatch -> {row['dispatch']}")
        for name, ms in best[:6]:
            print(f"   {ms:8.3f} ms  {name}")
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
