"""Reference tier for flash attention: the float64 reference against the seed's online-softmax
loop, its masks (bottom-right causal, windows), extras and packed batches, and the wrapper's
input checks (meta tensors, no GPU)."""
import importlib
import math

import pytest
import torch

from attngen import reference

fa = importlib.import_module("attngen.flash_attention")  # the module (attngen.flash_attention is the op)


def qkv(B, Lq, Lk, Hq, Hkv, D, dtype=torch.float64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Lq, Hq, D, generator=g, dtype=dtype)
    k = torch.randn(B, Lk, Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(B, Lk, Hkv, D, generator=g, dtype=dtype)
    return q.to(device), k.to(device), v.to(device)


@pytest.mark.parametrize("Lq,Lk,Hq,Hkv,causal", [(5, 5, 2, 2, False), (5, 5, 4, 2, True), (3, 9, 3, 1, True),
                                                  (9, 3, 2, 1, True), (7, 4, 2, 2, False)])
def test_reference_matches_the_online_softmax_loop(Lq, Lk, Hq, Hkv, causal):
    q, k, v = qkv(2, Lq, Lk, Hq, Hkv, 8)
    out, lse = reference.flash_attention(q, k, v, causal=causal, scale=0.4)
    want = reference.flash_attention_loops(q, k, v, causal=causal, scale=0.4)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    # Rows that see no key (causal with Lq > Lk): zeros and lse -inf.
    empty = out.abs().sum(dim=-1) == 0
    assert (empty.transpose(1, 2) == (lse == -math.inf)).all()
    assert empty.any() == (causal and Lq > Lk)


def test_masks_align_to_the_bottom_right_corner():
    m = reference.attention_mask(2, 4, window_left=-1, window_right=0)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]
    m = reference.attention_mask(4, 4, window_left=1, window_right=1)
    assert m.sum(dim=-1).tolist() == [2, 3, 3, 2]
    m = reference.attention_mask(4, 2, window_left=-1, window_right=0)
    assert m.sum(dim=-1).tolist() == [0, 0, 1, 2]


def test_lse_is_the_log_normaliser():
    q, k, v = qkv(1, 6, 6, 2, 2, 8)
    out, lse = reference.flash_attention(q, k, v, causal=True, alibi_slopes=torch.tensor([0.5, 0.25]),
                                         soft_cap=3.0)
    # Rebuild the output from lse: out = sum_j exp(s_ij - lse_i) v_j.
    s = torch.einsum("bihd,bjhd->bhij", q, k) * 8 ** -0.5
    s = 3.0 * torch.tanh(s / 3.0)
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    s = s - torch.tensor([0.5, 0.25], dtype=torch.float64)[None, :, None, None] * (i - j).abs()
    s = s.masked_fill(j > i, -math.inf)
    rebuilt = torch.einsum("bhij,bjhd->bihd", torch.exp(s - lse[..., None]), v)
    torch.testing.assert_close(rebuilt, out, rtol=1e-12, atol=1e-12)


def test_varlen_reference_is_the_per_sequence_reference():
    lq, lk = [3, 0, 1, 5], [4, 2, 0, 5]
    cq = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
    ck = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lq), 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lk), 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lk), 2, 8, generator=g, dtype=torch.float64)
    out, lse = reference.flash_attention_varlen(q, k, v, cq, ck, causal=True)
    o3, l3 = reference.flash_attention(q[None, 4:9], k[None, 6:11], v[None, 6:11], causal=True)
    torch.testing.assert_close(out[4:9], o3[0])
    torch.testing.assert_close(lse[:, 4:9], l3[0])
    assert (out[3] == 0).all() and (lse[:, 3] == -math.inf).all()  # a row of a sequence with no keys


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("make,message", [
    (lambda: (meta(1, 4, 2, 64, dtype=torch.float32), meta(1, 4, 2, 64, dtype=torch.float32),
              meta(1, 4, 2, 64, dtype=torch.float32)), "q has dtype torch.float32; supported: float16, bfloat16"),
    (lambda: (meta(4, 2, 64), meta(4, 2, 64), meta(4, 2, 64)), "q must be 4-D [B, L, H, D]"),
    (lambda: (meta(1, 4, 6, 64), meta(1, 4, 4, 64), meta(1, 4, 4, 64)), "Hq=6 is not a multiple of Hkv=4"),
    (lambda: (meta(1, 4, 2, 64), meta(1, 4, 2, 32), meta(1, 4, 2, 32)), "k has head size 32 but q has D=64"),
    (lambda: (meta(1, 4, 2, 64), meta(1, 4, 2, 64, dtype=torch.float16), meta(1, 4, 2, 64)),
     "k has dtype torch.float16 but q has torch.bfloat16"),
    (lambda: (meta(1, 4, 2, 64), meta(1, 5, 2, 64), meta(1, 4, 2, 64)), "k has shape (1, 5, 2, 64) but v has"),
    (lambda: (meta(1, 4, 2, 64), meta(2, 4, 2, 64), meta(2, 4, 2, 64)), "k has batch 2 but q has 1"),
    (lambda: (meta(1, 4, 2, 128)[..., ::2], meta(1, 4, 2, 64), meta(1, 4, 2, 64)), "q must have a contiguous last dim"),
    (lambda: (torch.empty(1, 4, 2, 64, dtype=torch.bfloat16), meta(1, 4, 2, 64), meta(1, 4, 2, 64)),
     "q must be a CUDA tensor"),
])
def test_bad_tensors_name_the_argument(make, message):
    q, k, v = make()
    with pytest.raises(ValueError, match="^flash_attention: ") as info:
        fa.flash_attention(q, k, v)
    assert message in str(info.value)


