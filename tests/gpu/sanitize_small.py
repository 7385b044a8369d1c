"""Small launches of one instance per kernel kind and direction, for compute-sanitizer
(memcheck, racecheck): `compute-sanitizer --tool racecheck python3 tests/gpu/sanitize_small.py [FAMILY ...]`
(families: causal_linear, rwkv, paged, flash_attention, flash_attention_grad, delta_rule; default all).
SANITIZE_INSTANCES=GLOB limits the flash attention and delta-rule families to the instances it matches."""
import fnmatch
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import attngen  # noqa: E402
from attngen import reference  # noqa: E402


def wanted(name: str) -> bool:
    return fnmatch.fnmatch(name, os.environ.get("SANITIZE_INSTANCES", "*"))


WANT = set(sys.argv[1:]) or {"causal_linear", "rwkv", "paged", "flash_attention", "flash_attention_grad", "delta_rule"}
seen = set()


def causal_linear():
    for name in attngen.instances():
        kind = name.split("_e")[0] if "_generic_" not in name else name.split("_emax")[0]
        key = (kind, "fp32" in name, "bf16" in name)
        if key in seen or "_e64_m64_" not in name and "generic" not in name:
            continue
        seen.add(key)
        dtype = torch.float32 if "fp32" in name else torch.bfloat16 if "bf16" in name else torch.float16
        E, M = (64, 64) if "generic" not in name else (40, 36)
        q, k, v = (torch.randn(1, 2, 600, D, device="cuda").to(dtype) for D in (E, E, M))  # 600: split_time splits
        out = attngen.causal_dot_product_with(name, q, k, v, "_rev_" in name)
        ref = reference.causal_dot_product(q, k, v, "_rev_" in name)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        print(f"{name}: rel err {err:.2e}")
        assert err < 2e-2



def rwkv_family():
    # wkv: one scan instance per kind, dtype and mode (N=64; N=256 for wide_head), then one
    # forward + backward through the dispatch (the rwkv_grad family's r, k, w, u pass included).
    from attngen import rwkv  # noqa: E402

    for name in rwkv.wkv_instances():
        kind = name.split("_n")[0]
        key = (kind, "fp32" in name, "bf16" in name)
        if key in seen or not ("_n64_" in name or "wide_head" in name):
            continue
        seen.add(key)
        dtype = torch.float32 if "fp32" in name else torch.bfloat16 if "bf16" in name else torch.float16
        N = 256 if "wide_head" in name else 64
        q, kc, vo = (torch.randn(1, 40, 2, N, device="cuda").to(dtype) for _ in range(3))
        w = -torch.rand(1, 40, 2, N, device="cuda").to(dtype)
        u, s0 = torch.randn(2, N, device="cuda").to(dtype), torch.randn(1, 2, N, N, device="cuda")
        rev, keys_out = "_rev_" in name, "_output_" in name
        y, s = rwkv.wkv_scan_with(name, q, kc, vo, w, u, s0, rev, keys_out, True, False)
        ref, _ = reference.wkv_scan(q, kc, vo, w, u, s0, rev, keys_out)
        err = ((y.double() - ref).norm() / ref.norm()).item()
        print(f"{name}: rel err {err:.2e}")
        assert err < 2e-2
    r, k, v = (torch.randn(2, 70, 2, 64, device="cuda", requires_grad=True) for _ in range(3))
    w = (-torch.rand(2, 70, 2, 64, device="cuda")).requires_grad_()
    u = torch.randn(2, 64, device="cuda", requires_grad=True)
    o, s = attngen.wkv6(r, k, v, w, u, torch.randn(2, 2, 64, 64, device="cuda"))
    (o.sum() + s.sum()).backward()


def paged_family():
    # paged decode: one instance per kind, dtype and packing (D=80: lanes past the row idle;
    # grouped_mma at D=128 too), a group one short of the packing (padding), two query tokens, with
    # a context that ends mid-page and mid-tile, an empty one, and one over two partitions.
    from attngen import paged  # noqa: E402

    for name in paged.instances():
        heads = paged.instance_heads(name)
        key = (name.split("_d")[0], "fp32" in name, "bf16" in name, heads, "_d80_" in name)
        if key in seen or "_d80_" not in name and "_d128_" not in name or "_d128_" in name and "_grouped_" not in name:
            continue
        seen.add(key)
        dtype = torch.float32 if "fp32" in name else torch.bfloat16 if "bf16" in name else torch.float16
        D, group = (80 if "_d80_" in name else 128), (heads - 1 if heads > 2 else heads)
        lens = [37, 0, 1100]
        bt = torch.randperm(3 * 9 * 8, device="cuda")[: 3 * 9].to(torch.int32).view(3, 9)
        kc = torch.randn(3 * 9 * 8, 128, 2, D, device="cuda").to(dtype)
        vc = torch.randn(3 * 9 * 8, 128, 2, D, device="cuda").to(dtype)
        q = torch.randn(3, 2, 2 * group, D, device="cuda").to(dtype)
        cl = torch.tensor(lens, dtype=torch.int32, device="cuda")
        slopes = torch.rand(2 * group, device="cuda")
        out = paged.paged_decode_with(name, q, kc, vc, bt, cl, alibi_slopes=slopes)
        ref = reference.paged_decode(q, kc, vc, bt, cl, alibi_slopes=slopes)
        err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
        print(f"{name}: rel err {err:.2e}")
        assert err < 2e-2


