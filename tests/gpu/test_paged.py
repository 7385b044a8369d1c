"""GPU tier for paged decode: every generated instance, and the dispatched op over the issue's
matrix (group sizes 1-8 and 16, 1 to 16 query tokens, context lengths 1 to 32768 in one batch,
shuffled pages, every dtype), against the float64 gather reference; extras, layouts, bad
input, CUDA graphs, torch.compile."""
import pytest
import torch

import attngen
from attngen import paged, reference
from codegen import dispatch, pipeline

from .conftest import family_manifest

pytestmark = pytest.mark.gpu
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
LENGTHS = [1, 15, 16, 17, 1000, 32768]
GROUPS = [1, 2, 3, 4, 5, 6, 7, 8, 16]
QUERY_TOKENS = [1, 2, 5, 16]


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


def make_case(lens, Hq, Hkv, D, dtype, block_size=16, seed=0, layout="NHD", spare=5, Q=None):
    """q ([S, Hq, D], or [S, Q, Hq, D] when Q is given), a cache whose pages are shuffled (and
    interleaved between sequences), block table, lengths; cache rows past each context hold
    NaN, so reading them shows."""
    g = torch.Generator().manual_seed(seed)
    S = len(lens)
    max_blocks = max(1, max((n + block_size - 1) // block_size for n in lens))
    num_blocks = S * max_blocks + spare
    bt = torch.randperm(num_blocks, generator=g)[: S * max_blocks].to(torch.int32).reshape(S, max_blocks)
    q = torch.randn(S, Hq, D, generator=g) if Q is None else torch.randn(S, Q, Hq, D, generator=g)
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
    k, v = (x.float().nan_to_num() if x.dtype in paged.FP8_CACHE_DTYPES else x.nan_to_num() for x in (k, v))
    return reference.paged_decode(q, k, v, bt, cl, kv_layout=layout, **extras)


FP8 = {4: torch.float8_e4m3fn, 5: torch.float8_e5m2}


def quantized(case, fp8_dtype, per_head: bool):
    """The case with its cache stored in fp8 as K / k_scale, V / v_scale (scales that put the
    values near the middle of the fp8 range), and the scales: float32 [Hkv] or [1]."""
    q, k, v, bt, cl = case
    n = k.shape[2] if per_head else 1
    k_scale = torch.linspace(0.02, 0.05, n, device="cuda")
    v_scale = torch.linspace(0.05, 0.03, n, device="cuda")
    k8 = (k.float() / k_scale[:, None]).to(fp8_dtype)
    v8 = (v.float() / v_scale[:, None]).to(fp8_dtype)
    return (q, k8, v8, bt, cl), k_scale, v_scale


def instance_group(params: dict) -> tuple:
    """(G, Q) an instance is tested with: a padded group where it packs heads (the packing
    minus one), and query tokens that spill into a second block of rows for grouped_mma."""
    if "heads" in params:
        heads = params["heads"]
        return (heads - 1 if heads > 2 else heads), 2
    return (16, 3) if params["mt"] == 2 else (7, 3)   # 48 rows: two blocks of 32; 21 rows: two of 16


def instance_case(row: dict, seed: int):
    """(case, extras) for one instance of the manifest: its dtype and head size, the group and
    query tokens of instance_group, the cache in fp8 where the instance reads one."""
    dtype, D = DTYPES[row["dtype"]], row["params"]["d"]
    G, Q = instance_group(row["params"])
    # Two kv heads; contexts around a page, a tile and a partition, and one shorter than Q
    # (its first query tokens see nothing).
    case = make_case([1, 2, 15, 16, 17, 100, 600], 2 * G, 2, D, dtype, seed=seed, Q=Q)
    kv_e = row["params"].get("kv_e", 0)
    if not kv_e:
        return case, {}
    case, k_scale, v_scale = quantized(case, FP8[kv_e], per_head=True)
    return case, {"k_scale": k_scale, "v_scale": v_scale}


def test_every_instance():
    rows = family_manifest("paged")
    assert rows, "no paged instances in the manifest"
    failures, cases = [], {}
    for name, row in sorted(rows.items()):
        dtype = DTYPES[row["dtype"]]
        G, Q = instance_group(row["params"])
        key = (row["dtype"], row["params"]["d"], G, Q, row["params"].get("kv_e", 0))
        if key not in cases:
            case, extras = instance_case(row, seed=sum(key[1:]))
            cases[key] = (case, extras, expected(case, **extras))
        case, extras, want = cases[key]
        poison(want.numel() * 4 + 8 * 2 * G * Q * 2 * row["params"]["d"] * 4)
        got = paged.paged_decode_with(name, *case, **extras)
        try:
            err = worst_rel_err(got, want)
        except AssertionError as bad:
            failures.append(f"{name}: {bad}")
            continue
        if err > TOL[dtype]:
            failures.append(f"{name}: relative error {err:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("block_size", [1, 4, 8, 64])
def test_grouped_instances_at_every_page_size(block_size):
    """grouped_mma copies a thread's rows of a tile in runs of up to 8 consecutive rows, one
    block-table entry a run, where pages hold a run (8 tokens and more), and a row at a time
    otherwise: every 16-bit instance over both, pages shuffled and the cache rows past each
    context NaN (a run that copied them without the zero fill would show)."""
    rows = {n: r for n, r in family_manifest("paged").items() if r["kind"] == "grouped_mma" and r["dtype"] == "bf16"}
    assert rows, "no grouped_mma instances in the manifest"
    failures, cases = [], {}
    for name, row in sorted(rows.items()):
        D, kv_e = row["params"]["d"], row["params"].get("kv_e", 0)
        G, Q = instance_group(row["params"])   # the rows an instance covers
        key = (D, kv_e, G, Q)
        if key not in cases:
            case = make_case([1, 7, 8, 9, 63, 64, 65, 300], 2 * G, 2, D, torch.bfloat16, block_size=block_size,
                             seed=D + block_size, Q=Q)
            extras = {}
            if kv_e:
                case, k_scale, v_scale = quantized(case, FP8[kv_e], per_head=True)
                extras = {"k_scale": k_scale, "v_scale": v_scale}
            cases[key] = (case, extras, expected(case, **extras))
        case, extras, want = cases[key]
        poison(want.numel() * 4 + 8 * 2 * G * Q * 2 * D * 4)
        try:
            err = worst_rel_err(paged.paged_decode_with(name, *case, **extras), want)
        except (AssertionError, ValueError) as bad:
            failures.append(f"{name}: {bad}")
            continue
        if err > TOL[torch.bfloat16]:
            failures.append(f"{name}: relative error {err:.2e}")
    assert not failures, "\n".join(failures)


def test_a_block_table_of_width_zero():
    """No tile is staged, but grouped_mma loads its first tiles' entries before it knows that:
    the bindings point it at the context lengths instead of an empty table; every instance
    returns zeros, and so does the dispatched op."""
    _, k, v, _, _ = make_case([3, 5], 8, 2, 128, torch.bfloat16, seed=11)
    bt = torch.empty(2, 0, dtype=torch.int32, device="cuda")
    cl = torch.zeros(2, dtype=torch.int32, device="cuda")
    for name, row in sorted(family_manifest("paged").items()):
        if row["kind"] == "grouped_mma" and row["dtype"] == "bf16" and row["params"]["d"] == 128 and not row["params"]["kv_e"]:
            G, Q = instance_group(row["params"])
            q = torch.randn(2, Q, 2 * G, 128, device="cuda", dtype=torch.bfloat16)
            poison(q.numel() * 4)
            out = paged.paged_decode_with(name, q, k, v, bt, cl)
            assert torch.count_nonzero(out) == 0 and torch.isfinite(out).all(), name
    q = torch.randn(2, 8, 128, device="cuda", dtype=torch.bfloat16)
    out = attngen.paged_decode(q, k, v, bt, cl)
    assert torch.count_nonzero(out) == 0 and torch.isfinite(out).all()


def matrix():
    """The issue's matrix: every (G, Q) in bf16; the corners and a middle in fp16 and fp32."""
    for G in GROUPS:
        for Q in QUERY_TOKENS:
            yield torch.bfloat16, G, Q
    for dtype in (torch.float16, torch.float32):
        for G, Q in [(1, 1), (3, 2), (7, 5), (8, 1), (16, 16)]:
            yield dtype, G, Q


@pytest.mark.parametrize("dtype,G,Q", list(matrix()))
def test_issue_matrix_group_sizes_and_query_tokens(dtype, G, Q):
    """Hq = 2 G over 2 kv heads, Q query tokens; contexts 1, 15, 16, 17, 1000, 32768 in one
    batch (mixed lengths, shuffled pages), block 16, D 128, through dispatch; and the same batch
    through the CUDA-core single-pass kind."""
    case = make_case(LENGTHS, 2 * G, 2, 128, dtype, seed=G * 17 + Q, Q=Q)
    want = expected(case)
    poison(want.numel() * 4)
    got = attngen.paged_decode(*case)
    err = worst_rel_err(got, want)
    name = covering_instance("single_pass", 128, dtype, G, Q)
    err_single = worst_rel_err(paged.paged_decode_with(name, *case), want)
    print(f"matrix {_dt(dtype)} G{G} Q{Q}: worst relative error {err:.2e} dispatched, {err_single:.2e} single_pass")
    assert err <= TOL[dtype], paged.selected_instance(*case)
    assert err_single <= TOL[dtype], name


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("kv_e", [4, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache(dtype, kv_e, per_head):
    """An fp8 cache (e4m3, e5m2) with per-tensor or per-kv-head scales, through dispatch, at
    group sizes 1, 3, 8 and 1 or 5 query tokens, against the reference on the dequantized cache."""
    for G, Q in [(1, 1), (3, 5), (8, 1)]:
        case, k_scale, v_scale = quantized(make_case(LENGTHS, 2 * G, 2, 128, dtype, seed=G + kv_e, Q=Q),
                                           FP8[kv_e], per_head)
        want = expected(case, k_scale=k_scale, v_scale=v_scale)
        poison(want.numel() * 4)
        got = attngen.paged_decode(*case, k_scale=k_scale, v_scale=v_scale)
        err = worst_rel_err(got, want)
        print(f"fp8 e{kv_e} {_dt(dtype)} G{G} Q{Q} per_head={per_head}: worst relative error {err:.2e}")
        assert err <= TOL[dtype], (G, Q, paged.selected_instance(*case))
    with pytest.raises(ValueError, match="k_scale must be a float32 \\[1\\] or \\[Hkv=2\\]"):
        attngen.paged_decode(*case, k_scale=torch.ones(3, device="cuda"))


@pytest.mark.parametrize("D", [64, 128, 256])
def test_fp8_cache_query_magnitudes(D):
    """Where the grouped kind reads fp8 straight into half MMA operands it scales each bf16 query
    row into half's range: rows far beyond it (1e6), far below its normal range (1e-6), zero,
    and ordinary rows share one CTA, and each must match the reference."""
    G, Q = 8, 1
    case, k_scale, v_scale = quantized(make_case(LENGTHS[:5], 2 * G, 2, D, torch.bfloat16, seed=D), FP8[4], True)
    q = case[0].clone()
    for head, factor in ((0, 1e6), (1, 1e-6), (2, 0.0), (9, 3e4), (10, 1e-30)):
        q[:, head] *= factor
    case = (q, *case[1:])
    want = expected(case, k_scale=k_scale, v_scale=v_scale)
    poison(want.numel() * 4)
    got = attngen.paged_decode(*case, k_scale=k_scale, v_scale=v_scale)
    name = paged.selected_instance(*case)
    assert "_grouped_mma_" in name and "_kv_e4_" in name, name
    err = worst_rel_err(got, want)
    print(f"fp8 e4m3 D{D} query magnitudes 1e-30..1e6: worst relative error {err:.2e} ({name})")
    assert err <= TOL[torch.bfloat16], name


def test_fp8_cache_bad_input():
    case, k_scale, v_scale = quantized(make_case([40, 9], 4, 2, 64, torch.bfloat16), torch.float8_e4m3fn, True)
    q, k8, v8, bt, cl = case
    with pytest.raises(ValueError, match="an fp8 cache .* needs a float16 or bfloat16 q"):
        attngen.paged_decode(q.float(), k8, v8, bt, cl)
    with pytest.raises(ValueError, match="v_cache has dtype torch.float8_e5m2 but k_cache has torch.float8_e4m3fn"):
        attngen.paged_decode(q, k8, v8.float().to(torch.float8_e5m2), bt, cl)
    plain = make_case([40, 9], 4, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="k_scale is given but the cache is torch.bfloat16"):
        attngen.paged_decode(*plain, k_scale=k_scale)


def _dt(dtype):
    return {v: k for k, v in DTYPES.items()}[dtype]


def covering_instance(kind: str, D: int, dtype, G: int, Q: int = 1) -> str:
    """The instance of `kind` that dispatch would take for this shape, by the spec's covers rule."""
    spec, insts = [x for x in pipeline.lower(pipeline.expand(pipeline.load())) if x[0].family == "paged"][0]
    runtime = {"D": D, "G": G, "S": 1, "Q": Q, "KVE": 0, "Hq": G, "Hkv": 1, "L": 4096, "align": 16 // DTYPE_BYTES[dtype],
               "sm_count": 132}
    return dispatch.first_covering(spec, insts, kind, runtime, {"dtype": _dt(dtype)}).name


@pytest.mark.parametrize("D", [64, 80, 96, 112, 192, 256])
@pytest.mark.parametrize("block_size,layout", [(8, "NHD"), (32, "HND"), (16, "HND")])
def test_head_sizes_block_sizes_layouts(D, block_size, layout):
    for dtype in (torch.bfloat16, torch.float32):
        case = make_case([3, 64, 777, 1500], 8, 2, D, dtype, block_size=block_size, layout=layout, seed=D)
        want = expected(case, layout)
        poison(want.numel() * 4)
        got = attngen.paged_decode(*case, kv_layout=layout)
        assert worst_rel_err(got, want) <= TOL[dtype], (D, block_size, layout, dtype)


@pytest.mark.parametrize("Q", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alibi_soft_cap_and_scale(dtype, Q):
    case = make_case([5, 300, 2000], 16, 4, 128, dtype, seed=3, Q=Q)
    slopes = torch.tensor([2.0 ** (-(i + 1) / 2) for i in range(16)], device="cuda")
    for extras in (dict(alibi_slopes=slopes), dict(soft_cap=2.0, scale=0.5), dict(scale=-0.3),
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
    """The softmax must not skip a NaN score: it poisons its heads, as in torch."""
    for kind, dtype in (("single_pass", torch.float32), ("split_k", torch.float32), ("grouped_mma", torch.bfloat16)):
        q, k, v, bt, cl = make_case([40, 1500], 8, 2, 64, dtype, seed=9)
        page, slot = int(bt[1, 20]), 3                # token 323 of sequence 1, kv head 1
        k[page, slot, 1, 5] = float("nan")
        name = next(n for n in paged.instances() if f"_{kind}_d64_" in n and ("_heads4_" in n or "_mt1_" in n)
                    and n.endswith(f"{_dt(dtype)}_sm90a"))
        out = paged.paged_decode_with(name, q, k, v, bt, cl)
        assert out[1, 4:].isnan().all() and not out[0].isnan().any() and not out[1, :4].isnan().any(), kind


def test_bad_input_from_the_kernels_side(monkeypatch):
    # D=44: no instance can be built for it on first use either (16-byte rows)
    q, k, v, bt, cl = make_case([4, 9], 4, 2, 44, torch.bfloat16)
    with pytest.raises(ValueError, match="no instance can be built for D=44"):
        attngen.paged_decode(q, k, v, bt, cl)
    # no building on first use: the dispatch's own error (D=56: tests/gpu/test_jit.py, in the same
    # process, registers D=48)
    monkeypatch.setenv("ATTNGEN_JIT", "0")
    q, k, v, bt, cl = make_case([4, 9], 4, 2, 56, torch.bfloat16)
    with pytest.raises(ValueError, match="unsupported head size or layout: D=56"):
        attngen.paged_decode(q, k, v, bt, cl)
    monkeypatch.delenv("ATTNGEN_JIT")
    q, k, v, bt, cl = make_case([4, 9], 4, 2, 64, torch.bfloat16)
    odd = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape)
    odd.copy_(q)
    with pytest.raises(ValueError, match="vector alignment 1"):
        attngen.paged_decode(odd, k, v, bt, cl)
    with pytest.raises(ValueError, match="context_lens must be int32"):
        attngen.paged_decode(q, k, v, bt, cl.long())
    many = torch.zeros(2, 17, 4, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=r"q has 17 query tokens per sequence .*; supported: 1 to 16"):
        attngen.paged_decode(many, k, v, bt, cl)


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
    for S, Q, Hq, Hkv, D, ctx, dtype in [
            (64, 1, 32, 8, 128, 4096, "bf16"), (8, 1, 32, 32, 128, 32768, "bf16"), (1, 1, 32, 1, 64, 100, "bf16"),
            (300, 1, 8, 8, 256, 1024, "bf16"), (2, 1, 24, 8, 80, 5000, "bf16"), (4, 1, 16, 2, 96, 64, "bf16"),
            (4, 4, 8, 8, 128, 512, "bf16"), (4, 2, 8, 8, 128, 512, "fp16"), (4, 1, 28, 4, 128, 4096, "fp32"),
            (4, 3, 64, 4, 64, 4096, "fp32")]:
        case = make_case([1] * S, Hq, Hkv, D, DTYPES[dtype], Q=Q)
        q, k, v, _, cl = case
        bt = torch.zeros(S, ctx // 16, dtype=torch.int32, device="cuda")
        got = paged.selected_instance(q, k, v, bt, cl)
        runtime = {"D": D, "G": Hq // Hkv, "S": S, "Q": Q, "KVE": 0, "Hq": Hq, "Hkv": Hkv, "L": ctx, "align": 8 if dtype != "fp32" else 4,
                   "sm_count": sm}
        want = dispatch.select(spec, insts, runtime, {"dtype": dtype})
        assert got == (want.name if want else ""), (S, Q, Hq, Hkv, D, ctx, dtype)