@pytest.mark.parametrize("kwargs,message", [
    ({"window": (4,)}, "window must be a (left, right) pair"),
    ({"window": (-2, 0)}, "window sizes must be >= 0, or -1"),
    ({"scale": 0.0}, "scale must be finite and > 0"),
    ({"soft_cap": -1.0}, "soft_cap must be a finite number >= 0"),
    ({"alibi_slopes": meta(3, dtype=torch.float32)}, "alibi_slopes must be a float [Hq=2]"),
])
def test_bad_options_are_value_errors(kwargs, message):
    q, k, v = meta(1, 4, 2, 64), meta(1, 4, 2, 64), meta(1, 4, 2, 64)
    with pytest.raises(ValueError) as info:
        fa.flash_attention(q, k, v, **kwargs)
    assert message in str(info.value)


def test_varlen_checks():
    q, k, v = meta(9, 2, 64), meta(7, 2, 64), meta(7, 2, 64)
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="cu_seqlens_q must be int32"):
        fa.flash_attention_varlen(q, k, v, cu.long(), cu, 5, 5)
    with pytest.raises(ValueError, match="cu_seqlens_q holds 2 sequences but cu_seqlens_k holds 3"):
        fa.flash_attention_varlen(q, k, v, cu, torch.empty(4, dtype=torch.int32, device="meta"), 5, 5)
    with pytest.raises(ValueError, match=r"max_seqlen_q must be an int in \[0, 9\]"):
        fa.flash_attention_varlen(q, k, v, cu, cu, 10, 5)


def test_cu_seqlens_contents_are_checked():
    q, k = torch.empty(9, 2, 64), torch.empty(7, 2, 64)
    good = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 3, 7], dtype=torch.int32)
    fa.check_cu_seqlens(*good, q, k, 5, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\] = 1; it must be 0"):
        fa.check_cu_seqlens(torch.tensor([1, 4, 9], dtype=torch.int32), good[1], q, k, 5, 4)
    with pytest.raises(ValueError, match="cu_seqlens_k decreases at index 2"):
        fa.check_cu_seqlens(good[0], torch.tensor([0, 5, 4], dtype=torch.int32), q, k, 5, 5)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] = 8 does not match the 9 packed rows of q"):
        fa.check_cu_seqlens(torch.tensor([0, 4, 8], dtype=torch.int32), good[1], q, k, 5, 4)
    with pytest.raises(ValueError, match="longer than max_seqlen q = 4"):
        fa.check_cu_seqlens(*good, q, k, 4, 4)


def test_instance_head_size_reads_the_name():
    assert fa.instance_head_size(
        "flash_attention_mma_sync_d128_block_m128_block_n64_warps8_stages2_swizzle1_qregs0_minb1_bf16_sm90a") == 128
    with pytest.raises(ValueError):
        fa.instance_head_size("paged_single_pass_d128_vec8")


def test_varlen_errors_name_flash_attention_varlen():
    """The packed entry point's own name starts its errors, from the tensor checks to the options."""
    q, k, v = meta(9, 2, 64), meta(7, 2, 64), meta(7, 2, 64)
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    for call, message in (
            (lambda: fa.flash_attention_varlen(q.float(), k, v, cu, cu, 5, 5), "flash_attention_varlen: q has dtype"),
            (lambda: fa.flash_attention_varlen(q, k, v, cu.long(), cu, 5, 5),
             "flash_attention_varlen: cu_seqlens_q must be int32"),
            (lambda: fa.flash_attention_varlen(q, k, v, cu, cu, 5, 5, window=(4,), validate=False),
             "flash_attention_varlen: window must be a (left, right) pair"),
            (lambda: fa.flash_attention_varlen(q, k, v, cu, cu, 5, 5, scale=0.0, validate=False),
             "flash_attention_varlen: scale must be finite")):
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value).startswith(message), str(info.value)
    with pytest.raises(ValueError, match=r"^flash_attention_varlen: cu_seqlens_q\[0\] = 1"):
        fa.check_cu_seqlens(torch.tensor([1, 4, 9], dtype=torch.int32), torch.tensor([0, 3, 7], dtype=torch.int32),
                            torch.empty(9, 2, 64), torch.empty(7, 2, 64), 5, 4)
    with pytest.raises(ValueError, match=r"^flash_attention: window"):   # the padded entry point keeps its own
        fa.flash_attention(meta(1, 4, 2, 64), meta(1, 4, 2, 64), meta(1, 4, 2, 64), window=(4,))