def flash_attention():
    # flash attention: every instance, causal (masked tiles) and windowed with ALiBi (the four
    # compile-time variants), short odd lengths, a packed batch with empty sequences.
    import importlib  # noqa: E402

    fa = importlib.import_module("attngen.flash_attention")
    for name in fa.instances():
        if not wanted(name):
            continue
        seen.add(name)
        D = fa.instance_head_size(name)
        if "_e4m3_" in name:   # the fp8 forward: fixed lengths only (V^T by its own kernel, then every tile by TMA)
            q, k, v = (torch.randn(2, L, H, D, device="cuda").to(torch.float8_e4m3fn) for L, H in ((70, 4), (133, 2), (133, 2)))
            for kwargs in ({"causal": True}, {"window": (40, 3), "alibi_slopes": torch.rand(4, device="cuda")}, {}):
                out = fa.flash_attention(q, k, v, instance=name, **kwargs)
                ref, _ = reference.flash_attention(q.double(), k.double(), v.double(), **kwargs)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                assert err < 5e-2, (name, kwargs, err)
            print(f"{name}: rel err {err:.2e}")
            cu = torch.tensor([0, 0, 5, 70], dtype=torch.int32, device="cuda")   # packed: lengths 0, 5, 65
            fa.flash_attention_varlen(q[0], q[1, :, :2], q[1, :, 2:], cu, cu, 65, 65, causal=True, instance=name)
            continue
        dtype = torch.bfloat16 if "bf16" in name else torch.float16
        q, k, v = (torch.randn(2, L, H, D, device="cuda").to(dtype) for L, H in ((70, 4), (133, 2), (133, 2)))
        cu = torch.tensor([0, 0, 5, 70], dtype=torch.int32, device="cuda")
        if "_fp8_cache_" in name:   # an fp8 paged cache under a 16-bit q: paged_attention only
            cache_dtype = torch.float8_e5m2 if "_kv_e5_" in name else torch.float8_e4m3fn
            paged_call(name, q, cu, D, cache_dtype, dtype)
            print(f"{name}: over an fp8 cache")
            continue
        for kwargs in ({"causal": True}, {"window": (40, 3), "alibi_slopes": torch.rand(4, device="cuda")}, {}):
            out = fa.flash_attention(q, k, v, instance=name, **kwargs)
            ref, _ = reference.flash_attention(q, k, v, **kwargs)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, (name, kwargs, err)
        print(f"{name}: rel err {err:.2e}")
        fa.flash_attention_varlen(q[0], q[1, :, :2], q[1, :, 2:], cu, cu, 65, 65, causal=True, instance=name)
        paged_call(name, q, cu, D, dtype, dtype)


def paged_call(name, q, cu, D, cache_dtype, dtype):
    """paged_attention through instance `name`: pages of 8 shuffled, a sequence with no query token,
    contexts ending mid-page, the HND layout; an fp8 cache with per-kv-head scales."""
    import importlib  # noqa: E402

    pa = importlib.import_module("attngen.paged_attention")
    cache = torch.randn(2, 40, 2, 8, D, device="cuda").to(dtype)      # k and v: [blocks, Hkv, 8, D] (HND)
    scales = {}
    if cache_dtype != dtype:
        scales = {"k_scale": torch.tensor([0.5, 2.0], device="cuda"), "v_scale": torch.tensor([0.25, 1.0], device="cuda")}
        cache = cache.to(cache_dtype)
    table = torch.randperm(40, device="cuda")[:36].to(torch.int32).reshape(3, 12)
    lens = torch.tensor([3, 90, 77], dtype=torch.int32, device="cuda")
    out = pa.paged_attention(q[0], cache[0], cache[1], table, cu, lens, 65, 90, kv_layout="HND", instance=name, **scales)
    ref, _ = reference.paged_attention(q[0], cache[0], cache[1], table, cu, lens, kv_layout="HND", **scales)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2, name


