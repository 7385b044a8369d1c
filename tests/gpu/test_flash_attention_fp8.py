"""GPU tier for the FP8 forward (float8_e4m3fn q, k, v with descale factors, bf16 output): every
fp8 instance, the dispatched op over lengths, GQA groups, causal masks, windows, ALiBi and soft
cap, packed batches, the descale layouts, CUDA graphs and torch.compile, and the errors it raises.

Error bound. The reference is float64 attention over the dequantized inputs (q, k, v times their
descales), so the inputs' own fp8 rounding is not counted against the kernel. What the kernel
rounds besides is the softmax weights, quantized to e4m3 (3 mantissa bits: a relative error of at
most 2^-4 each, after scaling by 256 into e4m3's normal range) before they multiply v, and the
output, rounded to bf16 (2^-9 relative). `reference.flash_attention(..., weights_dtype=e4m3)`
does the same weight rounding in float64; as flash-attn's tests bound a kernel by twice the error
of torch doing the same computation in the storage dtype, the kernel's largest error against
float64 must stay within twice that emulation's, plus the output's bf16 rounding (2^-8 of the
largest output) and 1e-5. Independently of the emulation, each element's error must stay within
the worst case the weight rounding allows: 2^-4 sum_j w_ij |v_j| (plus 2^-7 of it for the exp16
instances' half-precision exponents, forward_ws.cu.j2's EXP16) plus the bf16 rounding."""
import importlib
import math

import pytest
import torch

from .conftest import family_manifest

fa = importlib.import_module("attngen.flash_attention")
reference = importlib.import_module("attngen.reference")

pytestmark = pytest.mark.gpu
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# Natural log. The scores' products are exact, but Hopper's fp8 MMAs keep about 14 bits of their
# fp32 accumulation (DeepSeek-V3's report measured so on the H800): |s| up to ~20 here, an error
# of |s| 2^-13 at most per score, and the log-sum-exp inherits it. Measured up to 5.2e-3 (e62128b).
LSE_TOL = 1.5e-2


def poison(numel):
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        torch.full((numel,), 255 if dtype == torch.uint8 else float("nan"), dtype=dtype, device="cuda")


def quantize(x, per_head: bool):
    """x [B, L, H, D] float -> (e4m3 x / descale, descale): one factor, or one per (b, head)."""
    amax = x.abs().amax(dim=(1, 3)) if per_head else x.abs().amax().reshape(1)
    descale = (amax / E4M3_MAX).clamp_min(1e-12).float()
    scaled = x / (descale[:, None, :, None] if per_head else descale)
    return scaled.to(E4M3), descale


