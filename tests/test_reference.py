"""Reference tier (CPU): the torch reference against the seed's naive loops, in float64, and
the layers against fast-transformers' formulas; the runtime's input checks."""
import pytest
import torch

import attngen
from attngen import reference


@pytest.mark.parametrize("L,E,M", [(1, 4, 3), (7, 8, 5), (33, 16, 24)])
def test_masked_matmul_reference_equals_the_seed_loops(L, E, M):
    torch.manual_seed(L)
    q, k, v = torch.randn(2, 3, L, E), torch.randn(2, 3, L, E), torch.randn(2, 3, L, M)
    torch.testing.assert_close(reference.causal_dot_product(q, k, v), reference.causal_dot_product_loops(q, k, v),
                               rtol=1e-12, atol=1e-12)


def test_reverse_is_the_time_flip_of_forward():
    q, k, v = torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 6)
    flip = lambda x: x.flip(2)  # noqa: E731
    torch.testing.assert_close(reference.causal_dot_product(q, k, v, reverse=True),
                               flip(reference.causal_dot_product(flip(q), flip(k), flip(v))))


def test_backward_formulas_are_forward_calls():
    """The autograd formula the op registers, checked with float64 autograd on the reference."""
    q, k, v = (torch.randn(1, 2, 11, d, dtype=torch.float64, requires_grad=True) for d in (4, 4, 5))
    g = torch.randn(1, 2, 11, 5, dtype=torch.float64)
    dq, dk, dv = torch.autograd.grad(reference.causal_dot_product(q, k, v), (q, k, v), g)
    f = reference.causal_dot_product
    torch.testing.assert_close(dq, f(g, v, k))
    torch.testing.assert_close(dk, f(v, g, q, reverse=True))
    torch.testing.assert_close(dv, f(k, q, g, reverse=True))


def test_causal_layer_matches_fast_transformers_formula():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 10, 3, 4), torch.randn(2, 10, 3, 4), torch.randn(2, 10, 3, 5)
    out = reference.causal_linear_attention(q, k, v)
    Q, K = torch.nn.functional.elu(q.double()) + 1, torch.nn.functional.elu(k.double()) + 1
    for t in (0, 4, 9):
        num = torch.einsum("bhe,bshe,bshm->bhm", Q[:, t], K[:, :t + 1], v.double()[:, :t + 1])
        den = torch.einsum("bhe,bshe->bh", Q[:, t], K[:, :t + 1]) + 1e-6
        torch.testing.assert_close(out[:, t], num / den[..., None])


@pytest.mark.parametrize("change,match", [
    (lambda q, k, v: (torch.empty(q.shape), k, v), "q must be a CUDA tensor"),
    (lambda q, k, v: (q, k.double(), v), "k has dtype torch.float64"),
    (lambda q, k, v: (q, k[..., :2], v), "k has last dim 2"),
    (lambda q, k, v: (q, k, v[:, :, :3]), "v has shape"),
    (lambda q, k, v: (q, k, v[..., ::2]), "v must have a contiguous last dim"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), "q has dtype torch.int32"),
    (lambda q, k, v: (q[0], k, v), "q must be 4-D"),
])
def test_bad_inputs_raise_value_error_naming_the_argument(change, match):
    meta = dict(device="meta")
    q, k, v = torch.empty(1, 2, 4, 8, **meta), torch.empty(1, 2, 4, 8, **meta), torch.empty(1, 2, 4, 6, **meta)
    with pytest.raises(ValueError, match=match):
        attngen.causal_dot_product(*change(q, k, v))


def test_cpu_tensors_are_rejected_before_the_extension_is_needed():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="q must be a CUDA tensor, got device cpu"):
        attngen.causal_dot_product(q, q, q)
