"""GPU tier for flash attention: every generated instance, and the dispatched op over the issue's
matrix (lengths 1, 7, 113, 1023, 4097 with Lq != Lk, causal and not, GQA groups 1, 4, 7, every
head size and dtype), windows, ALiBi, soft cap, packed batches, strided inputs, the log-sum-exp,
torch.compile and CUDA graphs, against float64.

Error bound (as flash-attn's tests): the output's largest error against float64 is at most twice
that of the same attention computed by torch in the storage dtype, plus 1e-5."""
import importlib
import math

import pytest
import torch

from .conftest import family_manifest

fa = importlib.import_module("attngen.flash_attention")
reference = importlib.import_module("attngen.reference")

pytestmark = pytest.mark.gpu
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEAD_SIZES = (64, 96, 128, 256)
LSE_TOL = 2e-3   # absolute, natural log: fp32 sums of exactly computed 16-bit products


def poison(numel):
    """Hand the caching allocator NaN-filled blocks, so unwritten outputs show up as NaN."""
    for dtype in (torch.float32, torch.bfloat16):
        torch.full((numel,), float("nan"), dtype=dtype, device="cuda")


def make(B, Lq, Lk, Hq, Hkv, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Lq, Hq, D, generator=g, device="cuda").to(dtype)
    k = torch.randn(B, Lk, Hkv, D, generator=g, device="cuda").to(dtype)
    v = torch.randn(B, Lk, Hkv, D, generator=g, device="cuda").to(dtype)
    return q, k, v


def check(out, lse, q, k, v, what="", **kwargs):
    """out/lse from the kernel against float64, with the bound of the module docstring."""
    assert torch.isfinite(out).all(), f"{what}: output has NaN/Inf (unwritten elements keep the poison)"
    ref, ref_lse = reference.flash_attention(q, k, v, **kwargs)
    low, _ = reference.flash_attention(q, k, v, dtype=q.dtype, **kwargs)
    err = (out.double() - ref).abs().max().item()
    bound = 2 * (low.double() - ref).abs().max().item() + 1e-5
    assert err <= bound, f"{what}: max error {err:.3e} > bound {bound:.3e}"
    if lse is not None:
        seen = ref_lse > -math.inf
        assert (lse[~seen] == -math.inf).all(), f"{what}: rows without keys must have lse -inf"
        lse_err = (lse[seen].double() - ref_lse[seen]).abs().max().item() if seen.any() else 0.0
        assert lse_err <= LSE_TOL, f"{what}: lse error {lse_err:.3e}"
    return err, bound


# ---- every instance ------------------------------------------------------------------------
# fp8 q, k, v: test_flash_attention_fp8.py; an fp8 paged cache (kv_e): test_paged_attention.py
INSTANCES = sorted((n, r) for n, r in family_manifest("flash_attention").items()
                   if r["dtype"] in DTYPES and "kv_e" not in r["params"])


@pytest.mark.parametrize("name,row", INSTANCES, ids=[n for n, _ in INSTANCES])
def test_every_instance(name, row):
    D, dtype = row["params"]["d"], DTYPES[row["dtype"]]
    for causal, (Lq, Lk), (Hq, Hkv) in ((False, (113, 300), (4, 1)), (True, (300, 300), (2, 2)),
                                        (True, (77, 200), (7, 1))):
        q, k, v = make(2, Lq, Lk, Hq, Hkv, D, dtype, seed=Lq)
        poison(2 * Lq * Hq * D)
        out, lse = fa.flash_attention(q, k, v, causal=causal, return_lse=True, instance=name)
        check(out, lse, q, k, v, f"{name} causal={causal} Lq={Lq} Lk={Lk}", causal=causal)


# ---- the dispatched op over the matrix -------------------------------------------------------
LENGTHS = [(1, 1), (7, 7), (113, 113), (1023, 1023), (4097, 4097), (1, 4097), (7, 1023), (113, 7),
           (1023, 113), (4097, 1), (7, 1)]
