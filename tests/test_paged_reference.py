"""Reference tier for paged decode: the float64 gather reference against the seed's token
loop, its layouts and extras, and the wrapper's input checks (meta tensors, no GPU)."""
import pytest
import torch

from attngen import paged, reference


def paged_cache(lens, Hkv, D, block_size, dtype=torch.float64, seed=0, spare=3):
    """A cache whose pages are handed out in shuffled order, plus its block table."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(1, max((n + block_size - 1) // block_size for n in lens))
    num_blocks = len(lens) * max_blocks + spare
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    block_table = order[: len(lens) * max_blocks].reshape(len(lens), max_blocks).contiguous()
    k = torch.randn(num_blocks, block_size, Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(num_blocks, block_size, Hkv, D, generator=g, dtype=dtype)
    return k, v, block_table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (4, 1)])
def test_gather_reference_matches_token_loop(Hq, Hkv):
    lens = [1, 15, 16, 17, 40]
    k, v, bt, cl = paged_cache(lens, Hkv, 8, 16)
    q = torch.randn(len(lens), Hq, 8, dtype=torch.float64)
    want = reference.paged_decode_loops(q, k, v, bt, cl, 0.3)
    got = reference.paged_decode(q, k, v, bt, cl, scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_head_major_layout_is_the_same_cache_transposed():
    k, v, bt, cl = paged_cache([5, 33], 2, 8, 8)
    q = torch.randn(2, 4, 8, dtype=torch.float64)
    nhd = reference.paged_decode(q, k, v, bt, cl)
    hnd = reference.paged_decode(q, k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), bt, cl,
                                 kv_layout="HND")
    torch.testing.assert_close(hnd, nhd, rtol=0, atol=0)


def test_fp8_cache_is_dequantized_by_its_scales():
    k, v, bt, cl = paged_cache([5, 40], 2, 8, 8)
    q = torch.randn(2, 4, 8, dtype=torch.float64)
    k_scale, v_scale = torch.tensor([0.5, 2.0]), torch.tensor([3.0, 0.25])
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e5m2)
    got = reference.paged_decode(q, k8, v8, bt, cl, k_scale=k_scale, v_scale=v_scale)
    want = reference.paged_decode(q, k8.double() * k_scale.double()[:, None], v8.double() * v_scale.double()[:, None],
                                  bt, cl)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_empty_context_gives_zeros_and_extras_change_the_result():
    k, v, bt, cl = paged_cache([0, 20], 1, 8, 8)
    q = torch.randn(2, 2, 8, dtype=torch.float64)
    plain = reference.paged_decode(q, k, v, bt, cl)
    assert torch.count_nonzero(plain[0]) == 0
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    alibi = reference.paged_decode(q, k, v, bt, cl, alibi_slopes=slopes)
    capped = reference.paged_decode(q, k, v, bt, cl, scale=3.0, soft_cap=1.0)
    assert not torch.allclose(alibi[1], plain[1]) and not torch.allclose(capped[1], plain[1])


@pytest.mark.parametrize("Q", [1, 2, 5])
def test_multi_token_queries_are_decodes_of_growing_contexts(Q):
    """Query token i of Q over a context of n tokens is a one-token decode over the first
    n - Q + 1 + i tokens (its own position included); a query with no visible token gets 0."""
    lens = [Q + 3, 17, Q - 1]
    k, v, bt, cl = paged_cache(lens, 2, 8, 8, seed=Q)
    q = torch.randn(len(lens), Q, 4, 8, dtype=torch.float64)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    got = reference.paged_decode(q, k, v, bt, cl, alibi_slopes=slopes, soft_cap=2.0)
    for i in range(Q):
        seen = torch.clamp(cl - Q + 1 + i, min=0).to(torch.int32)
        want = reference.paged_decode(q[:, i], k, v, bt, seen, alibi_slopes=slopes, soft_cap=2.0)
        torch.testing.assert_close(got[:, i], want, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(got[2, 0]) == 0 and torch.count_nonzero(got[2, 1:]) == got[2, 1:].numel()


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_bad_inputs_raise_value_errors_naming_the_argument():
    q, k, v = meta(2, 8, 128), meta(10, 16, 2, 128), meta(10, 16, 2, 128)
    bt, cl = meta(2, 4, dtype=torch.int32), meta(2, dtype=torch.int32)
    good = dict(q=q, k_cache=k, v_cache=v, block_table=bt, context_lens=cl)
    cases = [
        (dict(q=meta(2, 1, 8, 128, 1)), r"q must be \[S, Hq, D\] or \[S, Q, Hq, D\]"),
        (dict(q=meta(2, 8, 128, dtype=torch.float64)), "q has dtype torch.float64; supported"),
        (dict(k_cache=meta(10, 16, 2, 128, dtype=torch.float16)), "k_cache has dtype torch.float16 but q has"),
        (dict(v_cache=meta(10, 16, 2, 64)), "v_cache has head size 64"),
        (dict(v_cache=meta(10, 8, 2, 128)), "k_cache has shape .* but v_cache has"),
        (dict(k_cache=meta(10, 12, 2, 128), v_cache=meta(10, 12, 2, 128)), "block_size 12 is not a power of two"),
        (dict(k_cache=meta(10, 16, 3, 128), v_cache=meta(10, 16, 3, 128)), "Hq=8 is not a multiple of Hkv=3"),
        (dict(block_table=meta(2, 4, dtype=torch.int64)), r"block_table must be int32 \[S=2, max_blocks\]"),
        (dict(block_table=meta(3, 4, dtype=torch.int32)), r"block_table must be int32"),
        (dict(context_lens=meta(2, dtype=torch.float32)), r"context_lens must be int32 \[S=2\]"),
        (dict(q=torch.empty(2, 8, 128, dtype=torch.bfloat16)), "q must be a CUDA tensor, got device cpu"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            paged.paged_decode(**{**good, **change})
    fp8 = dict(k_cache=meta(10, 16, 2, 128, dtype=torch.float8_e4m3fn), v_cache=meta(10, 16, 2, 128, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="an fp8 cache .* needs a float16 or bfloat16 q, got torch.float32"):
        paged.paged_decode(**{**good, **fp8, "q": meta(2, 8, 128, dtype=torch.float32)})
    with pytest.raises(ValueError, match="v_cache has dtype torch.bfloat16 but k_cache has torch.float8_e4m3fn"):
        paged.paged_decode(**{**good, "k_cache": fp8["k_cache"]})
    with pytest.raises(ValueError, match=r"v_scale must be a float32 \[1\] or \[Hkv=2\]"):
        paged.paged_decode(**{**good, **fp8}, v_scale=meta(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="k_scale is given but the cache is torch.bfloat16"):
        paged.paged_decode(**good, k_scale=meta(1, dtype=torch.float32))
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        paged.paged_decode(**good, kv_layout="NDH")
    with pytest.raises(ValueError, match=r"alibi_slopes must be a float \[Hq=8\]"):
        paged.paged_decode(**good, alibi_slopes=meta(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="soft_cap must be a finite number >= 0"):
        paged.paged_decode(**good, soft_cap=-1.0)
    with pytest.raises(ValueError, match=r"k_cache must be 4-D \[num_blocks, Hkv, block_size, D\]"):
        paged.paged_decode(**{**good, "k_cache": meta(10, 2, 128)}, kv_layout="HND")


def test_validate_names_the_bad_entry_and_the_too_long_context():
    k, _, bt, cl = paged_cache([3, 20], 1, 8, 8)   # 8-token pages: 3 blocks per row
    paged.validate_block_table(k, bt, cl)          # as built: fine
    bad = bt.clone()
    bad[1, 2] = k.shape[0]                          # used by the 20-token context
    with pytest.raises(ValueError, match=rf"block_table\[1, 2\] = {k.shape[0]} is outside \[0, {k.shape[0]}\)"):
        paged.validate_block_table(k, bad, cl)
    unused = bt.clone()
    unused[0, 2] = -7                               # the 3-token context uses one block only
    paged.validate_block_table(k, unused, cl)
    with pytest.raises(ValueError, match=r"context_lens\[1\] = 25 is outside \[0, 24\]"):
        paged.validate_block_table(k, bt, torch.tensor([3, 25], dtype=torch.int32))


def test_instance_heads_reads_the_packing_from_the_name():
    assert paged.instance_heads("paged_split_k_d128_vec8_tx16_heads4_hpt2_threads128_tile32_stages3_part512_bf16_sm90a") == 4
    with pytest.raises(ValueError, match="is not a paged_decode instance name"):
        paged.instance_heads("rwkv_fwd_contracted_full_head_n64")
