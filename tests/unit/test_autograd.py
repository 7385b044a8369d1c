"""attngen._autograd.register_autograd on CPU test ops: the formula sees every argument (the
trimmed defaults filled in), one needs_input_grad flag per argument (again on a retained graph's
second backward), no graph without grad, torch.compile over forward and backward, and the
fallback to torch.library.register_autograd for a keyword-only argument."""
import pytest
import torch

from attngen import _autograd

NAMESPACE = "attngen_autograd_test"
_LIB = torch.library.Library(NAMESPACE, "DEF")
_LIB.define("mix(Tensor x, Tensor y, float a=2.0, int n=3, bool swap=False, Tensor? z=None) -> (Tensor, Tensor)")
_LIB.define("scale(Tensor x, *, float a=2.0) -> Tensor")


def _mix(x, y, a=2.0, n=3, swap=False, z=None):
    if swap:
        x, y = y, x
    first = x * (a * n) + y
    return first if z is None else first + z, x * y


def _mix_fake(x, y, a=2.0, n=3, swap=False, z=None):
    return torch.empty_like(x), torch.empty_like(x)


for _key, _fn in (("CPU", _mix), ("Meta", _mix_fake)):
    _LIB.impl("mix", _fn, _key)
_LIB.impl("scale", lambda x, *, a=2.0: x * a, "CPU")
_LIB.impl("scale", lambda x, *, a=2.0: torch.empty_like(x), "Meta")

SEEN = {}


def _setup_context(ctx, inputs, output):
    SEEN["inputs"] = inputs
    x, y, a, n, swap, z = inputs
    ctx.save_for_backward(x, y)
    ctx.options = (a, n, swap)
    ctx.set_materialize_grads(False)   # as flash_attention's: an unused output's gradient is None


def _backward(ctx, d_first, d_product):
    SEEN["flags"] = ctx.needs_input_grad
    SEEN["grads"] = (d_first, d_product)
    d_first = torch.zeros_like(ctx.saved_tensors[0]) if d_first is None else d_first
    d_product = torch.zeros_like(ctx.saved_tensors[0]) if d_product is None else d_product
    x, y = ctx.saved_tensors
    a, n, swap = ctx.options
    if swap:
        x, y = y, x
    dx = d_first * (a * n) + d_product * y
    dy = d_first + d_product * x
    if swap:
        dx, dy = dy, dx
    return dx, dy, None, None, None, None


_autograd.register_autograd(getattr(torch.ops, NAMESPACE).mix.default, _backward, _setup_context)
_autograd.register_autograd(   # keyword-only: torch's registration, which passes them apart
    getattr(torch.ops, NAMESPACE).scale.default, lambda ctx, g: g * ctx.a,
    lambda ctx, inputs, keyword_only_inputs, output: setattr(ctx, "a", keyword_only_inputs["a"]))
MIX = getattr(torch.ops, NAMESPACE).mix


def _leaves():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, 3, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2)]


def _loss(fn, x, y, *extra):
    first, product = fn(x, y, *extra)
    return (first * 1.5).sum() + (product * 0.5).sum()


def _grads(fn, x, y, *extra):
    return torch.autograd.grad(_loss(fn, x, y, *extra), (x, y))


@pytest.mark.parametrize("extra", [(), (0.5,), (0.5, 4, True)])
def test_gradients_match_the_formula_done_by_torch(extra):
    x, y = _leaves()
    got = _grads(MIX, x, y, *extra)
    want = _grads(_mix, x, y, *extra)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=0)


def test_setup_context_sees_every_argument_with_defaults():
    x, y = _leaves()
    MIX(x, y, 0.5)
    assert len(SEEN["inputs"]) == 6
    assert SEEN["inputs"][2:] == (0.5, 3, False, None)


def test_needs_input_grad_has_one_flag_per_argument_every_backward():
    x, y = _leaves()
    first, _ = MIX(x, y.detach())
    for _ in range(2):   # a retained graph's second backward reads the flags again
        SEEN.pop("flags", None)
        torch.autograd.grad(first.sum(), x, retain_graph=True)
        assert SEEN["flags"] == (True, False, False, False, False, False)   # the trimmed defaults too