GROUPS = [(1, 1), (4, 1), (7, 1)]   # (G, Hkv): Hq = G * Hkv


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("D", HEAD_SIZES)
@pytest.mark.parametrize("causal", [False, True])
def test_matrix(D, dtype, causal):
    worst = 0.0
    for n, (Lq, Lk) in enumerate(LENGTHS):
        G, Hkv = GROUPS[n % len(GROUPS)]
        B = 2 if max(Lq, Lk) < 2000 else 1
        q, k, v = make(B, Lq, Lk, G * Hkv, Hkv, D, DTYPES[dtype], seed=n)
        poison(B * Lq * G * Hkv * D)
        out, lse = fa.flash_attention(q, k, v, causal=causal, return_lse=True)
        err, bound = check(out, lse, q, k, v, f"Lq={Lq} Lk={Lk} G={G}", causal=causal)
        worst = max(worst, err / bound)
    print(f"D={D} {dtype} causal={causal}: worst error / bound {worst:.3f}")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 96, 128])
@pytest.mark.parametrize("extras", [
    {"window": (100, 0)}, {"window": (32, 16)}, {"window": (-1, 40)}, {"window": (0, 0)},
    {"causal": True, "window": (50, -1)},
    {"alibi": True}, {"alibi": True, "causal": True}, {"soft_cap": 5.0}, {"soft_cap": 2.0, "alibi": True, "window": (64, 8)},
    {"scale": 0.3, "causal": True},
], ids=lambda e: "-".join(f"{k}{v}" for k, v in e.items()))
def test_windows_alibi_soft_cap(D, dtype, extras):
    extras = dict(extras)
    for Lq, Lk in ((300, 300), (130, 517), (517, 130)):
        q, k, v = make(2, Lq, Lk, 4, 2, D, DTYPES[dtype], seed=Lq + Lk)
        kwargs = {k_: v_ for k_, v_ in extras.items() if k_ != "alibi"}
        if extras.get("alibi"):
            kwargs["alibi_slopes"] = torch.rand(4, device="cuda") * 0.5
        poison(2 * Lq * 4 * D)
        out, lse = fa.flash_attention(q, k, v, return_lse=True, **kwargs)
        check(out, lse, q, k, v, f"{extras} Lq={Lq} Lk={Lk}", **kwargs)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("D", HEAD_SIZES)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(D, dtype, causal):
    lq = [0, 1, 7, 300, 1, 129, 64]
    lk = [5, 1, 0, 300, 77, 129, 200]
    cq = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    ck = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(D)
    dt = DTYPES[dtype]
    q = torch.randn(sum(lq), 8, D, generator=g, device="cuda").to(dt)
    k = torch.randn(sum(lk), 2, D, generator=g, device="cuda").to(dt)
    v = torch.randn(sum(lk), 2, D, generator=g, device="cuda").to(dt)
    poison(q.numel())
    out, lse = fa.flash_attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=causal, return_lse=True)
    assert torch.isfinite(out).all()
    ref, ref_lse = reference.flash_attention_varlen(q, k, v, cq, ck, causal=causal)
    low, _ = reference.flash_attention_varlen(q, k, v, cq, ck, dtype=dt, causal=causal)
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * (low.double() - ref).abs().max().item() + 1e-5
    seen = ref_lse > -math.inf
    assert (lse[~seen] == -math.inf).all() and (lse[seen].double() - ref_lse[seen]).abs().max() <= LSE_TOL
    assert (out[sum(lq[:2]):sum(lq[:3])] == 0).all()  # the 7 rows of a sequence with no keys


