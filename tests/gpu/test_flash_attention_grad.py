"""GPU tier for the flash attention backward: every generated backward instance, and the gradients
through flash_attention / flash_attention_varlen over the issue's matrix (Lq, Lk in 1, 7, 113,
1023, 4097 with Lq != Lk; GQA groups 1, 4, 7; every head size and dtype; windows, ALiBi, soft
cap; packed batches with lengths 0, 1 and odd; non-contiguous inputs and gradients; the
gradient of the returned lse), torch.compile over a training step and CUDA-graph replay,
against float64 autograd.

Bound (as flash-attn's tests): each gradient's largest error against float64 is at most twice
that of the same computation done by torch autograd in the storage dtype, plus 1e-5 times the
largest gradient element of the call. (The additive term is scaled by all three gradients, not
each one's own: with a single key dk is exactly 0 (dS = P (dP - delta) = 0) and torch's
autograd gets that 0 exactly, while fp32 sums of dP and delta in another order leave 1e-5.) Gradients are poisoned first (NaN-filled allocator blocks), so an element
the kernels never write fails."""
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


def poison(numel):
    """Hand the caching allocator NaN-filled blocks, so unwritten gradients show up as NaN."""
    for dtype in (torch.float32, torch.bfloat16):
        torch.full((numel,), float("nan"), dtype=dtype, device="cuda")


def make(B, Lq, Lk, Hq, Hkv, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Lq, Hq, D, generator=g, device="cuda").to(dtype)
    k = torch.randn(B, Lk, Hkv, D, generator=g, device="cuda").to(dtype)
    v = torch.randn(B, Lk, Hkv, D, generator=g, device="cuda").to(dtype)
    d_out = torch.randn(B, Lq, Hq, D, generator=g, device="cuda").to(dtype)
    return q, k, v, d_out


def check_grads(got, q, k, v, d_out, what, d_lse=None, ref_fn=None, **kwargs):
    """dq, dk, dv from the kernels against float64 autograd, with the module docstring's bound.
    Returns the worst error / bound."""
    ref_fn = ref_fn or reference.flash_attention_grad
    want = ref_fn(q, k, v, d_out, d_lse, **kwargs)
    low = ref_fn(q, k, v, d_out, d_lse, dtype=q.dtype, **kwargs)
    worst = 0.0
    size = max([1.0] + [w.abs().max().item() for w in want if w.numel()])
    for name, g, w, l in zip(("dq", "dk", "dv"), got, want, low):
        assert g.shape == w.shape and g.dtype == q.dtype, f"{what}: {name} is {g.dtype} {tuple(g.shape)}"
        assert torch.isfinite(g).all(), f"{what}: {name} has NaN/Inf (unwritten elements keep the poison)"
        err = (g.double() - w).abs().max().item() if g.numel() else 0.0
        bound = 2 * ((l.double() - w).abs().max().item() if g.numel() else 0.0) + 1e-5 * size
        assert err <= bound, f"{what}: {name} max error {err:.3e} > bound {bound:.3e}"
        worst = max(worst, err / bound)
    return worst


