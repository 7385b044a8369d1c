"""Paged decode's tuning workload (bench/workloads/__init__.py says the contract): one query
token per sequence, pages of BLOCK tokens shuffled through the cache (NHD), the cache in q's
dtype. Contexts are ragged, as in a serving batch: the first sequence holds the bucket's L, the
others U(1..L). Timed on equal contexts instead, the winners lost on ragged ones: the G 4
winner of 64 x 4096 (3 stages, 1.02x the default there) read 2.13 TB/s against the default's
2.56 with lengths U(1..8192) (H100, dbc4461, bench/results/h100/paged.md). A shape with
`ragged: 0` has every context L long (bench/paged_serving.py's equal contexts: a bucket times
one beside its ragged shape with `also:`)."""
from __future__ import annotations

from attngen import reference as ref
from codegen.families.paged import TUNE_BLOCK as BLOCK   # the page size the tuning plan's key assumes


def check_shape(shape: dict) -> dict:
    return {**shape, "S": 3, "L": min(shape["L"], 1000)}


def inputs(torch, ops, shape: dict, dtype, seed: int) -> tuple:
    S, Hq, Hkv, D, L = (shape[d] for d in ("S", "Hq", "Hkv", "D", "L"))
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-L // BLOCK)
    lens = torch.randint(1, L + 1, (S,), device="cuda", generator=g, dtype=torch.int32)
    if not shape.get("ragged", 1):
        lens.fill_(L)
    lens[0] = L
    order = torch.randperm(S * pages, device="cuda", generator=g).to(torch.int32)
    q = torch.randn(S, Hq, D, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(S * pages, BLOCK, Hkv, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    return q, k, v, order.view(S, pages), lens


def run(ops, instance: str, args: tuple):
    q = args[0]
    return ops.paged_decode_with(*args, q.shape[-1] ** -0.5, None, 0.0, None, None, instance)


def reference(args: tuple):
    return ref.paged_decode(*args)