def test_strided_inputs_run_without_copies():
    """q from a [B, H, L, D] tensor, k and v slices of one packed kv tensor: any strides with a
    contiguous last dim (and 16-byte rows)."""
    B, L, H, D = 2, 333, 4, 128
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    kv = torch.randn(B, L, 2, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = kv[:, :, 0], kv[:, :, 1]
    assert not q.is_contiguous() and not k.is_contiguous()
    out, lse = fa.flash_attention(q, k, v, causal=True, return_lse=True)
    check(out, lse, q, k, v, "strided", causal=True)
    # A view that starts mid-row (8-byte aligned) is copied by the wrapper, not misread.
    flat = torch.randn(B * L * H * D + 4, device="cuda", dtype=torch.bfloat16)
    q2 = flat[4:].view(B, L, H, D)
    out2 = fa.flash_attention(q2, k, v)
    check(out2, None, q2, k, v, "misaligned view")


def test_lse_and_empty_rows():
    """Causal with Lq > Lk: the first Lq - Lk rows see no key (zeros, lse -inf)."""
    q, k, v = make(1, 200, 50, 2, 2, 64, torch.bfloat16)
    poison(200 * 2 * 64)
    out, lse = fa.flash_attention(q, k, v, causal=True, return_lse=True)
    assert (out[0, :150] == 0).all() and (lse[0, :, :150] == -math.inf).all()
    check(out, lse, q, k, v, "empty rows", causal=True)


def test_nan_in_a_visible_key_reaches_the_output():
    # (A NaN in a key tile also reaches rows that mask it out, through 0 * NaN in P V, as in
    # flash-attn: a NaN input is never hidden, though it may spread further than the math says.)
    q, k, v = make(1, 64, 64, 1, 1, 64, torch.bfloat16)
    v[0, 10, 0, 3] = float("nan")
    out = fa.flash_attention(q, k, v, causal=True)
    assert out[0, 10:, 0, 3].isnan().all()


def test_bad_input_on_the_device():
    q, k, v = make(1, 8, 8, 2, 2, 72, torch.bfloat16)
    with pytest.raises(ValueError, match=r"^flash_attention: unsupported head size D=72; built: 64, 96, 128, 256 \(add it to specs/flash_attention.yaml\)"):
        fa.flash_attention(q, k, v)
    with pytest.raises(ValueError, match=r"^flash_attention_varlen: unsupported head size D=72"):  # the op names its caller
        cu = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
        fa.flash_attention_varlen(q[0], k[0], v[0], cu, cu, 8, 8)
    q, k, v = make(1, 8, 8, 2, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="k must be a CUDA tensor, got device cpu"):
        fa.flash_attention(q, k.cpu(), v)
    with pytest.raises(ValueError, match="does not match the 8 packed rows"):
        cu = torch.tensor([0, 7], dtype=torch.int32, device="cuda")
        fa.flash_attention_varlen(q[0], k[0], v[0], cu, torch.tensor([0, 8], dtype=torch.int32, device="cuda"), 7, 8)
    with pytest.raises(ValueError, match="flash_attention_with: instance .* does not cover"):
        other = next(n for n in fa.instances() if fa.instance_head_size(n) != 64)
        fa.flash_attention(q, k, v, instance=other)


def test_compile_and_cuda_graph():
    q, k, v = make(2, 256, 256, 4, 2, 128, torch.bfloat16)
    want = fa.flash_attention(q, k, v, causal=True)
    compiled = torch.compile(lambda a, b, c: fa.flash_attention(a, b, c, causal=True) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), want * 2, rtol=0, atol=0)

    lq = torch.tensor([0, 100, 356], dtype=torch.int32, device="cuda")
    qp, kp, vp = q.reshape(-1, 4, 128)[:356], k.reshape(-1, 2, 128)[:356], v.reshape(-1, 2, 128)[:356]
    static = [t.clone() for t in (qp, kp, vp)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fa.flash_attention_varlen(*static, lq, lq, 256, 256, causal=True, validate=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fa.flash_attention_varlen(*static, lq, lq, 256, 256, causal=True, validate=False)
    for seed in range(2):
        new = make(1, 356, 356, 4, 2, 128, torch.bfloat16, seed=seed + 5)
        for s, n in zip(static, (new[0][0], new[1][0], new[2][0])):
            s.copy_(n)
        graph.replay()
        want = fa.flash_attention_varlen(*static, lq, lq, 256, 256, causal=True)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
