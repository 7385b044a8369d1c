"""GPU tier: every generated wkv scan and backward instance against the float64 contract, and wkv5/wkv6
forward and backward (through the dispatch) against float64 autograd of the naive recurrence."""
import pytest
import torch

import attngen
from attngen import reference, rwkv

from .conftest import DTYPES, TOL, log_decays, poison, rel_err

pytestmark = pytest.mark.gpu
MODES = [(False, False), (False, True), (True, False), (True, True)]  # (reverse, keys_output)


def wkv_inputs(B, T, H, N, dtype, regime="mixed", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r, k, v = (torch.randn(B, T, H, N, device="cuda", generator=g) for _ in range(3))
    k = k / N ** 0.5
    w = log_decays((B, T, H, N), regime, g)
    u = torch.randn(H, N, device="cuda", generator=g) / N ** 0.5
    s0 = torch.randn(B, H, N, N, device="cuda", generator=g) / N ** 0.5
    return [x.to(dtype) for x in (r, k, v, w, u)] + [s0]


def test_every_scan_instance(rwkv_manifest):
    failures, refs = [], {}
    for name, row in sorted(rwkv_manifest.items()):
        dtype, N = DTYPES[row["dtype"]], row["params"]["n"]
        reverse, keys_output = row["direction"] == "rev", row["keys"] == "output"
        for T in (1, 7, 54, 1023):
            q, kc, vo, w, u, s0 = wkv_inputs(1, T, 2, N, dtype, seed=T + N)
            use_u = T != 7            # also without the bonus term
            float_out = T == 54       # fp32 output, as the backward's dr, dk scans
            key = (row["dtype"], N, T, reverse, keys_output)
            if key not in refs:
                ck = None if reverse else torch.zeros(rwkv.checkpoint_shape(1, T, 2, N), device="cuda",
                                                      dtype=torch.float64)
                refs[key] = (*reference.wkv_scan(q, kc, vo, w, u if use_u else None, s0, reverse, keys_output,
                                                 checkpoints=ck, every=rwkv.checkpoint_every()), ck)
            want_y, want_s, want_ck = refs[key]
            poison(q.numel() * 4 + N * N * 4)
            ck = None if reverse else torch.full(rwkv.checkpoint_shape(1, T, 2, N), float("nan"), device="cuda")
            y, s = rwkv.wkv_scan_with(name, q, kc, vo, w, u if use_u else None, s0, reverse, keys_output,
                                      True, float_out, ck)
            assert y.dtype == (torch.float32 if float_out else dtype)
            errs = (rel_err(y, want_y), rel_err(s, want_s), rel_err(ck, want_ck) if ck is not None else 0.0)
            if not max(errs) <= TOL[dtype]:
                failures.append(f"{name}: T={T} rel err y {errs[0]:.3g} state {errs[1]:.3g} checkpoints {errs[2]:.3g}")
    assert not failures, "\n".join(failures)


def test_every_grad_instance(rwkv_grad_manifest):
    """Each backward instance (specs/rwkv_grad.yaml) forced, against the float64 contract on the
    same checkpoints: dr, dk, dw, du and the initial state's gradient, windows cut short too."""
    failures = []
    for name, row in sorted(rwkv_grad_manifest.items()):
        dtype, N = DTYPES[row["dtype"]], row["params"]["n"]
        for T in (1, 65, 300):
            r, k, v, w, u, _ = wkv_inputs(1, T, 2, N, dtype, seed=T + N)
            d_o = torch.randn_like(r)
            d_state = torch.randn(1, 2, N, N, device="cuda") / N ** 0.5
            ck = torch.empty(rwkv.checkpoint_shape(1, T, 2, N), device="cuda")
            reference.wkv_scan(r, k, v, w, u, checkpoints=ck, every=rwkv.checkpoint_every())
            want = reference.wkv_grad_rkwu(r, k, v, w, u, d_o, ck, d_state, True, every=rwkv.checkpoint_every())
            poison(3 * r.numel() + N * N * 4)
            got = torch.ops.attngen.wkv_grad_rkwu_with(r, k, v, w, u, d_o, ck, d_state, True, name)
            errs = [rel_err(g, wt) for g, wt in zip(got, want)]
            if not max(errs) <= TOL[dtype]:
                failures.append(f"{name}: T={T} rel err dr, dk, dw, du, dS0 = {', '.join(f'{e:.3g}' for e in errs)}")
    assert rwkv_grad_manifest and not failures, "\n".join(failures)


def grads_of(fn, inputs, d_o, d_state):
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in inputs]
    o, s = fn(*leaves)
    torch.autograd.backward([o, s], [d_o.to(o.dtype), d_state])
    return o.detach(), s.detach(), [x.grad if x is not None else None for x in leaves]