# ---- the backward -------------------------------------------------------------------------------
def kernel_formulas(q, k, v, d_out, d_lse=None, causal=False, scale=None, window=None, alibi_slopes=None,
                    soft_cap=None):
    """The gradients as flash_attention_grad computes them (its params.cuh), in float64 torch:
    P from the saved lse, delta = rowsum(dO * O) - d_lse, dS = P (dP - delta) (1 - t^2) scale,
    dq = dS k, dk = dS^T q and dv = P^T dO summed over the query heads of a group."""
    B, Lq, Hq, D = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    out, lse = reference.flash_attention(q, k, v, causal=causal, scale=scale, window=window,
                                         alibi_slopes=alibi_slopes, soft_cap=soft_cap)
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    qh, oh, doh = (t.transpose(1, 2) for t in (q, out, d_out))                    # [B, Hq, Lq, D]
    kh, vh = (t.transpose(1, 2).repeat_interleave(G, dim=1) for t in (k, v))     # [B, Hq, Lk, D]
    x = (qh @ kh.transpose(-1, -2)) * scale
    slope_of_cap = torch.ones_like(x)
    if soft_cap:
        t = torch.tanh(x / soft_cap)
        x, slope_of_cap = soft_cap * t, 1 - t * t
    if alibi_slopes is not None:
        i = torch.arange(Lq)[:, None] + (Lk - Lq)
        x = x - alibi_slopes[None, :, None, None] * (i - torch.arange(Lk)[None, :]).abs()
    visible = reference.attention_mask(Lq, Lk, left, right)
    base = torch.where(lse == -math.inf, math.inf, lse)[..., None]              # no key: every weight 0
    p = torch.where(visible, torch.exp(x - base), 0.0)
    delta = (doh * oh).sum(-1) - (0 if d_lse is None else d_lse)
    ds = p * (doh @ vh.transpose(-1, -2) - delta[..., None]) * slope_of_cap * scale
    dq = ds @ kh
    dk = (ds.transpose(-1, -2) @ qh).reshape(B, Hkv, G, Lk, D).sum(2)
    dv = (p.transpose(-1, -2) @ doh).reshape(B, Hkv, G, Lk, D).sum(2)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


@pytest.mark.parametrize("Lq,Lk,Hq,Hkv,kwargs", [
    (5, 5, 2, 2, dict()), (6, 4, 4, 2, dict(causal=True)), (3, 9, 3, 1, dict(window=(2, 1))),
    (9, 3, 2, 1, dict(causal=True, soft_cap=1.5)), (7, 7, 2, 1, dict(alibi=True, window=(3, -1))),
    (4, 6, 2, 2, dict(soft_cap=0.7, alibi=True, causal=True, d_lse=True))])
def test_backward_formulas_match_autograd(Lq, Lk, Hq, Hkv, kwargs):
    """The kernel's formulas (soft cap's derivative, the d_lse fold, the group sums, rows without
    keys) against float64 autograd of the reference, which then holds the GPU tier's kernels."""
    kwargs = dict(kwargs)
    q, k, v = qkv(2, Lq, Lk, Hq, Hkv, 8, seed=Lq)
    g = torch.Generator().manual_seed(7)
    d_out = torch.randn(q.shape, generator=g, dtype=torch.float64)
    d_lse = torch.randn(2, Hq, Lq, generator=g, dtype=torch.float64) if kwargs.pop("d_lse", False) else None
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(Hq, generator=g, dtype=torch.float64)
    want = reference.flash_attention_grad(q, k, v, d_out, d_lse, scale=0.6, **kwargs)
    got = kernel_formulas(q, k, v, d_out, d_lse, scale=0.6, **kwargs)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(b).all(), f"{name}: the reference's gradient is not finite"
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    if kwargs.get("causal") and Lq > Lk:  # rows that see no key: zero gradient
        assert want[0][:, :Lq - Lk].abs().max() == 0


def test_reference_gradient_against_finite_differences():
    q, k, v = qkv(1, 4, 5, 2, 1, 4, seed=3)
    slopes = torch.tensor([0.3, 0.1], dtype=torch.float64)

    def f(q, k, v):
        return reference.flash_attention(q, k, v, causal=True, soft_cap=2.0, alibi_slopes=slopes, window=(2, -1))

    assert torch.autograd.gradcheck(f, [t.requires_grad_() for t in (q, k, v)])