def test_no_graph_without_grad():
    x, y = _leaves()
    with torch.no_grad():
        first, product = MIX(x, y)
    assert first.grad_fn is None and product.grad_fn is None
    first, _ = MIX(x.detach(), y.detach())
    assert first.grad_fn is None


def test_compiled_forward_and_backward_match_eager():
    """The loss compiled whole (AOTAutograd traces the formula into the backward graph)."""
    x, y = _leaves()
    loss = torch.compile(lambda a, b: _loss(MIX, a, b, 0.5, 4, True), fullgraph=True, backend="aot_eager")
    loss(x, y).backward()
    got = [x.grad, y.grad]
    for g, w in zip(got, _grads(MIX, *[t.detach().requires_grad_() for t in (x, y)], 0.5, 4, True)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=0)


def test_keyword_only_argument_falls_back_to_torch():
    assert not _autograd._lean_supported(getattr(torch.ops, NAMESPACE).scale.default)
    assert _autograd._lean_supported(MIX.default)
    x, _ = _leaves()
    (dx,) = torch.autograd.grad(getattr(torch.ops, NAMESPACE).scale(x, a=3.0).sum(), x)
    torch.testing.assert_close(dx, torch.full_like(x, 3.0))


def test_an_unused_output_gets_none_eager_and_compiled():
    """With materialize_grads off (flash_attention's lse), the formula sees None for an output the
    loss does not read, eagerly and under AOTAutograd; the gradients still match torch's."""
    x, y = _leaves()

    def first_only(fn, a, b):
        return (fn(a, b, 0.5)[0] * 1.5).sum()

    SEEN.pop("grads", None)
    got = torch.autograd.grad(first_only(MIX, x, y), (x, y))
    assert SEEN["grads"][1] is None and SEEN["grads"][0] is not None
    want = torch.autograd.grad(first_only(_mix, x, y), (x, y))
    loss = torch.compile(lambda a, b: first_only(MIX, a, b), fullgraph=True, backend="aot_eager")
    xc, yc = (t.detach().requires_grad_() for t in (x, y))
    loss(xc, yc).backward()
    for g, c, w in zip(got, (xc.grad, yc.grad), want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=0)
        torch.testing.assert_close(c, w, rtol=1e-12, atol=0)


def test_a_mutating_op_is_refused_as_torch_refuses_it():
    library = torch.library.Library(NAMESPACE, "FRAGMENT")
    library.define("bump(Tensor(a!) x) -> Tensor")
    op = getattr(torch.ops, NAMESPACE).bump.default
    assert not _autograd._lean_supported(op)
    with pytest.raises(RuntimeError, match="non-functional"):
        _autograd.register_autograd(op, lambda ctx, g: g, lambda ctx, inputs, output: None)


@pytest.mark.parametrize("name", ["mm.default", "sin.default", "mm.out", "add_.Tensor", "add.Tensor", "cat.default",
                                  "index.Tensor", "transpose.int", "split.Tensor", "unbind.int", "native_layer_norm.default"])
def test_the_schema_test_agrees_with_torchs_own(name):
    """_lean_supported reads the schema's public fields; where this torch has its private tests
    (torch._library.utils, whose is_out the GPU machine's 2.11 lacks), both give the same answer."""
    utils = pytest.importorskip("torch._library.utils")
    if not all(hasattr(utils, f) for f in ("is_functional_schema", "is_out", "is_tensorlist_like_type")):
        pytest.skip("this torch lacks one of torch._library.utils' schema tests")
    packet, overload = name.split(".")
    op = getattr(getattr(torch.ops.aten, packet), overload)
    schema = op._schema
    torchs = utils.is_functional_schema(schema) and not utils.is_out(op) and not any(
        a.kwarg_only or utils.is_tensorlist_like_type(a.type) for a in schema.arguments) and not any(
        utils.is_tensorlist_like_type(r.type) for r in schema.returns)
    assert _autograd._lean_supported(op) == torchs
