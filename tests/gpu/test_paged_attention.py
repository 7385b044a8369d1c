"""GPU tier of paged_attention (attention of packed query tokens over a paged KV cache, on the
flash_attention kernels): against the float64 reference (pages gathered, bottom-right aligned)
with flash-attn's bound (at most 2x the error of torch in the storage dtype, plus 1e-5), on
batches mixing 1, 2, 17, 300 and 2049 query tokens with contexts of 1 to 5000 tokens (a pure
prefill, a context of exactly one block), both cache layouts, block sizes 8, 16, 32, GQA groups
1, 4, 7, 8, head sizes 64, 96, 128, 256; every compiled forward instance forced on a paged
batch; NaN in every cache slot outside the contexts (pages of 8 to 256 rows); window, soft cap,
ALiBi; the lse; outputs poisoned; a bad block id caught by validate. An fp8 cache (e4m3, e5m2;
per-tensor and per-kv-head scales) against the reference on the dequantized cache, through
dispatch and every fp8-cache instance forced."""
import importlib
import math

import pytest
import torch

from attngen import reference

from .conftest import family_manifest

pytestmark = pytest.mark.gpu
pa = importlib.import_module("attngen.paged_attention")  # attngen.paged_attention is also the function
LSE_TOL = 1e-3

# (q_len, context) per sequence: a decode token, two, a chunk onto a long context, a pure prefill,
# a long prefill onto a short cached head, a sequence with no new token, and the context of
# exactly one block (of 16) and of one token.
MIXED = [(1, 1), (2, 16), (17, 5000), (300, 300), (2049, 2100), (0, 40), (1, 777)]


