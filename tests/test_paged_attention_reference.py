"""paged_attention on the CPU: the float64 reference equals flash_attention's on the same rows
stored contiguously (pages gathered, bottom-right alignment, HND viewed as NHD), and the
wrapper's checks name paged_attention and the argument (meta tensors: no GPU needed)."""
import importlib

import pytest
import torch

from attngen import reference

pa = importlib.import_module("attngen.paged_attention")  # attngen.paged_attention is also the function


def paged_case(q_lens, ctx, Hq=4, Hkv=2, D=16, bs=4, seed=0, layout="NHD"):
    g = torch.Generator().manual_seed(seed)
    width = max((n + bs - 1) // bs for n in ctx)
    blocks = len(ctx) * width + 3
    table = torch.randperm(blocks, generator=g)[: len(ctx) * width].to(torch.int32).reshape(len(ctx), width)
    shape = (blocks, bs, Hkv, D) if layout == "NHD" else (blocks, Hkv, bs, D)
    k, v = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    q = torch.randn(sum(q_lens), Hq, D, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, table, cu, torch.tensor(ctx, dtype=torch.int32)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_reference_is_flash_attention_on_the_gathered_rows(layout):
    q_lens, ctx = [1, 3, 5, 0], [9, 3, 13, 2]
    q, k, v, table, cu, lens = paged_case(q_lens, ctx, layout=layout)
    out, lse = reference.paged_attention(q, k, v, table, cu, lens, kv_layout=layout, causal=True, soft_cap=3.0)
    nhd_k = k if layout == "NHD" else k.transpose(1, 2)
    nhd_v = v if layout == "NHD" else v.transpose(1, 2)
    for s, (lq, n) in enumerate(zip(q_lens, ctx)):
        if lq == 0:
            continue
        rows = [(int(table[s, j // 4]), j % 4) for j in range(n)]            # page, row in page: by hand
        k_s = torch.stack([nhd_k[b, r] for b, r in rows])[None]
        v_s = torch.stack([nhd_v[b, r] for b, r in rows])[None]
        want, want_lse = reference.flash_attention(q[cu[s]:cu[s + 1]][None], k_s, v_s, causal=True, soft_cap=3.0)
        torch.testing.assert_close(out[cu[s]:cu[s + 1]], want[0], rtol=0, atol=0)
        torch.testing.assert_close(lse[:, cu[s]:cu[s + 1]], want_lse[0], rtol=0, atol=0)
    # a pure prefill (sequence 1: 3 query tokens of 3) is causal from its first key: row 0 sees key 0 only
    page = int(table[1, 0])
    first = reference.flash_attention(q[1:2][None], nhd_k[page, :1][None], nhd_v[page, :1][None])[0]
    torch.testing.assert_close(out[1:2], first[0], rtol=0, atol=0)


def meta_case(**over):
    args = dict(q=torch.empty(9, 4, 64, dtype=torch.bfloat16, device="meta"),
                k_cache=torch.empty(20, 16, 2, 64, dtype=torch.bfloat16, device="meta"),
                v_cache=torch.empty(20, 16, 2, 64, dtype=torch.bfloat16, device="meta"),
                block_table=torch.empty(2, 4, dtype=torch.int32, device="meta"),
                cu_seqlens_q=torch.empty(3, dtype=torch.int32, device="meta"),
                context_lens=torch.empty(2, dtype=torch.int32, device="meta"),
                max_seqlen_q=5, max_context_len=60)
    args.update(over)
    return args


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_an_fp8_cache_is_dequantized_per_kv_head(layout):
    """K = k_scale * k8 and V = v_scale * v8 per kv head ([Hkv]) or for all ([1]), in either layout."""
    q, k, v, table, cu, lens = paged_case([2, 4], [7, 10], layout=layout, seed=3)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e5m2)
    head = 2 if layout == "NHD" else 1   # the kv-head dim of the cache
    for k_scale, v_scale in ((torch.tensor([0.5, 4.0]), torch.tensor([2.0, 0.25])), (torch.tensor([3.0]), None)):
        per = [1] * 4
        per[head] = -1
        want_k = k8.double() * k_scale.double().reshape(per)
        want_v = v8.double() * (1.0 if v_scale is None else v_scale.double().reshape(per))
        out, lse = reference.paged_attention(q, k8, v8, table, cu, lens, kv_layout=layout, k_scale=k_scale, v_scale=v_scale)
        want, want_lse = reference.paged_attention(q, want_k, want_v, table, cu, lens, kv_layout=layout)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


@pytest.mark.parametrize("over, message", [
    (dict(q=torch.empty(9, 4, 64)), "q must be a CUDA tensor"),
    (dict(q=torch.empty(1, 9, 4, 64, dtype=torch.bfloat16, device="meta")), "q must be packed [total_q, Hq, D]"),
    (dict(k_cache=torch.empty(20, 16, 2, 64, dtype=torch.float8_e4m3fn, device="meta")),
     "v_cache has dtype torch.bfloat16 but k_cache has torch.float8_e4m3fn (the cache holds q's dtype, or "
     "float8_e4m3fn / float8_e5m2 for both K and V)"),
    (dict(k_cache=torch.empty(20, 16, 2, 64, dtype=torch.float32, device="meta")),
     "k_cache has dtype torch.float32 but q has torch.bfloat16"),
    (dict(k_scale=torch.ones(1, device="meta")), "k_scale is given but the cache is torch.bfloat16"),
    (dict(k_cache=torch.empty(20, 16, 2, 64, dtype=torch.float8_e5m2, device="meta"),
          v_cache=torch.empty(20, 16, 2, 64, dtype=torch.float8_e5m2, device="meta"), v_scale=torch.ones(3, device="meta")),
     "v_scale must be a float32 [1] or [Hkv=2], got torch.float32 (3,)"),
    (dict(k_cache=torch.empty(20, 12, 2, 64, dtype=torch.bfloat16, device="meta"),
          v_cache=torch.empty(20, 12, 2, 64, dtype=torch.bfloat16, device="meta")), "block_size must be a power of two, at least 8"),
    (dict(block_table=torch.empty(2, 4, dtype=torch.int64, device="meta")), "block_table must be int32 [S, max_blocks]"),
    (dict(context_lens=torch.empty(3, dtype=torch.int32, device="meta")), "context_lens must be int32 [2]"),
    (dict(max_context_len=65), "max_context_len must be an int in [0, 64]"),
    (dict(kv_layout="NDH"), "kv_layout must be one of ('NHD', 'HND')"),
    (dict(window=(3,)), "window must be a (left, right) pair"),
])
def test_errors_name_paged_attention_and_the_argument(over, message):
    with pytest.raises(ValueError) as info:
        pa.paged_attention(**meta_case(**over), validate=False)
    assert str(info.value).startswith(f"paged_attention: {message}"), str(info.value)


def test_validate_reads_the_lengths_and_the_block_ids():
    q, k, v, table, cu, lens = paged_case([2, 3], [5, 3], D=64, bs=4)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    with pytest.raises(ValueError, match=r"^paged_attention: context_lens\[1\] = 2: it must hold the sequence's 3"):
        pa._validate(q, k, table, cu, torch.tensor([5, 2], dtype=torch.int32), 3, 8)
    bad = table.clone()
    bad[0, 1] = 99
    with pytest.raises(ValueError, match=r"^paged_attention: block_table\[0, 1\] = 99 is outside \[0, \d+\) \(used by context_lens\[0\] = 5\)"):
        pa._validate(q, k, bad, cu, lens, 3, 8)
    with pytest.raises(ValueError, match=r"more than max_seqlen_q=2"):
        pa._validate(q, k, table, cu, lens, 2, 8)
    pa._validate(q, k, table, cu, lens, 3, 8)   # the good case passes


def test_decode_shaped_batches_go_to_paged_decode(monkeypatch):
    """Every sequence with the same Q <= the decode kinds' limit, causal, no window, no lse: the
    call is paged_decode's, with q viewed [S, Q, Hq, D] and the answer viewed back; anything else
    stays on the prefill kernels (decided from shapes: nothing is read from the device)."""
    monkeypatch.setattr(pa.paged, "max_query_tokens", lambda: 16)
    calls = []

    def fake_decode(q, k_cache, v_cache, block_table, context_lens, scale, **kwargs):
        calls.append((tuple(q.shape), kwargs["kv_layout"], kwargs["soft_cap"]))
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    monkeypatch.setattr(pa.paged, "paged_decode", fake_decode)
    case = meta_case(q=torch.empty(2 * 4, 4, 64, dtype=torch.bfloat16, device="meta"), max_seqlen_q=4)
    out = pa.paged_attention(**case, soft_cap=5.0, kv_layout="NHD", validate=False)
    assert calls == [((2, 4, 4, 64), "NHD", 5.0)] and out.shape == (8, 4, 64)
    assert pa._decode_shaped(case["q"], case["block_table"], 4, True, None, False)
    for why in (dict(max_seqlen_q=5), dict(causal=False), dict(window=(8, 0)), dict(return_lse=True)):
        args = {**dict(max_seqlen_q=4, causal=True, window=None, return_lse=False), **why}
        assert not pa._decode_shaped(case["q"], case["block_table"], **args), why
    many = torch.empty(2 * 17, 4, 64, dtype=torch.bfloat16, device="meta")
    assert not pa._decode_shaped(many, case["block_table"], 17, True, None, False)  # past the decode kinds' 16


def test_num_decodes_splits_a_mixed_batch_between_the_decode_and_prefill_kernels(monkeypatch):
    """The first num_decodes sequences (decode_query_tokens each) go to paged_decode with their rows
    of q, block_table and context_lens; the rest to the prefill op with cu_seqlens_q shifted to
    start at 0; out is the two in q's order. Not split: an lse asked, a window, not causal."""
    monkeypatch.setattr(pa.paged, "max_query_tokens", lambda: 16)
    decodes, prefills = [], []

    def fake_decode(q, k_cache, v_cache, block_table, context_lens, scale, **kwargs):
        decodes.append((tuple(q.shape), tuple(block_table.shape), tuple(context_lens.shape)))
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device)

    def fake_call(args, instance):
        q, cu, table, lens, max_q = args[0], args[3], args[13], args[14], args[5]
        prefills.append((tuple(q.shape), tuple(cu.shape), tuple(table.shape), tuple(lens.shape), max_q))
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device), torch.zeros(q.shape[1], q.shape[0], device=q.device)
    monkeypatch.setattr(pa.paged, "paged_decode", fake_decode)
    monkeypatch.setattr(pa, "_call", fake_call)
    monkeypatch.setattr(pa, "_register", lambda: None)
    # 5 sequences: 3 decodes of 2 tokens, then 7 and 40 query tokens
    case = meta_case(q=torch.empty(3 * 2 + 47, 4, 64, dtype=torch.bfloat16, device="meta"),
                     block_table=torch.empty(5, 4, dtype=torch.int32, device="meta"),
                     cu_seqlens_q=torch.empty(6, dtype=torch.int32, device="meta"),
                     context_lens=torch.empty(5, dtype=torch.int32, device="meta"), max_seqlen_q=40)
    out = pa.paged_attention(**case, validate=False, num_decodes=3, decode_query_tokens=2)
    assert decodes == [((3, 2, 4, 64), (3, 4), (3,))]
    assert prefills == [((47, 4, 64), (3,), (2, 4), (2,), 40)]
    assert out.shape == (53, 4, 64)
    decodes.clear(), prefills.clear()
    only = {**case, "q": torch.empty(5 * 2, 4, 64, dtype=torch.bfloat16, device="meta"), "max_seqlen_q": 8}   # a loose bound
    assert pa.paged_attention(**only, validate=False, num_decodes=5, decode_query_tokens=2).shape == (10, 4, 64)
    assert decodes == [((5, 2, 4, 64), (5, 4), (5,))] and not prefills
    decodes.clear()
    for whole in (dict(return_lse=True), dict(window=(8, 0)), dict(causal=False)):
        pa.paged_attention(**case, validate=False, num_decodes=3, decode_query_tokens=2, **whole)
        assert not decodes and prefills[-1][0] == (53, 4, 64), whole


@pytest.mark.parametrize("over, message", [
    (dict(num_decodes=6), "num_decodes must be an int in [0, 5]"),
    (dict(num_decodes=2, decode_query_tokens=17), "decode_query_tokens must be an int in [1, 16]"),
    (dict(num_decodes=5, decode_query_tokens=16), "num_decodes=5 sequences of 16 query tokens exceed q's 53 rows"),
    (dict(num_decodes=5, decode_query_tokens=2), "num_decodes=5 is every sequence, but its 2 query tokens each make 10 "
                                                 "of q's 53 rows"),
])
def test_bad_decode_counts_are_named(monkeypatch, over, message):
    monkeypatch.setattr(pa.paged, "max_query_tokens", lambda: 16)
    case = meta_case(q=torch.empty(53, 4, 64, dtype=torch.bfloat16, device="meta"),
                     block_table=torch.empty(5, 4, dtype=torch.int32, device="meta"),
                     cu_seqlens_q=torch.empty(6, dtype=torch.int32, device="meta"),
                     context_lens=torch.empty(5, dtype=torch.int32, device="meta"), max_seqlen_q=40)
    with pytest.raises(ValueError) as info:
        pa.paged_attention(**case, validate=False, **over)
    assert str(info.value).startswith(f"paged_attention: {message}"), str(info.value)


def test_validate_checks_the_decode_count_against_the_lengths():
    cu = torch.tensor([0, 1, 2, 4, 30], dtype=torch.int32)
    pa._validate_decodes(cu, 2, 1)
    with pytest.raises(ValueError, match=r"^paged_attention: num_decodes=3 says sequences 0..2 have 1 query tokens "
                                         r"each, but sequence 2 has 2"):
        pa._validate_decodes(cu, 3, 1)
