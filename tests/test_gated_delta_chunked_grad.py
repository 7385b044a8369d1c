"""attngen.gated_delta_chunked_grad (Gated DeltaNet's backward by chunks, batched torch
products over every chunk at once) against float64 autograd through the step-by-step
recurrence: in float64 to rounding, in float32 within the fp32 tolerance; partial chunks, the
initial state and the final state's gradient, decays near 1 and near 0, slabs smaller than the
batch. Runs on the CPU (no extension needed)."""
import pytest
import torch

from attngen import gated_delta_chunked_grad as chunked_grad
from attngen import reference

CHUNK = 64  # the forward's checkpoint interval, as the extension is built


def _inputs(B, T, H, K, V, decay, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64) * (0.05 if decay == "near1" else 8.0)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    state = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    d_o = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    d_state = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, state, d_o, d_state


def _checkpoints(q, k, v, g, beta, state, scale):
    """The states before each chunk, as the forward's checkpoints hold them: [B, H, n, K, V]."""
    before, S = [], state
    for start in range(0, q.shape[1], CHUNK):
        before.append(S)
        part = slice(start, start + CHUNK)
        _, S = reference.gated_delta_rule(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], state=S,
                                          scale=scale)
    return torch.stack(before, dim=2)


def _autograd(q, k, v, g, beta, state, d_o, d_state, scale):
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, state)]
    o, final = reference.gated_delta_rule(*leaves[:5], state=leaves[5], scale=scale)
    return torch.autograd.grad((o * d_o).sum() + (final * d_state).sum(), leaves)


NAMES = ("dq", "dk", "dv", "dg", "dbeta", "d_state0")


@pytest.mark.parametrize("T", [1, 63, 64, 65, 150])
@pytest.mark.parametrize("decay", ["near1", "near0"])
def test_float64_equals_autograd_of_the_recurrence(T, decay):
    q, k, v, g, beta, state, d_o, d_state = _inputs(2, T, 3, 8, 6, decay, seed=T)
    want = _autograd(q, k, v, g, beta, state, d_o, d_state, 0.6)
    checkpoints = _checkpoints(q, k, v, g, beta, state, 0.6)
    got = chunked_grad.gated_delta_chunked_backward(q, k, v, g, beta, d_o, checkpoints, d_state, 0.6, True, CHUNK,
                                                    dtype=torch.float64)
    for name, x, y in zip(NAMES, got, want):
        assert x.shape == y.shape, name
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


def test_float32_within_the_fp32_tolerance_and_slabs_split_the_chunks(monkeypatch):
    """In float32 (what runs on the GPU) at head size 64, 3 chunks a head, with slabs of 2
    chunks so that both batched stages cut the batch unevenly: within 1e-5 of float64 relative
    to each gradient's largest entry; no final-state gradient and no initial state's wanted."""
    B, T, H, K, V = 2, 150, 2, 64, 32
    q, k, v, g, beta, state, d_o, _ = _inputs(B, T, H, K, V, "near1", seed=11)
    want = _autograd(q, k, v, g, beta, state, d_o, torch.zeros_like(state), 0.125)
    checkpoints = _checkpoints(q, k, v, g, beta, state, 0.125).float()
    monkeypatch.setattr(chunked_grad, "_SLAB_ELEMENTS", 2 * K * V)
    got = chunked_grad.gated_delta_chunked_backward(*(x.float() for x in (q, k, v, g, beta, d_o)), checkpoints,
                                                    None, 0.125, False, CHUNK)
    assert got[-1] is None
    for name, x, y in zip(NAMES, got[:-1], want):
        assert x.dtype == torch.float32, name
        err = (x.double() - y).abs().max() / y.abs().max()
        assert err < 1e-5, f"{name}: {err:.2e}"


def test_gradients_come_in_the_inputs_dtypes():
    q, k, v, g, beta, state, d_o, d_state = _inputs(1, 70, 1, 16, 16, "near1", seed=2)
    checkpoints = _checkpoints(q, k, v, g, beta, state, 0.25).float()
    got = chunked_grad.gated_delta_chunked_backward(q.bfloat16(), k.bfloat16(), v.bfloat16(), g.float(),
                                                    beta.float(), d_o.bfloat16(), checkpoints, d_state.float(), 0.25,
                                                    True, CHUNK)
    assert [x.dtype for x in got] == [torch.bfloat16] * 3 + [torch.float32] * 3