def flash_attention_grad():
    # every backward instance: the four compile-time variants, GQA, odd lengths, a packed batch
    # with empty sequences, deterministic runs (the windowed one and the packed one)
    import importlib  # noqa: E402

    fa = importlib.import_module("attngen.flash_attention")
    for name in fa.GRAD.instances() + fa.GRAD.bench_instances():  # the benchmark extension's candidates too, where built
        if not wanted(name):
            continue
        seen.add(name)
        D = fa.instance_head_size(name.replace("flash_attention_grad_", "flash_attention_"))
        dtype = torch.bfloat16 if "bf16" in name else torch.float16
        q, k, v = (torch.randn(2, L, H, D, device="cuda").to(dtype) for L, H in ((70, 4), (133, 2), (133, 2)))
        d_out = torch.randn_like(q)
        for kwargs in ({"causal": True}, {"window": (40, 3), "alibi_slopes": torch.rand(4, device="cuda")},
                       {"soft_cap": 2.0}):
            out, lse = fa.flash_attention(q, k, v, return_lse=True, **kwargs)
            left, right = kwargs.get("window", (-1, 0 if kwargs.get("causal") else -1))
            got = fa.GRAD.forced(name, q, k, v, out, d_out, lse, None, None, None, 70, 133, D ** -0.5, left, right,
                                 kwargs.get("alibi_slopes"), kwargs.get("soft_cap", 0.0), "alibi_slopes" in kwargs)
            want = reference.flash_attention_grad(q, k, v, d_out, **kwargs)
            err = max(((x.double() - y).norm() / y.norm()).item() for x, y in zip(got, want))
            assert err < 2e-2, (name, kwargs, err)
        print(f"{name}: worst rel err {err:.2e}")
        cu = torch.tensor([0, 0, 5, 70], dtype=torch.int32, device="cuda")
        qp, kp, vp, dp = q[0], q[1, :, :2], q[1, :, 2:], d_out[0]
        out, lse = fa.flash_attention_varlen(qp, kp, vp, cu, cu, 65, 65, causal=True, return_lse=True)
        for deterministic in (False, True):
            fa.GRAD.forced(name, qp, kp, vp, out, dp, lse, None, cu, cu, 65, 65, D ** -0.5, -1, 0, None, 0.0, deterministic)