CASES = [(T, regime, state) for T in (1, 7, 54, 1023) for regime in ("near1", "near0", "mixed")
         for state in (True, False)] + [(4096, "near1", True), (4096, "near0", False), (4096, "mixed", False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("T,regime,with_state", CASES)
def test_wkv6_forward_backward(dtype, T, regime, with_state):
    B, H, N = 2, 2, 64
    r, k, v, w, u, s0 = wkv_inputs(B, T, H, N, dtype, regime, seed=T)
    s0 = s0 if with_state else None
    g = torch.Generator(device="cuda").manual_seed(7)
    d_o = torch.randn(B, T, H, N, device="cuda", generator=g)
    d_state = torch.randn(B, H, N, N, device="cuda", generator=g) / N
    o, s, got = grads_of(attngen.wkv6, [r, k, v, w, u, s0], d_o, d_state)
    ref_in = [x.double() if x is not None else None for x in (r, k, v, w, u, s0)]
    o_ref, s_ref, want = grads_of(reference.wkv, ref_in, d_o.to(dtype).double(), d_state.double())
    tol = TOL[dtype]
    assert o.dtype == dtype and s.dtype == torch.float32
    assert rel_err(o, o_ref) <= tol and rel_err(s, s_ref) <= tol
    for name, a, b in zip(("dr", "dk", "dv", "dw", "du", "dstate"), got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == (torch.float32 if name == "dstate" else dtype), name
        if name == "dw" and T == 1 and not with_state:
            assert not a.any(), "dw_0 = exp(w_0) sum_i dS_0 S_{-1} with S_{-1} = 0 must be exactly 0"
            continue
        if name == "dw" and dtype == torch.float16:
            # dw ~ decay ~ 1e-6 with decays near 0: fp16 holds that only as a subnormal (spacing
            # 6e-8), so the reference is the float64 gradient rounded to fp16.
            b = b.to(dtype)
        err = rel_err(a, b)
        assert err <= tol, f"{name}: rel err {err:.3g}"


def test_dw_with_decays_near_zero():
    """dw ~ 1e-6 here: taken directly, not as a sum of O(1) terms that cancel (fp32 tolerance)."""
    B, T, H, N = 2, 54, 2, 64
    r, k, v, w, u, s0 = wkv_inputs(B, T, H, N, torch.float32, "near0", seed=54)
    d_o = torch.randn(B, T, H, N, device="cuda")
    _, _, got = grads_of(attngen.wkv6, [r, k, v, w, u, s0], d_o, torch.zeros(B, H, N, N, device="cuda"))
    _, _, want = grads_of(reference.wkv, [x.double() for x in (r, k, v, w, u, s0)], d_o.double(),
                          torch.zeros(B, H, N, N, device="cuda", dtype=torch.float64))
    assert rel_err(got[3], want[3]) <= 1e-5


@pytest.mark.parametrize("N", [32, 128, 256])
def test_wkv6_other_head_sizes(N):
    r, k, v, w, u, s0 = wkv_inputs(1, 100, 3, N, torch.float32, seed=N)
    d_o = torch.randn(1, 100, 3, N, device="cuda")
    d_state = torch.randn(1, 3, N, N, device="cuda") / N
    o, s, got = grads_of(attngen.wkv6, [r, k, v, w, u, s0], d_o, d_state)
    o_ref, s_ref, want = grads_of(reference.wkv, [x.double() for x in (r, k, v, w, u, s0)], d_o.double(),
                                  d_state.double())
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-5


def test_wkv5_per_head_decay():
    B, T, H, N = 2, 300, 4, 64
    r, k, v, _, u, s0 = wkv_inputs(B, T, H, N, torch.float32, seed=5)
    w = -torch.rand(H, N, device="cuda") * 0.01
    d_o = torch.randn(B, T, H, N, device="cuda")
    d_state = torch.randn(B, H, N, N, device="cuda") / N
    o, s, got = grads_of(attngen.wkv5, [r, k, v, w, u, s0], d_o, d_state)
    wkv5_ref = lambda r, k, v, w, u, s0: reference.wkv(r, k, v, w.expand(B, T, H, N), u, s0)  # noqa: E731
    o_ref, s_ref, want = grads_of(wkv5_ref, [x.double() for x in (r, k, v, w, u, s0)], d_o.double(), d_state.double())
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5
    assert got[3].shape == (H, N)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-5


def test_hugging_face_layout_runs_without_a_copy():
    B, T, H, N = 2, 50, 4, 64
    r, k, v, w, u, s0 = wkv_inputs(B, T, H, N, torch.bfloat16, seed=1)
    flat = [x.reshape(B, T, H * N) for x in (r, k, v, w)]
    o_flat, s_flat = attngen.wkv6(*flat, u, s0)
    o, s = attngen.wkv6(r, k, v, w, u, s0)
    assert o_flat.shape == (B, T, H * N)
    torch.testing.assert_close(o_flat.view(B, T, H, N), o, rtol=0, atol=0)
    torch.testing.assert_close(s_flat, s, rtol=0, atol=0)
    assert rwkv._as_heads("r", flat[0], H, "t").data_ptr() == flat[0].data_ptr()


def test_chunked_training_matches_one_call():
    """Feeding one call's final state into the next: same outputs and gradients as one call."""
    B, T, H, N = 1, 200, 2, 64
    r, k, v, w, u, s0 = wkv_inputs(B, T, H, N, torch.float32, seed=3)
    d_o = torch.randn(B, T, H, N, device="cuda")
    leaves = [x.clone().requires_grad_() for x in (r, k, v, w, u, s0)]
    o1, _ = attngen.wkv6(*leaves)
    (o1 * d_o).sum().backward()
    whole = [x.grad.clone() for x in leaves]
    for x in leaves:
        x.grad = None
    a, b = slice(0, 77), slice(77, T)
    oa, sa = attngen.wkv6(*(x[:, a] for x in leaves[:4]), leaves[4], leaves[5])
    ob, _ = attngen.wkv6(*(x[:, b] for x in leaves[:4]), leaves[4], sa)
    ((oa * d_o[:, a]).sum() + (ob * d_o[:, b]).sum()).backward()
    torch.testing.assert_close(torch.cat([oa, ob], 1), o1.detach(), rtol=1e-5, atol=1e-5)
    for g1, x in zip(whole, leaves):
        assert rel_err(x.grad, g1) <= 1e-5


def test_decode_step_matches_prefill():
    B, T, H, N = 3, 10, 4, 64
    r, k, v, w, u, s0 = wkv_inputs(B, T, H, N, torch.bfloat16, seed=4)
    o, s = attngen.wkv6(r, k, v, w, u, s0)
    state = s0
    for t in range(T):
        ot, state = attngen.wkv6(r[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], w[:, t:t + 1], u, state)
        torch.testing.assert_close(ot[:, 0].float(), o[:, t].float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(state, s, rtol=1e-4, atol=1e-4)


def test_bad_inputs_name_the_argument(monkeypatch):
    r, k, v, w, u, s0 = wkv_inputs(1, 8, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="k has shape"):
        attngen.wkv6(r, k[:, :4], v, w, u)
    with pytest.raises(ValueError, match="u must be"):
        attngen.wkv6(r, k, v, w, u[:1])
    with pytest.raises(ValueError, match="state must be a float32"):
        attngen.wkv6(r, k, v, w, u, s0.double())
    with pytest.raises(ValueError, match=r"state must be \[B, H, N, N\]"):
        attngen.wkv6(r, k, v, w, u, s0[:, :1])
    with pytest.raises(ValueError, match="w must be <= 0"):
        attngen.wkv6(r, k, v, -w, u, check=True)
    with pytest.raises(ValueError, match="v has dtype"):
        attngen.wkv6(r, k, v.half(), w, u)
    # a head size no instance can be built for (every candidate's thread mapping refuses it)
    x = torch.randn(1, 8, 2, 50, device="cuda")
    with pytest.raises(ValueError, match="no instance can be built for N=50.*tph"):
        attngen.wkv6(x, x, x, -x.abs(), torch.randn(2, 50, device="cuda"))
    monkeypatch.setenv("ATTNGEN_JIT", "0")  # no building on first use: the dispatch's own error
    x = torch.randn(1, 8, 2, 48, device="cuda")
    with pytest.raises(ValueError, match="unsupported head size N=48"):
        attngen.wkv6(x, x, x, -x.abs(), torch.randn(2, 48, device="cuda"))


def test_compile_and_cuda_graph():
    r, k, v, w, u, s0 = wkv_inputs(2, 64, 2, 64, torch.bfloat16, seed=9)
    f = torch.compile(attngen.wkv6, fullgraph=True)
    o, s = f(r, k, v, w, u, s0)
    o2, s2 = attngen.wkv6(r, k, v, w, u, s0)
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    # Training through torch.compile: the checkpoints travel from forward to backward.
    d_o = torch.randn_like(o2)
    loss = lambda *xs: (attngen.wkv6(*xs)[0].float() * d_o).sum()  # noqa: E731
    for x in (r, k, v, w, u):
        x.requires_grad_()
    eager = torch.autograd.grad(loss(r, k, v, w, u, s0), (r, k, v, w, u))
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(r, k, v, w, u, s0), (r, k, v, w, u))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for x in (r, k, v, w, u):
        x.requires_grad_(False)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        attngen.wkv6(r, k, v, w, u, s0)  # warm-up outside capture
        with torch.cuda.graph(graph, stream=stream):
            og, sg = attngen.wkv6(r, k, v, w, u, s0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(og, o2, rtol=0, atol=0)
    torch.testing.assert_close(sg, s2, rtol=0, atol=0)


def test_dispatch_matches_its_python_mirror():
    from codegen import dispatch, pipeline

    spec, insts = [x for x in pipeline.lower(pipeline.expand(pipeline.load())) if x[0].family == "rwkv"][0]
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for B, T, H, N in [(1, 54, 32, 64), (8, 1024, 32, 64), (2, 10, 8, 256), (4, 5, 40, 128), (1, 3, 1, 32)]:
        q = torch.randn(B, T, H, N, device="cuda", dtype=torch.bfloat16)
        for reverse, keys_output in MODES:
            runtime = {"N": N, "T": T, "BH": B * H, "align": 8, "sm_count": sm}
            axes = {"dtype": "bf16", "direction": "rev" if reverse else "fwd",
                    "keys": "output" if keys_output else "contracted"}
            want = dispatch.select(spec, insts, runtime, axes)
            assert rwkv.selected_scan(q, q, q, q, reverse, keys_output) == want.name
