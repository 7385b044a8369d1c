"""GPU tier for paged decode: every generated instance, and the dispatched op over the issue's
matrix (context lengths, mixed batches, shuffled pages, every group size of Hq = 32), against
the float64 gather reference; extras, layouts, bad input, CUDA graphs, torch.compile."""
import pytest
import torch

import attngen
from attngen import paged, reference
from codegen import dispatch, pipeline

from .conftest import family_manifest

pytestmark = pytest.mark.gpu
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
LENGTHS = [1, 15, 16, 17, 1000, 32768]


def worst_rel_err(out, ref):
    """The largest per-(sequence, head) relative error; NaN (the poison) fails outright."""
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "output has NaN/Inf (unwritten elements keep the poison)"
    num = (out - ref).norm(dim=-1)
    den = ref.norm(dim=-1)
    empty = den == 0
    assert (num[empty] == 0).all(), "an empty context must give zeros"
    return (num[~empty] / den[~empty]).max().item() if (~empty).any() else 0.0


def poison(numel):
    """Hand the caching allocator NaN-filled blocks, so unwritten outputs show up as NaN."""
    for dtype in (torch.float32, torch.bfloat16):
        torch.full((numel,), float("nan"), dtype=dtype, device="cuda")


def make_case(lens, Hq, Hkv, D, dtype, block_size=16, seed=0, layout="NHD", spare=5):
    """q, a cache whose pages are shuffled (and interleaved between sequences), block table,
    lengths; cache rows past each context hold NaN, so reading them shows."""
    g = torch.Generator().manual_seed(seed)
    S = len(lens)
    max_blocks = max(1, max((n + block_size - 1) // block_size for n in lens))
    num_blocks = S * max_blocks + spare
    bt = torch.randperm(num_blocks, generator=g)[: S * max_blocks].to(torch.int32).reshape(S, max_blocks)
    q = torch.randn(S, Hq, D, generator=g)
    k = torch.full((num_blocks, block_size, Hkv, D), float("nan"))
    v = torch.full((num_blocks, block_size, Hkv, D), float("nan"))
    for s, n in enumerate(lens):
        pages = bt[s, : (n + block_size - 1) // block_size].long()
        for cache in (k, v):
            rows = torch.randn(len(pages) * block_size, Hkv, D, generator=g)
            rows[n:] = float("nan")
            cache[pages] = rows.view(len(pages), block_size, Hkv, D)
    q, k, v = (x.to(dtype).cuda() for x in (q, k, v))
    if layout == "HND":
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    return q, k, v, bt.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


def expected(case, layout="NHD", **extras):
    q, k, v, bt, cl = case
    return reference.paged_decode(q, k.nan_to_num(), v.nan_to_num(), bt, cl, kv_layout=layout, **extras)


def test_every_instance():
    rows = family_manifest("paged")
    assert rows, "no paged instances in the manifest"
    failures, cases = [], {}
    for name, row in sorted(rows.items()):
        dtype, D, heads = DTYPES[row["dtype"]], row["params"]["d"], row["params"]["heads"]
        key = (row["dtype"], D, heads)
        if key not in cases:
            # Two kv heads of `heads` query heads each; contexts around a page, a tile and a partition.
            case = make_case([1, 15, 16, 17, 100, 600], 2 * heads, 2, D, dtype, seed=D + heads)
            cases[key] = (case, expected(case))
        case, want = cases[key]
        poison(want.numel() * 4 + 8 * 2 * heads * 2 * D * 4)
        got = paged.paged_decode_with(name, *case)
        err = worst_rel_err(got, want)
        if err > TOL[dtype]:
            failures.append(f"{name}: relative error {err:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("Hkv", [1, 2, 4, 8, 32])
def test_issue_matrix_every_group_size(dtype, Hkv):
    """Hq = 32 over Hkv; contexts 1, 15, 16, 17, 1000, 32768 in one batch (mixed lengths,
    shuffled pages), block 16, D 128, through dispatch; and the same batch single-pass."""
    case = make_case(LENGTHS, 32, Hkv, 128, dtype, seed=Hkv)
    want = expected(case)
    poison(want.numel() * 4)
    got = attngen.paged_decode(*case)
    assert worst_rel_err(got, want) <= TOL[dtype]
    single = [n for n in paged.instances() if "single_pass_d128_" in n and n.endswith(f"{_dt(dtype)}_sm90a")]
    name = next(n for n in single if (32 // Hkv) % paged.instance_heads(n) == 0)
    assert worst_rel_err(paged.paged_decode_with(name, *case), want) <= TOL[dtype]


def _dt(dtype):
    return {v: k for k, v in DTYPES.items()}[dtype]


@pytest.mark.parametrize("D", [64, 80, 96, 112, 192, 256])
@pytest.mark.parametrize("block_size,layout", [(8, "NHD"), (32, "HND"), (16, "HND")])
def test_head_sizes_block_sizes_layouts(D, block_size, layout):
    for dtype in (torch.bfloat16, torch.float32):
        case = make_case([3, 64, 777, 1500], 8, 2, D, dtype, block_size=block_size, layout=layout, seed=D)
        want = expected(case, layout)
        poison(want.numel() * 4)
        got = attngen.paged_decode(*case, kv_layout=layout)
        assert worst_rel_err(got, want) <= TOL[dtype], (D, block_size, layout, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alibi_soft_cap_and_scale(dtype):
    case = make_case([5, 300, 2000], 16, 4, 128, dtype, seed=3)
    slopes = torch.tensor([2.0 ** (-(i + 1) / 2) for i in range(16)], device="cuda")
    for extras in (dict(alibi_slopes=slopes), dict(soft_cap=2.0, scale=0.5),
                   dict(alibi_slopes=slopes, soft_cap=5.0)):
        want = expected(case, **extras)
        got = attngen.paged_decode(*case, **extras)
        assert worst_rel_err(got, want) <= TOL[dtype], extras


def test_empty_context_strided_q_and_fewer_lengths_than_capacity():
    q, k, v, bt, cl = make_case([0, 40, 0, 9], 8, 8, 64, torch.float32, seed=5)
    wide = torch.randn(4, 8, 3 * 64, device="cuda")
    wide[..., 64:128] = q
    q_view = wide[..., 64:128]                    # strided, 16-byte aligned
    want = expected((q, k, v, bt, cl))
    got = attngen.paged_decode(q_view, k, v, bt, cl)
    assert worst_rel_err(got, want) <= 1e-5
    assert torch.count_nonzero(got[0]) == 0 and torch.count_nonzero(got[2]) == 0


def test_nan_in_the_cache_inside_a_context_reaches_the_output():
    """The softmax must not skip a NaN score (fmaxf would): it poisons its heads, as in torch."""
    for kind in ("single_pass", "split_k"):
        q, k, v, bt, cl = make_case([40, 1500], 8, 2, 64, torch.float32, seed=9)
        page, slot = int(bt[1, 20]), 3                # token 323 of sequence 1, kv head 1
        k[page, slot, 1, 5] = float("nan")
        name = next(n for n in paged.instances() if f"_{kind}_d64_" in n and "_heads4_" in n and n.endswith("fp32_sm90a"))
        out = paged.paged_decode_with(name, q, k, v, bt, cl)
        assert out[1, 4:].isnan().all() and not out[0].isnan().any() and not out[1, :4].isnan().any(), kind


def test_bad_input_from_the_kernels_side():
    q, k, v, bt, cl = make_case([4, 9], 4, 2, 48, torch.bfloat16)
    with pytest.raises(ValueError, match="unsupported head size or layout: D=48"):
        attngen.paged_decode(q, k, v, bt, cl)
    q, k, v, bt, cl = make_case([4, 9], 4, 2, 64, torch.bfloat16)
    odd = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape)
    odd.copy_(q)
    with pytest.raises(ValueError, match="vector alignment 1"):
        attngen.paged_decode(odd, k, v, bt, cl)
    with pytest.raises(ValueError, match="context_lens must be int32"):
        attngen.paged_decode(q, k, v, bt, cl.long())


def test_validate_catches_bad_block_table_and_long_context():
    q, k, v, bt, cl = make_case([4, 40], 4, 2, 64, torch.float32, block_size=8)
    attngen.paged_decode(q, k, v, bt, cl, validate=True)
    bad = bt.clone()
    bad[1, 3] = 10_000
    with pytest.raises(ValueError, match=r"block_table\[1, 3\] = 10000 is outside"):
        attngen.paged_decode(q, k, v, bad, cl, validate=True)
    with pytest.raises(ValueError, match=r"context_lens\[0\] = 41 is outside \[0, 40\]"):
        attngen.paged_decode(q, k, v, bt, torch.tensor([41, 4], dtype=torch.int32, device="cuda"), validate=True)


def test_cuda_graph_replay_follows_new_lengths_and_pages():
    q, k, v, bt, cl = make_case([100, 3000, 7, 2048], 32, 8, 128, torch.bfloat16, seed=11)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attngen.paged_decode(q, k, v, bt, cl)        # warm up (first-use work outside the capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = attngen.paged_decode(q, k, v, bt, cl)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    assert worst_rel_err(out, expected((q, k, v, bt, cl))) <= 1e-2
    cl.copy_(torch.tensor([2000, 5, 2999, 1], dtype=torch.int32))
    bt.copy_(bt.flip(0))                              # other sequences' pages (within their data)
    graph.replay()
    assert worst_rel_err(out, expected((q, k, v, bt, cl))) <= 1e-2


def test_torch_compile_fullgraph():
    case = make_case([10, 700], 8, 2, 128, torch.bfloat16, seed=2)
    f = torch.compile(attngen.paged_decode, fullgraph=True)
    assert worst_rel_err(f(*case), expected(case)) <= 1e-2


def test_dispatch_matches_its_python_mirror():
    spec, insts = [x for x in pipeline.lower(pipeline.expand(pipeline.load())) if x[0].family == "paged"][0]
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for S, Hq, Hkv, D, ctx in [(64, 32, 8, 128, 4096), (8, 32, 32, 128, 32768), (1, 32, 1, 64, 100),
                               (300, 8, 8, 256, 1024), (2, 24, 8, 80, 5000), (4, 16, 2, 96, 64)]:
        case = make_case([1] * S, Hq, Hkv, D, torch.bfloat16)
        q, k, v, _, cl = case
        bt = torch.zeros(S, ctx // 16, dtype=torch.int32, device="cuda")
        got = paged.selected_instance(q, k, v, bt, cl)
        runtime = {"D": D, "G": Hq // Hkv, "S": S, "Hq": Hq, "Hkv": Hkv, "L": ctx, "align": 8, "sm_count": sm}
        want = dispatch.select(spec, insts, runtime, {"dtype": "bf16"})
        assert got == (want.name if want else ""), (S, Hq, Hkv, D, ctx)

