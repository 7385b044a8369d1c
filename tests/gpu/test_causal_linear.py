"""GPU tier: every generated causal-linear instance against the float64 reference."""
import math

import pytest
import torch

import attngen
from attngen import reference

from .conftest import DTYPES, TOL, rel_err

pytestmark = pytest.mark.gpu


def poison_allocator(shape, dtype):
    """Fill a block of the size the op will allocate with NaN and free it, so the caching
    allocator hands the op poisoned memory: unwritten output elements show up as NaN."""
    block = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    del block


def inputs(B, H, L, E, M, dtype, layout="bhle", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    def make(D):
        if layout == "blhe":  # [B, L, H, D] viewed as [B, H, L, D]: strided, no copy
            return torch.randn(B, L, H, D, device="cuda", generator=g).to(dtype).permute(0, 2, 1, 3)
        return torch.randn(B, H, L, D, device="cuda", generator=g).to(dtype)
    # Scale so outputs stay O(1)-ish whatever L, and fp16 cannot overflow.
    q, k, v = make(E), make(E), make(M)
    return q / math.sqrt(E), k / math.sqrt(max(L, 1)), v


def shape_for(row, dims_below_bucket=False):
    p = row["params"]
    if row["kind"] == "generic":
        return 72, 40  # not a multiple of any bucket: the fallback's job
    E, M = p["e"], p["m"]
    if dims_below_bucket:  # one vector below the bucket: the zero-filled tail
        E, M = E - p.get("vec", 8), M - p.get("vec", 8)
    return E, M


def run_instance(name, q, k, v, reverse):
    poison_allocator(q.shape[:3] + v.shape[3:], q.dtype)
    return attngen.causal_dot_product_with(name, q, k, v, reverse)


def instance_rows(manifest):
    return sorted(manifest)


@pytest.mark.parametrize("L", [1, 7, 113, 1023])
def test_every_instance_small_L(manifest, L):
    failures = []
    for name, row in sorted(manifest.items()):
        dtype = DTYPES[row["dtype"]]
        E, M = shape_for(row, dims_below_bucket=(L == 113))
        q, k, v = inputs(1, 2, L, E, M, dtype, layout="blhe" if L == 7 else "bhle", seed=L)
        reverse = row["direction"] == "rev"
        err = rel_err(run_instance(name, q, k, v, reverse), reference.causal_dot_product(q, k, v, reverse))
        if not err <= TOL[dtype]:
            failures.append(f"{name}: rel err {err:.3g} at L={L} E={E} M={M}")
    assert not failures, "\n".join(failures)


def test_every_instance_L4096(manifest):
    failures = []
    for name, row in sorted(manifest.items()):
        dtype = DTYPES[row["dtype"]]
        E, M = shape_for(row)
        q, k, v = inputs(1, 2, 4096, E, M, dtype, seed=4096)
        reverse = row["direction"] == "rev"
        err = rel_err(run_instance(name, q, k, v, reverse), reference.causal_dot_product(q, k, v, reverse))
        if not err <= TOL[dtype]:
            failures.append(f"{name}: rel err {err:.3g}")
    assert not failures, "\n".join(failures)


CHUNKED_LENGTHS = [1, 7, 63, 64, 65, 1023, 4096]


def test_chunked_every_length(manifest):
    """Every chunked instance at lengths around its 64-step chunk and long enough to split
    time into segments (B * H = 3), forward and reverse; E != M where the buckets differ, one
    vector below the bucket at odd L, [B, L, H, E] views at L = 63. Prints the worst error."""
    failures, worst = [], {}
    for name, row in sorted(manifest.items()):
        if not row["kind"].startswith("chunked"):  # the dispatched kind and its timed candidates
            continue
        dtype = DTYPES[row["dtype"]]
        for L in CHUNKED_LENGTHS:
            E, M = shape_for(row, dims_below_bucket=L % 2 == 1 and L > 1)
            q, k, v = inputs(1, 3, L, E, M, dtype, layout="blhe" if L == 63 else "bhle", seed=L + E)
            reverse = row["direction"] == "rev"
            err = rel_err(run_instance(name, q, k, v, reverse), reference.causal_dot_product(q, k, v, reverse))
            worst[row["dtype"]] = max(worst.get(row["dtype"], 0.0), err)
            if not err <= TOL[dtype]:
                failures.append(f"{name}: rel err {err:.3g} at L={L} E={E} M={M}")
    print(f"\nchunked worst relative error: {worst}")
    assert worst, "no chunked instance in the build"
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_unsplit_and_positive_features(dtype):
    """Enough (b, h) that time is not split, with elu + 1 feature maps (all-positive q, k: the
    state only grows, the case where rounding it for the tensor cores shows most)."""
    B, H, L, E, M = 4, 80, 777, 64, 64
    q, k, v = inputs(B, H, L, E, M, dtype)
    q, k = reference.elu_feature_map(q), reference.elu_feature_map(k)
    assert "_chunked_" in attngen.selected_instance(q, k, v)
    poison_allocator((B, H, L, M), dtype)
    for reverse in (False, True):
        err = rel_err(attngen.causal_dot_product(q, k, v, reverse), reference.causal_dot_product(q, k, v, reverse))
        print(f"\nchunked unsplit elu+1 {dtype} reverse={reverse}: rel err {err:.3g}")
        assert err <= TOL[dtype]


@pytest.mark.parametrize("dtype", list(DTYPES.values()))
@pytest.mark.parametrize("BH,E,M,L", [(2, 64, 32, 1023), (160, 32, 64, 300), (4, 128, 96, 4096),
                                      (3, 200, 24, 77)])
def test_backward_matches_float64_autograd(BH, E, M, L, dtype):
    B, H = (1, BH) if BH < 100 else (4, BH // 4)
    q, k, v = (x.detach().requires_grad_() for x in inputs(B, H, L, E, M, dtype, layout="blhe"))
    out = attngen.causal_dot_product(q, k, v)
    grad = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = reference.causal_dot_product(q64, k64, v64)
    rq, rk, rv = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    tol = TOL[dtype] if dtype == torch.float32 else 2e-2  # grads pass two rounded ops
    for name, got, want in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert rel_err(got, want) <= tol, name


def test_generated_dispatch_matches_its_python_mirror():
    """The C++ table (tuned rules first, then the spec's) and codegen.dispatch agree."""
    from codegen import dispatch, families, pipeline
    spec, built = pipeline.lower(pipeline.expand(pipeline.load()))[0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for B, H, L, E, M in [(1, 4, 64, 64, 64), (1, 8, 4096, 64, 64), (2 * sms, 1, 64, 64, 64), (2, 16, 9000, 48, 64),
                          (4, 8, 2000, 32, 32), (8, 16, 100, 128, 128), (1, 2, 50, 100, 24)]:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            q, k, v = inputs(B, H, L, E, M, dtype)
            runtime = families.family("causal_linear").tune.runtime({"B": B, "H": H, "L": L, "E": E, "M": M}, q.element_size(), sms)
            want = dispatch.select(spec, built, runtime, {"dtype": name, "direction": "fwd"})
            assert attngen.selected_instance(q, k, v) == (want.name if want else ""), (B, H, L, E, M, name)
    odd = inputs(1, 4, 64, 64, 64, torch.float32)
    odd = (odd[0][..., 1:], odd[1][..., 1:], odd[2])  # E = 63, misaligned: generic fallback
    assert "_generic_" in attngen.selected_instance(*odd)


def test_large_BH_result_with_E_not_M():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q, k, v = inputs(2 * sms, 1, 129, 48, 80, torch.float32)
    poison_allocator((2 * sms, 1, 129, 80), torch.float32)
    assert rel_err(attngen.causal_dot_product(q, k, v), reference.causal_dot_product(q, k, v)) <= 1e-5


def test_empty_and_unsupported():
    q, k, v = inputs(1, 2, 0, 32, 32, torch.float32)
    assert attngen.causal_dot_product(q, k, v).shape == (1, 2, 0, 32)
    q, k, v = inputs(1, 1, 4, 2048, 8, torch.float32)
    with pytest.raises(ValueError, match="unsupported shape E=2048"):
        attngen.causal_dot_product(q, k, v)


def test_layers_match_reference():
    B, L, H, E, M = 2, 257, 4, 64, 64
    q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=torch.float64).float() for D in (E, E, M))
    assert rel_err(attngen.causal_linear_attention(q, k, v), reference.causal_linear_attention(q, k, v)) <= 1e-5
    assert rel_err(attngen.linear_attention(q, k, v), reference.linear_attention(q, k, v)) <= 1e-5


def test_torch_compile_fullgraph_forward_and_backward():
    q, k, v = (x.detach().requires_grad_() for x in inputs(1, 4, 100, 64, 64, torch.float32))

    @torch.compile(fullgraph=True)
    def f(q, k, v):
        return (attngen.causal_dot_product(q, k, v) * 2).sum()

    f(q, k, v).backward()
    ref = reference.causal_dot_product(q.detach(), k.detach(), v.detach())
    assert rel_err(attngen.causal_dot_product(q, k, v).detach(), ref) <= 1e-5
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_cuda_graph_capture():
    q, k, v = inputs(2, 4, 300, 64, 64, torch.float32)
    attngen.causal_dot_product(q, k, v)  # warm-up outside capture (smem attribute, lazy load)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attngen.causal_dot_product(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference.causal_dot_product(q, k, v)) <= 1e-5
