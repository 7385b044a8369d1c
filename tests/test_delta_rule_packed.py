"""Packed variable-length batches (cu_seqlens) of the delta-rule wrappers, on the CPU: the
padding attngen.delta_rule applies around the op (`_run_packed`), driven by the float64
reference in place of the kernels, equals each sequence run alone (reference.delta_rule_packed),
outputs, final states and every gradient; and bad cu_seqlens are named before any kernel runs."""
import pytest
import torch

import attngen
from attngen import reference
from attngen.delta_rule import _run_packed

LENGTHS = [0, 1, 7, 3, 0, 12]


def _packed_inputs(variant, lengths, H=2, K=4, V=3, seed=0):
    """Inputs packed as [1, sum(lengths), H, ...] in float64, with initial states [N, H, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    if variant == "rwkv7":
        kk = torch.nn.functional.normalize(rand(1, T, H, K), dim=-1)
        inputs = {"r": rand(1, T, H, K), "w": -torch.rand(1, T, H, K, generator=gen, dtype=torch.float64) * 2,
                  "k": rand(1, T, H, K), "v": rand(1, T, H, V), "a": -kk,
                  "b": kk * torch.rand(1, T, H, K, generator=gen, dtype=torch.float64)}
    else:
        inputs = {"q": rand(1, T, H, K), "k": torch.nn.functional.normalize(rand(1, T, H, K), dim=-1),
                  "v": rand(1, T, H, V), "g": -torch.rand(1, T, H, generator=gen, dtype=torch.float64) * 2,
                  "beta": torch.rand(1, T, H, generator=gen, dtype=torch.float64)}
    cu = torch.tensor([0] + lengths).cumsum(0)
    return inputs, rand(len(lengths), H, K, V), cu


def _reference(variant):
    return reference.rwkv7 if variant == "rwkv7" else reference.gated_delta_rule


def _through_the_padding(variant, inputs, state, cu):
    """What attngen.rwkv7 / gated_delta_rule do with cu_seqlens, with the float64 reference as the op."""
    fn = _reference(variant)

    def run(padded):
        return fn(*(padded[name] for name in inputs), state=padded["state"], scale=0.7)
    return _run_packed(variant, {**inputs, "state": state}, cu, run)


@pytest.mark.parametrize("variant", ["rwkv7", "gated_delta"])
def test_the_padded_batch_equals_each_sequence_alone(variant):
    """Outputs, final states and the gradients of every packed input and initial state, with
    sequences of 0, 1 and odd lengths, the longest not first."""
    inputs, state, cu = _packed_inputs(variant, LENGTHS)
    leaves = {name: x.clone().requires_grad_() for name, x in inputs.items()}
    state_leaf = state.clone().requires_grad_()
    got_o, got_s = _through_the_padding(variant, leaves, state_leaf, cu)
    want_leaves = {name: x.clone().requires_grad_() for name, x in inputs.items()}
    want_state = state.clone().requires_grad_()
    want_o, want_s = reference.delta_rule_packed(_reference(variant), list(want_leaves.values()), cu,
                                                 state=want_state, scale=0.7)
    assert got_o.shape == want_o.shape == (1, sum(LENGTHS), 2, 3) and got_s.shape == want_s.shape == state.shape
    torch.testing.assert_close(got_o, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_s, want_s, rtol=1e-12, atol=1e-12)
    # an empty sequence hands its initial state back unchanged
    torch.testing.assert_close(got_s[0], state[0], rtol=0, atol=0)
    gen = torch.Generator().manual_seed(7)
    d_o = torch.randn(got_o.shape, generator=gen, dtype=torch.float64)
    d_s = torch.randn(got_s.shape, generator=gen, dtype=torch.float64)
    torch.autograd.backward([got_o, got_s], [d_o, d_s])
    torch.autograd.backward([want_o, want_s], [d_o, d_s])
    for name in inputs:
        torch.testing.assert_close(leaves[name].grad, want_leaves[name].grad, rtol=1e-10, atol=1e-12,
                                   msg=lambda m, name=name: f"d{name}: {m}")
    torch.testing.assert_close(state_leaf.grad, want_state.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("variant", ["rwkv7", "gated_delta"])
def test_equal_lengths_run_as_views(variant):
    """Equal lengths take the batch as a view of the packed rows (no padding copy): the same
    outputs, states and gradients as each sequence alone, and the op sees strided views."""
    inputs, state, cu = _packed_inputs(variant, [6, 6, 6])
    seen = {}

    def run(padded):
        seen.update(padded)
        fn = _reference(variant)
        return fn(*(padded[name] for name in inputs), state=padded["state"], scale=0.7)
    leaves = {name: x.clone().requires_grad_() for name, x in inputs.items()}
    got_o, got_s = _run_packed(variant, {**leaves, "state": state}, cu, run)
    first = next(iter(inputs))
    assert seen[first].shape[:2] == (3, 6) and seen[first]._base is not None   # a view, not a copy
    want_o, want_s = reference.delta_rule_packed(_reference(variant), list(inputs.values()), cu, state=state,
                                                 scale=0.7)
    torch.testing.assert_close(got_o, want_o)
    torch.testing.assert_close(got_s, want_s)
    got_o.sum().backward()
    assert all(leaf.grad is not None and leaf.grad.shape == inputs[name].shape for name, leaf in leaves.items())


def test_the_packed_reference_is_the_batched_one_on_equal_lengths():
    """reference.delta_rule_packed on N equal lengths is the [N, T] batch it packs."""
    inputs, state, cu = _packed_inputs("gated_delta", [5, 5, 5])
    batched = [x.view(3, 5, *x.shape[2:]) for x in inputs.values()]
    want_o, want_s = reference.gated_delta_rule(*batched, state=state, scale=0.7)
    got_o, got_s = reference.delta_rule_packed(reference.gated_delta_rule, list(inputs.values()), cu,
                                               state=state, scale=0.7)
    torch.testing.assert_close(got_o, want_o.reshape(1, 15, *want_o.shape[2:]))
    torch.testing.assert_close(got_s, want_s)


@pytest.mark.parametrize("cu,message", [
    (torch.tensor([[0, 3]]), r"cu_seqlens must be a 1-D int32 or int64 tensor of N \+ 1 offsets, got torch.int64 "
                             r"of shape \[1, 2\]"),
    (torch.tensor([0.0, 3.0]), r"cu_seqlens must be a 1-D int32 or int64 tensor .* got torch.float32"),
    ([0, 3], r"cu_seqlens must be a 1-D int32 or int64 tensor .* got list"),
    (torch.tensor([1, 3], dtype=torch.int32), r"cu_seqlens\[0\] = 1; it must be 0"),
    (torch.tensor([0, 8, 4, 23]), r"cu_seqlens decreases at index 2 \(8 -> 4\)"),
    (torch.tensor([0, 5, 22]), r"cu_seqlens\[-1\] = 22 does not match the 23 packed steps of q"),
])
def test_bad_cu_seqlens_are_named(cu, message):
    inputs, state, _ = _packed_inputs("gated_delta", LENGTHS)
    with pytest.raises(ValueError, match=message):
        _through_the_padding("gated_delta", inputs, state, cu)


def test_inputs_not_packed_are_named():
    inputs, state, cu = _packed_inputs("rwkv7", LENGTHS)
    batched = dict(inputs, r=inputs["r"].expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match=r"rwkv7: with cu_seqlens the sequences are packed along T of a batch of "
                                         r"one: r must be \[1, T, H, \.\.\.\], got \[2, 23, 2, 4\]"):
        _through_the_padding("rwkv7", batched, state, cu)
    short = dict(inputs, v=inputs["v"][:, :20])
    with pytest.raises(ValueError, match=r"rwkv7: with cu_seqlens v must be packed as r is, \[1, 23, H, \.\.\.\], "
                                         r"got \[1, 20, 2, 3\]"):
        _through_the_padding("rwkv7", short, state, cu)


def test_the_public_calls_take_cu_seqlens():
    """The documented entry points accept cu_seqlens (checked on the CPU: refused as CPU tensors
    only after the packing's own checks passed)."""
    inputs, state, cu = _packed_inputs("gated_delta", LENGTHS)
    q, k, v, g, beta = (x.float() for x in inputs.values())
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\] = 1"):
        attngen.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu + 1)
    with pytest.raises(ValueError, match="must be a CUDA tensor, got device cpu"):
        attngen.gated_delta_rule(q, k, v, g, beta, state=state.float(), cu_seqlens=cu)
