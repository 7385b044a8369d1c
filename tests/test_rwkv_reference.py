"""CPU tier: the RWKV references, and the backward's algebra (the forward's checkpoints, the dv
scan and the r, k, w, u pass) checked against float64 autograd of the naive recurrence, with
each kernel replaced by the reference of its contract. The GPU tier then checks the kernels
against those contracts."""
import functools

import pytest
import torch

from attngen import reference
from attngen.rwkv import wkv_backward


def make(B, T, H, N, seed, w_scale=1.0, state=True):
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(B, T, H, N, generator=g, dtype=torch.float64) for _ in range(3))
    w = -torch.rand(B, T, H, N, generator=g, dtype=torch.float64) * w_scale
    u = torch.randn(H, N, generator=g, dtype=torch.float64)
    s0 = torch.randn(B, H, N, N, generator=g, dtype=torch.float64) if state else None
    return r, k, v, w, u, s0


def test_scan_forward_is_wkv():
    r, k, v, w, u, s0 = make(2, 9, 3, 5, seed=0)
    o, s = reference.wkv(r, k, v, w, u, s0)
    y, final = reference.wkv_scan(r, k, v, w, u, s0)
    torch.testing.assert_close(y, o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, s, rtol=1e-12, atol=1e-12)


def test_wkv_matches_a_literal_loop():
    r, k, v, w, u, s0 = make(1, 4, 1, 3, seed=1)
    o, s = reference.wkv(r, k, v, w, u, s0)
    S = s0[0, 0].clone()
    for t in range(4):
        rt, kt, vt, wt = r[0, t, 0], k[0, t, 0], v[0, t, 0], w[0, t, 0]
        for i in range(3):
            want = sum(rt[j] * (u[0, j] * kt[j] * vt[i] + S[j, i]) for j in range(3))
            assert abs(o[0, t, 0, i] - want) < 1e-12
        S = S * torch.exp(wt)[:, None] + torch.outer(kt, vt)
    torch.testing.assert_close(s[0, 0], S)


EVERY = 3  # checkpoint interval of these tests: several windows, one cut short, within T = 7


def forward_with_checkpoints(r, k, v, w, u, s0):
    B, T, H, N = r.shape
    checkpoints = torch.full((B, H, -(-T // EVERY), N, N), float("nan"), dtype=torch.float64)
    o, final = reference.wkv_scan(r, k, v, w, u, s0, checkpoints=checkpoints, every=EVERY)
    return o, final, checkpoints


def backward_by_contracts(r, k, v, w, u, s0, d_o, d_state):
    _, _, checkpoints = forward_with_checkpoints(r, k, v, w, u, s0)
    grad_rkwu = functools.partial(reference.wkv_grad_rkwu, every=EVERY)
    return wkv_backward(reference.wkv_scan, grad_rkwu, r, k, v, w, u, s0 is not None, checkpoints, d_o, d_state)


def test_checkpoints_hold_the_state_before_every_window():
    r, k, v, w, u, s0 = make(2, 8, 2, 4, seed=4)
    _, _, checkpoints = forward_with_checkpoints(r, k, v, w, u, s0)
    assert checkpoints.shape == (2, 2, 3, 4, 4)
    for n, t in enumerate(range(0, 8, EVERY)):
        _, want = reference.wkv(r[:, :t], k[:, :t], v[:, :t], w[:, :t], u, s0)
        torch.testing.assert_close(checkpoints[:, :, n], want, rtol=1e-12, atol=1e-12)
    # The dr pass's layout (keys as the output axis) writes the same states.
    ck_t = torch.full_like(checkpoints, float("nan"))
    reference.wkv_scan(torch.zeros_like(r), v, k, w, None, s0, False, True, checkpoints=ck_t, every=EVERY)
    torch.testing.assert_close(ck_t, checkpoints, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [1, 2, 7])
@pytest.mark.parametrize("with_state", [True, False])
@pytest.mark.parametrize("w_scale", [1e-3, 3.0, 30.0])
def test_backward_algebra_matches_autograd(T, with_state, w_scale):
    r, k, v, w, u, s0 = make(2, T, 2, 4, seed=T, w_scale=w_scale, state=with_state)
    leaves = [x.clone().requires_grad_() for x in (r, k, v, w, u)]
    s0_leaf = s0.clone().requires_grad_() if with_state else None
    o, s_final = reference.wkv(*leaves, s0_leaf)
    g = torch.Generator().manual_seed(99)
    d_o = torch.randn(o.shape, generator=g, dtype=torch.float64)
    d_state = torch.randn(s_final.shape, generator=g, dtype=torch.float64)
    ((o * d_o).sum() + (s_final * d_state).sum()).backward()
    want = [x.grad for x in leaves] + [s0_leaf.grad if with_state else None]

    got = backward_by_contracts(r, k, v, w, u, s0, d_o, d_state)
    for name, a, b in zip(("dr", "dk", "dv", "dw", "du", "dstate"), got, want):
        if b is None:
            assert a is None, name
            continue
        # dw is relative to its own size: with decays near 0 (w_scale 30) it is ~1e-13.
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10 * float(b.abs().max()), msg=lambda m: f"{name}: {m}")


def test_backward_without_state_gradient():
    r, k, v, w, u, s0 = make(1, 5, 2, 4, seed=5)
    leaves = [x.clone().requires_grad_() for x in (r, k, v, w, u)]
    o, _ = reference.wkv(*leaves, s0)
    d_o = torch.randn(o.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    (o * d_o).sum().backward()
    got = backward_by_contracts(r, k, v, w, u, s0, d_o, None)
    for a, b in zip(got[:5], leaves):
        torch.testing.assert_close(a, b.grad, rtol=1e-10, atol=1e-10)


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_bad_inputs_raise_value_errors_naming_the_argument():
    import attngen
    r = meta(1, 8, 2, 64)
    u = meta(2, 64)
    cases = [
        (dict(k=meta(1, 4, 2, 64)), "k has shape"),
        (dict(v=meta(1, 8, 2, 64, dtype=torch.float16)), "v has dtype"),
        (dict(u=meta(3, 64)), r"u must be \[H, N\]"),
        (dict(state=meta(1, 2, 64, 64, dtype=torch.float64)), "state must be a float32"),
        (dict(state=meta(1, 2, 64, 32)), r"state must be \[B, H, N, N\]"),
        (dict(r=torch.zeros(1, 8, 2, 64)), "r must be a CUDA tensor"),
        (dict(w=meta(1, 8, 2, 64, dtype=torch.int32)), "w has dtype torch.int32; supported"),
    ]
    for change, message in cases:
        args = dict(r=r, k=r, v=r, w=r, u=u, state=None)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            attngen.wkv6(**args)
    with pytest.raises(ValueError, match=r"w must be \[H, N\]"):
        attngen.wkv5(r, r, r, r, u)
    with pytest.raises(ValueError, match="not a multiple of H=3"):
        attngen.wkv6(meta(1, 8, 128), meta(1, 8, 128), meta(1, 8, 128), meta(1, 8, 128), meta(3, 64))


def test_hugging_face_layout_is_a_view():
    from attngen.rwkv import _as_heads
    x = torch.randn(2, 5, 4 * 8)
    y = _as_heads("r", x, 4, "wkv6")
    assert y.shape == (2, 5, 4, 8) and y.data_ptr() == x.data_ptr() and y._base is x
