"""Kimi Delta Attention (attngen.kda) on the CPU: its float64 reference is the recurrence
flash-linear-attention's naive_recurrent_kda runs, and the tied vectors it hands RWKV-7's
kernels (delta_rule.kda_as_rwkv7) give, through RWKV-7's float64 reference (what those kernels
are tested against), KDA's outputs, final states and every gradient; bad shapes are named."""
import pytest
import torch

import attngen
from attngen import reference
from attngen.delta_rule import kda_as_rwkv7


def _inputs(B=2, T=23, H=2, HV=4, K=6, V=5, decay="mixed", seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    q, k = rand(B, T, H, K), torch.nn.functional.normalize(rand(B, T, H, K), dim=-1)
    scale = {"mixed": 1.0, "strong": 20.0}[decay]
    g = -torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64) * scale
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    return q, k, rand(B, T, HV, V), g, beta, rand(B, HV, K, V)


def test_the_reference_is_the_value_major_recurrence():
    """S'_t = S'_{t-1} diag(alpha_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = scale S'_t q_t
    (S' = S^T, KDA's paper form), with q and k shared by HV / H value heads."""
    q, k, v, g, beta, state = _inputs(B=1, T=7, H=1, HV=2, K=4, V=3)
    out, final = reference.kda(q, k, v, g, beta, state=state, scale=0.6)
    eye = torch.eye(4, dtype=torch.float64)
    for h in range(2):
        S = state[0, h].T.clone()
        for t in range(7):
            kt, bt = k[0, t, 0], beta[0, t, h]
            S = S @ torch.diag(g[0, t, h].exp()) @ (eye - bt * torch.outer(kt, kt)) + bt * torch.outer(v[0, t, h], kt)
            torch.testing.assert_close(out[0, t, h], 0.6 * S @ q[0, t, 0])
        torch.testing.assert_close(final[0, h], S.T)


@pytest.mark.parametrize("decay", ["mixed", "strong"])
def test_kda_is_rwkv7_on_tied_vectors(decay):
    """Outputs, final states and the gradients of q, k, v, g, beta and the initial state."""
    inputs = _inputs(decay=decay)
    leaves = [x.clone().requires_grad_() for x in inputs]
    twins = [x.clone().requires_grad_() for x in inputs]
    got = reference.rwkv7(*kda_as_rwkv7(*leaves[:5]), state=leaves[5], scale=0.7)
    want = reference.kda(*twins[:5], state=twins[5], scale=0.7)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-11)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in want]
    torch.autograd.backward(got, grads)
    torch.autograd.backward(want, grads)
    for name, x, y in zip(("q", "k", "v", "g", "beta", "state"), leaves, twins):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-11, msg=lambda m, name=name: f"d{name}: {m}")


def test_the_ties_round_to_qs_dtype():
    q, k, v, g, beta, _ = (x.float() for x in _inputs())
    tied = kda_as_rwkv7(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta)
    assert all(x.dtype == torch.bfloat16 for x in tied) and tied[0].shape == (2, 23, 4, 6)


@pytest.mark.parametrize("change,message", [
    (lambda x: {**x, "k": x["k"][:, :, :1]}, r"kda: q and k must be \[B, T, H, K\] alike, got \[2, 23, 2, 6\] and "
                                             r"\[2, 23, 1, 6\]"),
    (lambda x: {**x, "v": x["v"][:, :, :3]}, r"kda: v must be \[B=2, T=23, HV, V\] with HV a multiple of H=2, got "
                                             r"\[2, 23, 3, 5\]"),
    (lambda x: {**x, "g": x["g"][..., 0]}, r"kda: g must be \[B, T, HV, K\] = \[2, 23, 4, 6\] \(log decay per key "
                                           r"channel\), got \[2, 23, 4\]"),
    (lambda x: {**x, "beta": x["beta"][:, :, :2]}, r"kda: beta must be \[B, T, HV\] = \[2, 23, 4\], got \[2, 23, 2\]"),
    (lambda x: {**x, "q": None}, r"kda: q must be a torch.Tensor, got NoneType"),
    (lambda x: {**x, "v": x["v"].half()}, r"kda: q, k and v must share one dtype of float32, float16, bfloat16, got "
                                         r"torch.float32, torch.float32, torch.float16"),
])
def test_bad_shapes_are_named(change, message):
    """Shapes and dtypes, on meta tensors (the device check passes them)."""
    q, k, v, g, beta, _ = (x.float().to("meta") for x in _inputs())
    args = change({"q": q, "k": k, "v": v, "g": g, "beta": beta})
    with pytest.raises(ValueError, match=message):
        attngen.kda(**args)


def test_cpu_tensors_are_named_in_kdas_terms():
    q, k, v, g, beta, _ = (x.float() for x in _inputs())
    with pytest.raises(ValueError, match="kda: q must be a CUDA tensor, got device cpu"):
        attngen.kda(q, k, v, g, beta)


def test_delta_net_is_the_undecayed_delta_rule():
    """delta_net hands gated_delta_rule g = 0: the float64 reference with g = 0 is the plain
    delta rule S <- S + beta k (v - S^T k)^T, and the CPU tensors reach gated_delta_rule's check."""
    q, k, v, _, beta, state = _inputs(H=2, HV=2)
    out, final = reference.gated_delta_rule(q, k, v, torch.zeros_like(beta), beta, state=state, scale=0.5)
    S = state.clone()
    for t in range(q.shape[1]):
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        torch.testing.assert_close(out[:, t], 0.5 * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    torch.testing.assert_close(final, S)
    with pytest.raises(ValueError, match="gated_delta_rule: q must be a CUDA tensor, got device cpu"):
        attngen.delta_net(q.float(), k.float(), v.float(), beta.float())
    with pytest.raises(ValueError, match="delta_net: beta must be a torch.Tensor, got NoneType"):
        attngen.delta_net(q.float(), k.float(), v.float(), None)
