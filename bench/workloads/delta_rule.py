"""The delta rule's tuning workload (bench/workloads/__init__.py says the contract): the forward
with state in and out, as bench/delta_rule.py times it beside flash-linear-attention. Each
bucket fixes the variant (`axes: {variant: ...}` in specs/delta_rule.yaml), which the shape
carries beside its dims. Inputs as the models make them: RWKV-7's a = -kk, b = kk * iclr with
kk unit-norm and decays exp(-exp(x - 2)); Gated DeltaNet's unit-norm keys, log alpha
-exp(x - 3) and beta in (0, 1)."""
from __future__ import annotations

import torch

from attngen import reference as ref


def check_shape(shape: dict) -> dict:
    """Two heads over 300 steps: chunk boundaries and a partial last chunk for the chunked kinds."""
    return {**shape, "B": 1, "H": 2, "T": min(shape["T"], 300)}


def inputs(_torch, ops, shape: dict, dtype, seed: int) -> tuple:
    B, T, H, K, V, variant = (shape[d] for d in ("B", "T", "H", "K", "V", "variant"))
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, device="cuda", generator=g)
    state = rand(B, H, K, V) * 0.1
    number = list(ops.delta_rule_axis_values("variant")).index(variant)
    if variant == "rwkv7":
        kk = torch.nn.functional.normalize(rand(B, T, H, K), dim=-1)
        iclr = torch.rand(B, T, H, K, device="cuda", generator=g)
        r, w, k = rand(B, T, H, K), -torch.exp(rand(B, T, H, K) - 2), rand(B, T, H, K) / K ** 0.5
        q, k, v, w, a, b = (x.to(dtype) for x in (r, k, rand(B, T, H, V), w, -kk, kk * iclr))
        return q, k, v, w, a, b, state, number, 1.0, variant
    k = torch.nn.functional.normalize(rand(B, T, H, K), dim=-1).to(dtype)
    gate, beta = -torch.exp(rand(B, T, H) - 3), torch.rand(B, T, H, device="cuda", generator=g)
    return rand(B, T, H, K).to(dtype), k, rand(B, T, H, V).to(dtype), gate, beta, None, state, number, K ** -0.5, variant


def run(ops, instance: str, args: tuple):
    q, k, v, w, a, b, state, number, scale, _variant = args
    return ops.delta_rule_with(q, k, v, w, a, b, state, number, scale, True, None, False, None, instance)


def as_tensor(out):
    """The output and the final state, as one tensor for the check."""
    o, final = out
    return torch.cat([o.flatten().float(), final.flatten()])


def reference(args: tuple):
    q, k, v, w, a, b, state, _number, scale, variant = args
    if variant == "rwkv7":
        o, final = ref.rwkv7(q, w, k, v, a, b, state=state, scale=scale)
    else:
        o, final = ref.gated_delta_rule(q, k, v, w, a, state=state, scale=scale)
    return torch.cat([o.flatten(), final.flatten()])