def grads_through_the_op(q, k, v, d_out, d_lse=None, **kwargs):
    """dq, dk, dv of sum(out * d_out) (+ sum(lse * d_lse)) through flash_attention's autograd."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fa.flash_attention(*leaves, return_lse=True, **kwargs)
    loss = (out.float() * d_out.float()).sum()
    if d_lse is not None:
        loss = loss + (lse.masked_fill(lse == -math.inf, 0.0) * d_lse).sum()
    poison(q.numel() * 4)
    loss.backward()
    return [t.grad for t in leaves]


# ---- every instance ------------------------------------------------------------------------
INSTANCES = sorted(family_manifest("flash_attention_grad", bench=True).items())   # the bench-role candidates too


@pytest.mark.parametrize("name,row", INSTANCES, ids=[n for n, _ in INSTANCES])
def test_every_instance(name, row):
    D, dtype = row["params"]["d"], DTYPES[row["dtype"]]
    for causal, (Lq, Lk), (Hq, Hkv) in ((False, (113, 300), (4, 1)), (True, (300, 300), (2, 2)),
                                        (True, (77, 200), (7, 1)), (True, (200, 77), (2, 1))):
        q, k, v, d_out = make(2, Lq, Lk, Hq, Hkv, D, dtype, seed=Lq)
        out, lse = fa.flash_attention(q, k, v, causal=causal, return_lse=True)
        poison(2 * Lq * Hq * D * 2)
        scale = D ** -0.5
        got = fa.GRAD.forced(name, q, k, v, out, d_out, lse, None, None, None, Lq, Lk, scale, -1,
                             0 if causal else -1, None, 0.0, False)
        check_grads(got, q, k, v, d_out, f"{name} causal={causal} Lq={Lq} Lk={Lk}", causal=causal)


# ---- through the op, over the matrix -----------------------------------------------------------
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
        if max(Lq, Lk) > 4000 and (G > 1 or D > 128):  # the float64 reference's memory and time
            G, Hkv = 1, 1
        B = 2 if max(Lq, Lk) < 2000 else 1
        q, k, v, d_out = make(B, Lq, Lk, G * Hkv, Hkv, D, DTYPES[dtype], seed=n)
        got = grads_through_the_op(q, k, v, d_out, causal=causal)
        worst = max(worst, check_grads(got, q, k, v, d_out, f"Lq={Lq} Lk={Lk} G={G}", causal=causal))
    print(f"D={D} {dtype} causal={causal}: worst error / bound {worst:.3f}")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("extras", [
    {"window": (100, 0)}, {"window": (32, 16)}, {"window": (-1, 40)}, {"window": (0, 0)},
    {"causal": True, "window": (50, -1)},
    {"alibi": True}, {"alibi": True, "causal": True}, {"soft_cap": 5.0}, {"soft_cap": 2.0, "alibi": True, "window": (64, 8)},
    {"scale": 0.3, "causal": True},
], ids=lambda e: "-".join(f"{k}{v}" for k, v in e.items()))
def test_windows_alibi_soft_cap(D, dtype, extras):
    extras = dict(extras)
    for Lq, Lk in ((300, 300), (130, 517), (517, 130)):
        q, k, v, d_out = make(2, Lq, Lk, 4, 2, D, DTYPES[dtype], seed=Lq + Lk)
        kwargs = {k_: v_ for k_, v_ in extras.items() if k_ != "alibi"}
        if extras.get("alibi"):
            kwargs["alibi_slopes"] = torch.rand(4, device="cuda") * 0.5
        got = grads_through_the_op(q, k, v, d_out, **kwargs)
        check_grads(got, q, k, v, d_out, f"{extras} Lq={Lq} Lk={Lk}", **kwargs)


@pytest.mark.parametrize("D", [96, 256])
def test_extras_at_the_other_head_sizes(D):
    q, k, v, d_out = make(1, 257, 190, 4, 1, D, torch.bfloat16, seed=D)
    kwargs = dict(soft_cap=3.0, alibi_slopes=torch.rand(4, device="cuda") * 0.3, window=(70, 20), causal=True)
    got = grads_through_the_op(q, k, v, d_out, **kwargs)
    check_grads(got, q, k, v, d_out, f"D={D} extras", **kwargs)


def test_gradient_of_the_returned_lse():
    """A loss that reads lse too: its gradient folds into delta (d lse_i / d s_ij = P_ij)."""
    q, k, v, d_out = make(2, 150, 170, 4, 2, 128, torch.bfloat16, seed=3)
    d_lse = torch.randn(2, 4, 150, device="cuda")
    got = grads_through_the_op(q, k, v, d_out, d_lse, causal=True)
    check_grads(got, q, k, v, d_out, "with d_lse", d_lse=d_lse, causal=True)


def test_gradient_of_the_lse_alone():
    """A loss of lse alone: the output's gradient comes as None (not materialized) and counts as zero."""
    q, k, v, d_out = make(2, 150, 170, 4, 2, 64, torch.bfloat16, seed=4)
    d_lse = torch.randn(2, 4, 150, device="cuda")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    _, lse = fa.flash_attention(*leaves, return_lse=True, causal=True)
    got = torch.autograd.grad((lse.masked_fill(lse == -math.inf, 0.0) * d_lse).sum(), leaves)
    check_grads(got, q, k, v, torch.zeros_like(d_out), "lse alone", d_lse=d_lse, causal=True)


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
    q, d_out = (torch.randn(sum(lq), 8, D, generator=g, device="cuda").to(dt) for _ in range(2))
    k, v = (torch.randn(sum(lk), 2, D, generator=g, device="cuda").to(dt) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fa.flash_attention_varlen(*leaves, cq, ck, max(lq), max(lk), causal=causal)
    poison(q.numel() * 4)
    out.backward(d_out)
    got = [t.grad for t in leaves]

    def per_sequence(q, k, v, d_out, d_lse, dtype=torch.float64, **kwargs):
        grads = [torch.zeros(t.shape, dtype=dtype, device="cuda") for t in (q, k, v)]
        for b in range(len(lq)):
            qs, ks = slice(sum(lq[:b]), sum(lq[:b + 1])), slice(sum(lk[:b]), sum(lk[:b + 1]))
            if lq[b] == 0 or lk[b] == 0:
                continue
            dq, dk, dv = reference.flash_attention_grad(q[None, qs], k[None, ks], v[None, ks], d_out[None, qs],
                                                        dtype=dtype, **kwargs)
            grads[0][qs], grads[1][ks], grads[2][ks] = dq[0], dk[0], dv[0]
        return grads

    check_grads(got, q, k, v, d_out, f"varlen D={D}", ref_fn=per_sequence, causal=causal)
    assert (got[1][sum(lk[:4]):sum(lk[:5])].double().abs().sum() > 0)  # keys a 1-row sequence sees


def test_strided_inputs_and_gradients():
    """q from a [B, H, L, D] tensor, k and v slices of one packed kv tensor, a gradient that is a
    transposed view and one whose rows start mid-row (copied by the wrapper)."""
    B, L, H, D = 2, 333, 4, 128
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    kv = torch.randn(B, L, 2, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = kv[:, :, 0], kv[:, :, 1]
    d_out = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    got = grads_through_the_op(q, k, v, d_out, causal=True)
    check_grads(got, q, k, v, d_out, "strided", causal=True)
    flat = torch.randn(B * L * H * D + 4, device="cuda", dtype=torch.bfloat16)
    d_out2 = flat[4:].view(B, L, H, D)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    fa.flash_attention(*leaves).backward(d_out2)
    check_grads([t.grad for t in leaves], q, k, v, d_out2, "misaligned gradient")


@pytest.mark.parametrize("D", HEAD_SIZES)
@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window": (300, 50), "soft_cap": 4.0}],
                         ids=["full", "causal", "window-softcap"])
def test_deterministic_gradients_are_bit_identical(D, kwargs):
    """deterministic=True: dq's additions in a fixed order of key blocks, so two runs give the same bits (many
    key blocks and a GQA group add to each query row), and within the bound."""
    q, k, v, d_out = make(2, 1100, 1300, 8, 2, D, torch.bfloat16, seed=D)
    first = grads_through_the_op(q, k, v, d_out, deterministic=True, **kwargs)
    for _ in range(2):
        again = grads_through_the_op(q, k, v, d_out, deterministic=True, **kwargs)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between two deterministic runs"
    check_grads(first, q, k, v, d_out, f"deterministic D={D} {kwargs}", **kwargs)


@pytest.mark.parametrize("D", HEAD_SIZES)
def test_deterministic_causal_with_rows_that_see_no_key(D):
    """Causal with Lq > Lk (the first 200 rows see no key) and a partial last query tile: each
    tile's dq order counts exactly the key blocks that visit it (dq_rank; a miscount would leave a
    block waiting for a turn that never comes)."""
    q, k, v, d_out = make(2, 1300, 1100, 8, 2, D, torch.bfloat16, seed=D + 1)
    first = grads_through_the_op(q, k, v, d_out, deterministic=True, causal=True)
    again = grads_through_the_op(q, k, v, d_out, deterministic=True, causal=True)
    for name, a, b in zip(("dq", "dk", "dv"), first, again):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"
    check_grads(first, q, k, v, d_out, f"deterministic causal Lq > Lk D={D}", causal=True)


def test_deterministic_varlen():
    lq, lk = [0, 1, 700, 333], [5, 1, 900, 0]
    cq = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    ck = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, d_out = (torch.randn(sum(lq), 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(sum(lk), 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fa.flash_attention_varlen(*leaves, cq, ck, max(lq), max(lk), causal=True, deterministic=True).backward(d_out)
        runs.append([t.grad for t in leaves])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert (runs[0][0][sum(lq[:3]):] == 0).all()  # the last sequence has no keys


def test_rows_without_keys_get_zero_gradients():
    q, k, v, d_out = make(1, 200, 50, 2, 2, 64, torch.bfloat16)
    dq, dk, dv = grads_through_the_op(q, k, v, d_out, causal=True)
    assert (dq[0, :150] == 0).all()
    check_grads((dq, dk, dv), q, k, v, d_out, "empty rows", causal=True)


def test_bad_input_on_the_device():
    q, k, v, d_out = make(1, 8, 8, 2, 2, 64, torch.bfloat16)
    out, lse = fa.flash_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"flash_attention_grad: lse must be float32 \[1, 2, 8\]"):
        fa.GRAD(q, k, v, out, d_out, lse[:, :, :4], None, None, None, 8, 8, 0.125, -1, -1, None, 0.0)
    with pytest.raises(ValueError, match="flash_attention_grad: d_out has shape"):
        fa.GRAD(q, k, v, out, d_out[:, :4], lse, None, None, None, 8, 8, 0.125, -1, -1, None, 0.0)
    with pytest.raises(ValueError, match="flash_attention_grad: o has dtype"):
        fa.GRAD(q, k, v, out.half(), d_out, lse, None, None, None, 8, 8, 0.125, -1, -1, None, 0.0)


def test_compile_training_step_and_cuda_graph():
    q, k, v, d_out = make(2, 256, 256, 4, 2, 128, torch.bfloat16)

    def step(q, k, v):
        return (fa.flash_attention(q, k, v, causal=True).float() * d_out.float()).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    step(*leaves).backward()
    want = [t.grad.clone() for t in leaves]
    compiled = torch.compile(step, fullgraph=True)
    leaves2 = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves2).backward()
    for w, t in zip(want, leaves2):
        torch.testing.assert_close(t.grad, w, rtol=0, atol=0.05)  # dq's atomics add in any order

    static = [t.clone().requires_grad_() for t in (q, k, v)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            for t in static:
                t.grad = None
            step(*static).backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for t in static:
        t.grad = None
    with torch.cuda.graph(graph):
        step(*static).backward()
    for seed in range(2):
        new = make(2, 256, 256, 4, 2, 128, torch.bfloat16, seed=seed + 5)
        with torch.no_grad():
            for s, n in zip(static, new[:3]):
                s.copy_(n)
        graph.replay()
        fresh = [t.clone().requires_grad_() for t in new[:3]]
        step(*fresh).backward()
        for s, f in zip(static, fresh):
            torch.testing.assert_close(s.grad, f.grad, rtol=0, atol=0.05)