def delta_rule_family():
    # every delta-rule instance (both variants, every kind and dtype) on a short sequence that
    # ends mid-chunk, K below the bucket, V not a multiple of the CTA's columns, state in and out.
    from attngen import delta_rule  # noqa: E402

    for name in [n for n in delta_rule.instances() if wanted(n)]:
        seen.add(name)
        dtype = torch.float32 if "_fp32_" in name else torch.bfloat16 if "_bf16_" in name else torch.float16
        kb = int(name.split("_k")[1].split("_")[0])
        B, T, H, K, V = 1, 37, 2, kb - 8, 40  # K, V multiples of 8: the chunked kinds cover whole 16-byte rows
        q, k = (torch.randn(B, T, H, K, device="cuda").to(dtype) / K ** 0.5 for _ in range(2))
        v = torch.randn(B, T, H, V, device="cuda").to(dtype)
        state = torch.randn(B, H, K, V, device="cuda") * 0.1
        if "_rwkv7_" in name:
            w, a, b = (-torch.rand(B, T, H, K, device="cuda").to(dtype), -k, k * 0.5)
            args = (q, k, v, w, a, b, state, delta_rule.variant("rwkv7"), 1.0, True, None, False)
            ref, _ = reference.rwkv7(q, w, k, v, a, b, state=state)
        else:
            g, beta = -torch.rand(B, T, H, device="cuda"), torch.rand(B, T, H, device="cuda")
            args = (q, k, v, g, beta, None, state, delta_rule.variant("gated_delta"), 0.5, True, None, False)
            ref, _ = reference.gated_delta_rule(q, k, v, g, beta, state=state, scale=0.5)
        out, _ = delta_rule.delta_rule_with(name, *args)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        print(f"{name}: rel err {err:.2e}")
        assert err < 2e-2, (name, err)
    # every backward instance: two checkpoint windows (the second short), V over two CTAs
    for name in [n for n in delta_rule.GRAD.instances() if wanted(n)]:
        seen.add(name)
        dtype = torch.float32 if "_fp32_" in name else torch.bfloat16 if "_bf16_" in name else torch.float16
        kb = int(name.split("_k")[1].split("_")[0])
        chunked = "_chunked_rwkv7_" in name  # rows read 16 bytes at a time; bf16 tensor-core operands
        B, T, H, K, V = 1, 70, 2, kb - (8 if chunked else 4), 40
        r, k, w = (torch.randn(B, T, H, K, device="cuda").to(dtype) / K ** 0.5 for _ in range(3))
        w = -w.abs()
        v, d_o = (torch.randn(B, T, H, V, device="cuda").to(dtype) for _ in range(2))
        state = torch.randn(B, H, K, V, device="cuda") * 0.1
        ckpt = torch.empty(delta_rule.checkpoint_shape(B, T, H, K, V), device="cuda")
        delta_rule.OP(r, k, v, w, -k, k * 0.5, state, delta_rule.variant("rwkv7"), 1.0, True, ckpt)
        got = delta_rule.GRAD.forced(name, r, k, v, w, -k, k * 0.5, d_o, ckpt, state, 1.0, True)
        want = reference.rwkv7_grad(r, k, v, w, -k, k * 0.5, d_o, ckpt, state, 1.0, True)
        err = max(((x.double() - y).norm() / y.norm()).item() for x, y in zip(got, want))
        print(f"{name}: worst rel err {err:.2e}")
        # the gradients come in the inputs' dtype: 16-bit ones add their rounding to fp32's bound
        assert err < (2e-2 if chunked else 1e-4 + torch.finfo(dtype).eps / 2), (name, err)
        if chunked:  # again on the records the chunked forward of its dtype saves (each chunk's start state)
            suffix = name[name.rindex("_", 0, name.rindex("_")):]
            forward = next(n for n in delta_rule.instances() if "_rwkv7_chunked_rwkv7_" in n and n.endswith(suffix))
            records = torch.empty(delta_rule.records_numel(B, T, H, K, V, rwkv7=True), dtype=torch.uint8, device="cuda")
            delta_rule.delta_rule_with(forward, r, k, v, w, -k, k * 0.5, state, delta_rule.variant("rwkv7"), 1.0, True,
                                       ckpt, False, records)
            got = delta_rule.GRAD.forced(name, r, k, v, w, -k, k * 0.5, d_o, ckpt, state, 1.0, True, records)
            err = max(((x.double() - y).norm() / y.norm()).item() for x, y in zip(got, want))
            print(f"{name}: worst rel err {err:.2e} on {forward}'s records")
            assert err < 2e-2, (name, err)
    # every tensor-core Gated DeltaNet backward instance: two chunks (the second short), K and V
    # below their buckets, the walk's value columns over two CTAs where it has 64
    from attngen.gated_delta_chunked_grad import gated_delta_chunked_backward  # noqa: E402
    for name in [n for n in delta_rule.GATED_GRAD.instances() if wanted(n)]:
        seen.add(name)
        dtype = torch.bfloat16 if "_bf16_" in name else torch.float16
        kb, vb = int(name.split("_k")[1].split("_")[0]), int(name.split("_v")[1].split("_")[0])
        B, T, H, K, V = 1, 70, 2, kb - 8, vb - 24
        q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).to(dtype) for _ in range(2))
        v, d_o = (torch.randn(B, T, H, V, device="cuda").to(dtype) for _ in range(2))
        g, beta = -torch.rand(B, T, H, device="cuda"), torch.rand(B, T, H, device="cuda")
        state = torch.randn(B, H, K, V, device="cuda") * 0.1
        ckpt = torch.empty(delta_rule.checkpoint_shape(B, T, H, K, V), device="cuda")
        # the chunked forward of the same key bucket, saving its chunk records for the backward
        forward = next(n for n in delta_rule.instances()
                       if f"_gated_delta_chunked_k{kb}_" in n and n.endswith(name[-len("_bf16_sm90a"):]))
        records = torch.empty(delta_rule.records_numel(B, T, H, K, V), dtype=torch.uint8, device="cuda")
        delta_rule.delta_rule_with(forward, q, k, v, g, beta, None, state, delta_rule.variant("gated_delta"), 0.5, True,
                                   ckpt, False, records)
        saved = delta_rule.GATED_GRAD.forced(name, q, k, v, g, beta, d_o, ckpt, state, 0.5, True, records)
        ckpt = delta_rule.checkpoints_in_fp32(records, ckpt, dtype)  # the forward saved the states with its records
        got = delta_rule.GATED_GRAD.forced(name, q, k, v, g, beta, d_o, ckpt, state, 0.5, True)
        want = gated_delta_chunked_backward(*(x.double() for x in (q, k, v, g, beta, d_o, ckpt, state)), 0.5, True,
                                            delta_rule.checkpoint_every(), torch.float64)
        err = max(((x.double() - y).norm() / y.norm()).item() for x, y in zip(got + saved, want + want))
        print(f"{name}: worst rel err {err:.2e} (its own chunk records and {forward}'s)")
        assert err < 2e-2, (name, err)


for family, run in (("causal_linear", causal_linear), ("rwkv", rwkv_family), ("paged", paged_family),
                    ("flash_attention", flash_attention), ("flash_attention_grad", flash_attention_grad),
                    ("delta_rule", delta_rule_family)):
    if family in WANT:
        run()
torch.cuda.synchronize()
print(f"sanitized {len(seen)} instances ({', '.join(sorted(WANT))})")