def paged_case(seqs, Hq, Hkv, D, dtype, block_size=16, layout="NHD", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = max(1, max((n + block_size - 1) // block_size for _, n in seqs))
    blocks = len(seqs) * width + 5
    table = torch.randperm(blocks, generator=g, device="cuda")[: len(seqs) * width].to(torch.int32)
    table = table.reshape(len(seqs), width)
    shape = (blocks, block_size, Hkv, D) if layout == "NHD" else (blocks, Hkv, block_size, D)
    k = torch.randn(shape, generator=g, device="cuda").to(dtype)
    v = torch.randn(shape, generator=g, device="cuda").to(dtype)
    q = torch.randn(sum(lq for lq, _ in seqs), Hq, D, generator=g, device="cuda").to(dtype)
    cu = torch.tensor([0] + [sum(lq for lq, _ in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32,
                      device="cuda")
    lens = torch.tensor([n for _, n in seqs], dtype=torch.int32, device="cuda")
    return dict(q=q, k_cache=k, v_cache=v, block_table=table, cu_seqlens_q=cu, context_lens=lens,
                max_seqlen_q=max(lq for lq, _ in seqs), max_context_len=max(n for _, n in seqs)), layout


def check(case, layout, what="", instance=None, **options):
    torch.full((1 << 24,), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison the allocator
    out, lse = pa.paged_attention(**case, kv_layout=layout, return_lse=True, instance=instance, **options)
    assert torch.isfinite(out).all(), f"{what}: output has NaN/Inf (unwritten elements keep the poison)"
    index = {k: case[k] for k in ("q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "context_lens")}
    ref, ref_lse = reference.paged_attention(**index, kv_layout=layout, **options)   # causal by default, as the op
    low, _ = reference.paged_attention(**index, kv_layout=layout, dtype=case["q"].dtype, **options)
    err = (out.double() - ref).abs().max().item()
    bound = 2 * (low.double() - ref).abs().max().item() + 1e-5
    assert err <= bound, f"{what}: max error {err:.3e} > bound {bound:.3e}"
    seen = ref_lse > -math.inf
    assert (lse[~seen] == -math.inf).all(), f"{what}: rows without keys must have lse -inf"
    assert (lse[seen].double() - ref_lse[seen]).abs().max().item() <= LSE_TOL, what
    return err, bound


@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype, layout, block_size, groups", [
    (torch.bfloat16, "NHD", 16, (8, 1)), (torch.bfloat16, "HND", 8, (28, 4)), (torch.float16, "NHD", 32, (14, 2)),
    (torch.bfloat16, "HND", 32, (16, 2))])
def test_mixed_batches_over_the_cache(D, dtype, layout, block_size, groups):
    Hq, Hkv = groups
    case, layout = paged_case(MIXED, Hq, Hkv, D, dtype, block_size, layout, seed=D + block_size)
    check(case, layout, f"D={D} {dtype} {layout} block {block_size} Hq={Hq} Hkv={Hkv}")


INSTANCES = sorted((n, r) for n, r in family_manifest("flash_attention").items()
                   if r["dtype"] != "e4m3" and "kv_e" not in r["params"])  # e4m3 q: no pages; kv_e: an fp8 cache (below)


@pytest.mark.parametrize("name,row", INSTANCES, ids=[n for n, _ in INSTANCES])
def test_every_forward_instance_reads_pages(name, row):
    D, dtype = row["params"]["d"], {"bf16": torch.bfloat16, "fp16": torch.float16}[row["dtype"]]
    case, layout = paged_case([(1, 1), (130, 700), (64, 64), (3, 16)], 8, 2, D, dtype, block_size=16, seed=D)
    check(case, layout, name, instance=name)


def poison_outside_contexts(case, layout, seqs):
    """NaN in every cache slot outside the sequences' contexts: the tails of their last pages and
    the pages no sequence holds."""
    k, v, table, bs = case["k_cache"], case["v_cache"], case["block_table"], case["k_cache"].shape[1 if layout == "NHD" else 2]
    used = torch.zeros(k.shape[0], bs, dtype=torch.bool, device=k.device)
    for s, (_, n) in enumerate(seqs):
        for j in range((n + bs - 1) // bs):
            used[table[s, j].item(), : min(bs, n - j * bs)] = True
    outside = ~used if layout == "NHD" else ~used[:, None, :].expand(-1, k.shape[1], -1)
    k[outside], v[outside] = float("nan"), float("nan")


@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("block_size, layout", [(8, "HND"), (16, "NHD"), (128, "NHD"), (256, "HND")])
def test_cache_slots_outside_the_contexts_are_never_read(D, block_size, layout):
    """The Hopper kernels take a key tile inside a context as TMA boxes of whole pages (a tile's rows
    where pages are longer): with NaN in every slot outside the contexts, the tile where a context
    ends must still leave its page's tail out of P V, and no box may start past a page."""
    seqs = [(300, 300), (17, 1000), (1, 129), (130, 700), (64, 64), (5, 256)]
    case, layout = paged_case(seqs, 8, 2, D, torch.bfloat16, block_size, layout, seed=block_size + D)
    poison_outside_contexts(case, layout, seqs)
    check(case, layout, f"D={D} block {block_size} {layout}, NaN outside the contexts")


@pytest.mark.parametrize("options", [dict(window=(100, 0)), dict(soft_cap=20.0), dict(causal=False),
                                     dict(alibi=True)], ids=["window", "soft_cap", "full", "alibi"])
def test_score_options(options):
    case, layout = paged_case(MIXED[:5], 8, 2, 128, torch.bfloat16, 16, "NHD", seed=3)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(8, device="cuda") * 0.1
    check(case, layout, str(options), **options)


def test_a_bad_block_id_is_caught_by_validate():
    case, layout = paged_case(MIXED[:3], 8, 2, 128, torch.bfloat16)
    case["block_table"][2, 3] = case["k_cache"].shape[0] + 7
    with pytest.raises(ValueError, match=r"^paged_attention: block_table\[2, 3\] = \d+ is outside \[0, \d+\)"):
        pa.paged_attention(**case)


def test_the_op_names_paged_attention_in_its_own_checks():
    case, layout = paged_case(MIXED[:3], 8, 2, 72, torch.bfloat16)
    with pytest.raises(ValueError, match=r"^paged_attention: unsupported head size D=72"):
        pa.paged_attention(**case)


def test_cuda_graph_replay_matches_the_eager_call():
    case, layout = paged_case(MIXED[:5], 8, 2, 128, torch.bfloat16, seed=5)
    want = pa.paged_attention(**case)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        pa.paged_attention(**case, validate=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = pa.paged_attention(**case, validate=False)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("Q", [1, 4, 16])
def test_decode_shaped_batches_run_on_the_decode_kinds(Q):
    """Every sequence with the same Q <= paged.max_query_tokens() tokens, causal, no lse: the call
    is paged_decode's (bit-equal to it) and right against the float64 reference."""
    import attngen
    seqs = [(Q, 1000), (Q, max(Q, 16)), (Q, 3000)]
    case, layout = paged_case(seqs, 32, 8, 128, torch.bfloat16, seed=Q)
    torch.full((1 << 24,), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison the allocator
    out = pa.paged_attention(**case)
    S = len(seqs)
    want = attngen.paged_decode(case["q"].view(S, Q, 32, 128), case["k_cache"], case["v_cache"], case["block_table"],
                                case["context_lens"])
    assert torch.equal(out, want.view(out.shape))
    index = {k: case[k] for k in ("q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "context_lens")}
    ref, _ = reference.paged_attention(**index)
    low, _ = reference.paged_attention(**index, dtype=torch.bfloat16)
    err, bound = (out.double() - ref).abs().max().item(), 2 * (low.double() - ref).abs().max().item() + 1e-5
    assert err <= bound, (err, bound)


# ---- an fp8 cache ------------------------------------------------------------------------------
FP8 = {4: torch.float8_e4m3fn, 5: torch.float8_e5m2}


def fp8_case(case, layout, kv_e, per_head):
    """The case with its cache stored in fp8 as K / k_scale, V / v_scale (scales that put the values
    near the middle of the fp8 range), and the options that pass the scales (float32 [Hkv] or [1])."""
    k, v = case["k_cache"], case["v_cache"]
    Hkv = k.shape[2] if layout == "NHD" else k.shape[1]
    n = Hkv if per_head else 1
    k_scale = torch.linspace(0.02, 0.05, n, device="cuda")
    v_scale = torch.linspace(0.05, 0.03, n, device="cuda")
    per = (lambda f: f[:, None]) if layout == "NHD" else (lambda f: f[:, None, None])   # over (head, ...)
    k8 = (k.float() / per(k_scale)).to(FP8[kv_e])
    v8 = (v.float() / per(v_scale)).to(FP8[kv_e])
    return {**case, "k_cache": k8, "v_cache": v8}, dict(k_scale=k_scale, v_scale=v_scale)


@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype, kv_e, per_head, layout, block_size, groups", [
    (torch.bfloat16, 4, True, "NHD", 16, (8, 1)), (torch.float16, 5, False, "HND", 8, (28, 4)),
    (torch.bfloat16, 5, True, "HND", 32, (14, 2)), (torch.float16, 4, True, "NHD", 32, (16, 2))])
def test_fp8_cache_mixed_batches(D, dtype, kv_e, per_head, layout, block_size, groups):
    Hq, Hkv = groups
    case, layout = paged_case(MIXED, Hq, Hkv, D, dtype, block_size, layout, seed=D + kv_e)
    case, scales = fp8_case(case, layout, kv_e, per_head)
    check(case, layout, f"D={D} {dtype} e{kv_e} per_head={per_head} {layout} block {block_size} Hq={Hq} Hkv={Hkv}",
          **scales)


FP8_INSTANCES = sorted((n, r) for n, r in family_manifest("flash_attention").items() if "kv_e" in r["params"])


@pytest.mark.parametrize("name,row", FP8_INSTANCES, ids=[n for n, _ in FP8_INSTANCES])
def test_every_fp8_cache_instance(name, row):
    D, dtype = row["params"]["d"], {"bf16": torch.bfloat16, "fp16": torch.float16}[row["dtype"]]
    case, layout = paged_case([(1, 1), (130, 700), (64, 64), (3, 16)], 8, 2, D, dtype, block_size=16, seed=D)
    case, scales = fp8_case(case, layout, row["params"]["kv_e"], per_head=True)
    check(case, layout, name, instance=name, **scales)


@pytest.mark.parametrize("options", [dict(window=(100, 0)), dict(soft_cap=20.0), dict(causal=False),
                                     dict(alibi=True)], ids=["window", "soft_cap", "full", "alibi"])
def test_fp8_cache_score_options(options):
    """The soft cap and ALiBi act on q . k in the inputs' values: k_scale applies before them."""
    case, layout = paged_case(MIXED[:5], 8, 2, 128, torch.bfloat16, 16, "NHD", seed=4)
    case, scales = fp8_case(case, layout, 4, per_head=True)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(8, device="cuda") * 0.1
    check(case, layout, str(options), **options, **scales)


def test_fp8_cache_slots_outside_the_contexts_are_never_read():
    seqs = [(300, 300), (17, 1000), (1, 129), (130, 700), (64, 64), (5, 256)]
    case, layout = paged_case(seqs, 8, 2, 128, torch.bfloat16, 16, "NHD", seed=9)
    poison_outside_contexts(case, layout, seqs)
    case, scales = fp8_case(case, layout, 4, per_head=False)   # NaN stays NaN in e4m3
    check(case, layout, "e4m3, NaN outside the contexts", **scales)


def test_fp8_cache_decode_shaped_batches_run_on_the_decode_kinds():
    import attngen
    Q = 4
    seqs = [(Q, 1000), (Q, 16), (Q, 3000)]
    case, layout = paged_case(seqs, 32, 8, 128, torch.bfloat16, seed=11)
    case, scales = fp8_case(case, layout, 5, per_head=True)
    out = pa.paged_attention(**case, **scales)
    want = attngen.paged_decode(case["q"].view(3, Q, 32, 128), case["k_cache"], case["v_cache"], case["block_table"],
                                case["context_lens"], **scales)
    assert torch.equal(out, want.view(out.shape))


def test_fp8_cache_bad_input():
    case, layout = paged_case(MIXED[:3], 8, 2, 128, torch.bfloat16, seed=2)
    fp8, scales = fp8_case(case, layout, 4, per_head=True)
    with pytest.raises(ValueError, match=r"^paged_attention: v_cache has dtype torch.float8_e5m2 but k_cache has "
                                         r"torch.float8_e4m3fn"):
        pa.paged_attention(**{**fp8, "v_cache": fp8["v_cache"].float().to(torch.float8_e5m2)})
    with pytest.raises(ValueError, match=r"^paged_attention: k_scale is given but the cache is torch.bfloat16"):
        pa.paged_attention(**case, k_scale=scales["k_scale"])
    with pytest.raises(ValueError, match=r"^paged_attention: v_scale must be a float32 \[1\] or \[Hkv=2\]"):
        pa.paged_attention(**fp8, v_scale=torch.ones(3, device="cuda"))
    with pytest.raises(ValueError, match=r"^paged_attention: q has dtype torch.float32"):
        pa.paged_attention(**{**fp8, "q": fp8["q"].float()})


@pytest.mark.parametrize("Qd, kv_e", [(1, 0), (4, 0), (1, 4)])
def test_num_decodes_splits_a_mixed_batch(Qd, kv_e):
    """Decodes first (Qd query tokens each), then prefill chunks: with num_decodes the decode rows are
    paged_decode's on those sequences and the rest the prefill kernels' on the others (bit-equal to
    the batch unsplit there), both right against the float64 reference."""
    import attngen
    seqs = [(Qd, 1000), (Qd, 16), (Qd, 3000), (Qd, Qd), (300, 300), (17, 2000), (0, 40), (129, 700)]
    case, layout = paged_case(seqs, 16, 4, 128, torch.bfloat16, seed=13 + Qd)
    scales = {}
    if kv_e:
        case, scales = fp8_case(case, layout, kv_e, per_head=True)
    torch.full((1 << 24,), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison the allocator
    out = pa.paged_attention(**case, num_decodes=4, decode_query_tokens=Qd, **scales)
    whole = pa.paged_attention(**case, **scales)
    rows = 4 * Qd
    want = attngen.paged_decode(case["q"][:rows].view(4, Qd, 16, 128), case["k_cache"], case["v_cache"],
                                case["block_table"][:4], case["context_lens"][:4], **scales)
    assert torch.equal(out[:rows], want.view(rows, 16, 128))
    assert torch.equal(out[rows:], whole[rows:])
    index = {k: case[k] for k in ("q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "context_lens")}
    ref, _ = reference.paged_attention(**index, **scales)
    low, _ = reference.paged_attention(**index, dtype=torch.bfloat16, **scales)
    err, bound = (out.double() - ref).abs().max().item(), 2 * (low.double() - ref).abs().max().item() + 1e-5
    assert err <= bound, (err, bound)
    with pytest.raises(ValueError, match=r"^paged_attention: num_decodes=5 says sequences 0..4 have"):
        pa.paged_attention(**case, num_decodes=5, decode_query_tokens=Qd, **scales)