def make(B, Lq, Lk, Hq, Hkv, D, seed=0, per_head=True, sharp=1.0):
    """Quantized q, k, v and descales; q's descale per kv head ([B, Hkv]) as FlashAttention-3 takes it.
    `sharp` scales q: larger values peak the softmax, so that a weight paired with the wrong
    value row shows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Lq, Hq, D, generator=g, device="cuda") * sharp
    k = torch.randn(B, Lk, Hkv, D, generator=g, device="cuda")
    v = torch.randn(B, Lk, Hkv, D, generator=g, device="cuda")
    if per_head:   # q's factor per kv head: the largest over the group's query heads
        G = Hq // Hkv
        amax = q.abs().amax(dim=(1, 3)).view(B, Hkv, G).amax(dim=-1)
        q_descale = (amax / E4M3_MAX).float()
        q8 = (q / q_descale.repeat_interleave(G, dim=1)[:, None, :, None]).to(E4M3)
    else:
        q8, q_descale = quantize(q, False)
    k8, k_descale = quantize(k, per_head)
    v8, v_descale = quantize(v, per_head)
    return (q8, k8, v8), (q_descale, k_descale, v_descale)


def check(out, lse, qkv, descales, what="", **kwargs):
    assert out.dtype == torch.bfloat16, f"{what}: out is {out.dtype}, expected bfloat16"
    assert torch.isfinite(out).all(), f"{what}: output has NaN/Inf (unwritten elements keep the poison)"
    q, k, v = (reference.dequantize(t, f) for t, f in zip(qkv, descales))
    ref, ref_lse = reference.flash_attention(q, k, v, **kwargs)
    emu, _ = reference.flash_attention(q, k, v, weights_dtype=E4M3, **kwargs)
    err = (out.double() - ref).abs()
    rounding = 2 ** -8 * ref.abs().max().item() + 1e-5
    bound = 2 * (emu - ref).abs().max().item() + rounding
    assert err.max().item() <= bound, f"{what}: max error {err.max().item():.3e} > bound {bound:.3e}"
    # The worst case of the weights' rounding, element by element: 2^-4 sum_j w_ij |v_j|.
    weights_abs, _ = reference.flash_attention(q, k, v.abs(), **kwargs)
    worst = (2 ** -4 + 2 ** -7) * weights_abs + 2 ** -8 * ref.abs() + 1e-5
    over = (err - worst).max().item()
    assert over <= 0, f"{what}: an element's error exceeds the weights' worst-case rounding by {over:.3e}"
    if lse is not None:
        seen = ref_lse > -math.inf
        assert (lse[~seen] == -math.inf).all(), f"{what}: rows without keys must have lse -inf"
        lse_err = (lse[seen].double() - ref_lse[seen]).abs().max().item() if seen.any() else 0.0
        assert lse_err <= LSE_TOL, f"{what}: lse error {lse_err:.3e}"
    return err.max().item(), bound


def call(qkv, descales, **kwargs):
    q, k, v = qkv
    qd, kd, vd = descales
    return fa.flash_attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, **kwargs)


# The shipped fp8 instances, and the benchmark extension's (exp16, other schedules) where it was built.
INSTANCES = sorted((n, r) for n, r in family_manifest("flash_attention", bench=True).items() if r["dtype"] == "e4m3")


def test_fp8_instances_are_built():
    assert INSTANCES, "the spec builds fp8 (e4m3) flash_attention instances"


@pytest.mark.parametrize("name,row", INSTANCES, ids=[n for n, _ in INSTANCES])
def test_every_instance(name, row):
    D = row["params"]["d"]
    for causal, (Lq, Lk), (Hq, Hkv), sharp in ((False, (113, 300), (4, 1), 1.0), (True, (300, 300), (2, 2), 3.0),
                                               (True, (77, 200), (7, 1), 3.0), (False, (256, 1000), (2, 1), 3.0)):
        qkv, descales = make(2, Lq, Lk, Hq, Hkv, D, seed=Lq, sharp=sharp)
        poison(2 * Lq * Hq * D)
        out, lse = call(qkv, descales, causal=causal, return_lse=True, instance=name)
        check(out, lse, qkv, descales, f"{name} causal={causal} Lq={Lq} Lk={Lk}", causal=causal)


LENGTHS = [(1, 1), (7, 7), (113, 113), (1023, 1023), (1, 4097), (7, 1023), (113, 7), (4097, 1), (2049, 2049)]
GROUPS = [(1, 1), (4, 1), (7, 1)]   # (G, Hkv)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_matrix(D, causal):
    worst = 0.0
    for i, (Lq, Lk) in enumerate(LENGTHS):
        G, Hkv = GROUPS[i % len(GROUPS)]
        qkv, descales = make(1, Lq, Lk, G * Hkv, Hkv, D, seed=i, per_head=i % 2 == 0, sharp=2.0)
        poison(Lq * G * Hkv * D)
        out, lse = call(qkv, descales, causal=causal, return_lse=True)
        err, bound = check(out, lse, qkv, descales, f"D={D} causal={causal} Lq={Lq} Lk={Lk} G={G}", causal=causal)
        worst = max(worst, err / bound)
    assert worst <= 1.0


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("extras", [
    {"window": (64, 16)}, {"window": (-1, 40), "causal": False}, {"soft_cap": 5.0},
    {"alibi": True, "causal": True}, {"soft_cap": 3.0, "alibi": True, "window": (100, 0)},
], ids=["window", "right_window", "soft_cap", "alibi_causal", "all"])
def test_windows_alibi_soft_cap(D, extras):
    extras = dict(extras)
    Hq, Hkv = 4, 2
    if extras.pop("alibi", False):
        extras["alibi_slopes"] = torch.linspace(0.05, 0.5, Hq, device="cuda")
    qkv, descales = make(2, 333, 517, Hq, Hkv, D, seed=D, sharp=2.0)
    out, lse = call(qkv, descales, return_lse=True, **extras)
    check(out, lse, qkv, descales, f"D={D} {extras}", **extras)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(D, causal):
    """Packed sequences (lengths 0, 1 and odd; q and k lengths differ), a descale per sequence and kv
    head, against each sequence's own attention."""
    lengths = [(0, 5), (1, 1), (300, 517), (7, 129), (129, 7), (1000, 1000), (0, 0), (65, 300)]
    Hq, Hkv = 6, 2
    qkv, descales = [], []
    for i, (lq, lk) in enumerate(lengths):   # descales from at least one row (an empty sequence has none)
        (q8, k8, v8), ds = make(1, max(lq, 1), max(lk, 1), Hq, Hkv, D, seed=i, sharp=2.0)
        qkv.append((q8[0, :lq], k8[0, :lk], v8[0, :lk]))
        descales.append(ds)
    q, k, v = (torch.cat([t[j] for t in qkv]) for j in range(3))
    qd, kd, vd = (torch.cat([ds[j] for ds in descales]) for j in range(3))
    cu_q = torch.tensor([0] + [sum(lq for lq, _ in lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32,
                        device="cuda")
    cu_k = torch.tensor([0] + [sum(lk for _, lk in lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32,
                        device="cuda")
    poison(q.numel() * 2)
    out, lse = fa.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq for lq, _ in lengths),
                                         max(lk for _, lk in lengths), causal=causal, return_lse=True,
                                         q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    for i, (lq, lk) in enumerate(lengths):
        rows = slice(cu_q[i].item(), cu_q[i + 1].item())
        if lq == 0:
            continue
        check(out[rows][None], lse[:, rows][None], tuple(t[None] for t in qkv[i]), descales[i],
              f"D={D} causal={causal} sequence {i} ({lq} x {lk})", causal=causal)


def test_descales_default_to_one_and_take_numbers():
    qkv, _ = make(1, 200, 200, 2, 2, 128, seed=3)
    ones = tuple(torch.ones(1, device="cuda") for _ in range(3))
    out = call(qkv, (None, None, None))
    check(out, None, qkv, (None, None, None), "no descales")
    assert torch.equal(out, call(qkv, ones))
    numbers = fa.flash_attention(*qkv, q_descale=0.5, k_descale=2.0, v_descale=0.25)
    check(numbers, None, qkv, tuple(torch.tensor([f], device="cuda") for f in (0.5, 2.0, 0.25)), "numbers")


def test_bad_input_names_the_problem():
    qkv, descales = make(2, 64, 64, 4, 2, 128)
    q, k, v = qkv
    with pytest.raises(ValueError, match="k_descale must be float32 with one element or \\[B=2, Hkv=2\\]"):
        fa.flash_attention(q, k, v, k_descale=torch.ones(3, device="cuda"))
    with pytest.raises(ValueError, match="q_descale, k_descale and v_descale are taken with float8_e4m3fn"):
        fa.flash_attention(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), q_descale=descales[0])
    with pytest.raises(ValueError, match="has dtype torch.bfloat16 but q has torch.float8_e4m3fn"):
        fa.flash_attention(q, k.to(torch.bfloat16), v)
    cu = torch.tensor([0, 64, 128], dtype=torch.int32, device="cuda")
    flat = [t.reshape(-1, *t.shape[2:]) for t in qkv]
    with pytest.raises(ValueError, match="flash_attention_varlen: v_descale must be float32 with one element or "
                                         "\\[B=2, Hkv=2\\]"):
        fa.flash_attention_varlen(*flat, cu, cu, 64, 64, v_descale=torch.ones(4, 2, device="cuda"))
    pa = importlib.import_module("attngen.paged_attention")
    cache = torch.zeros(4, 16, 2, 128, device="cuda").to(E4M3)
    with pytest.raises(ValueError, match="q has dtype torch.float8_e4m3fn; supported: float16, bfloat16"):
        pa.paged_attention(flat[0][:4], cache, cache, torch.zeros(2, 2, dtype=torch.int32, device="cuda"),
                           torch.tensor([0, 2, 4], dtype=torch.int32, device="cuda"),
                           torch.tensor([16, 20], dtype=torch.int32, device="cuda"), 2, 20, instance=None)
    with pytest.raises(ValueError, match="(?s)unsupported head size D=160.*d=160: fp8 operands need a multiple of 32"):
        q2, k2, v2 = (torch.zeros(1, 16, 1, 160, device="cuda").to(E4M3) for _ in range(3))
        fa.flash_attention(q2, k2, v2)


def test_no_gradient():
    qkv, descales = make(1, 64, 64, 2, 2, 64)
    q = qkv[0].float().requires_grad_()
    out = call((q.to(E4M3), qkv[1], qkv[2]), descales)   # the cast's gradient reaches q
    with pytest.raises(NotImplementedError, match="float8 q, k, v has no gradient"):
        out.float().sum().backward()


def test_cuda_graph_and_compile():
    qkv, descales = make(2, 500, 700, 4, 2, 128, seed=7)
    eager = call(qkv, descales, causal=True)
    static_out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(qkv, descales, causal=True)   # warm up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            static_out.copy_(call(qkv, descales, causal=True))
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)
    compiled = torch.compile(lambda q, k, v, a, b, c: fa.flash_attention(q, k, v, causal=True, q_descale=a,
                                                                         k_descale=b, v_descale=c), fullgraph=True)
    assert torch.equal(compiled(*qkv, *descales), eager)
