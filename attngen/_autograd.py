"""An op's autograd formula, registered the way torch.library.register_autograd registers it
(a Python kernel at the op's Autograd key that runs an autograd.Function around the op below
autograd), without that kernel's per-call cost.

torch's generic kernel (torch._library.autograd.make_autograd_impl) completes the arguments the
dispatcher trimmed (those equal to their defaults) with torch._library.utils.fill_defaults before
calling setup_context. That loop reads `schema.arguments`, which builds a fresh list of pybind
objects, once per argument: quadratic in the argument count. flash_attention has 18 arguments;
on the H200 a recording forward cost 198 us of host time against 50 us without autograd (SDPA's
flash backend: 69 and 62; bench/results/h200/flash_grad_host_69b6d546.md), and cProfile put
fill_defaults first, ahead of the autograd engine. Here the defaults are read once, at
registration.

Ops this kernel does not cover (keyword-only arguments, tensor lists, which torch's kernel
handles with extra machinery; ops that mutate or alias, which torch refuses) are left to
torch.library.register_autograd.
"""
from __future__ import annotations

import torch


def _holds_tensors(jit_type) -> bool:
    """A list of tensors (Tensor[] or Tensor?[]), which torch's kernel unpacks with extra machinery."""
    if not isinstance(jit_type, torch.ListType):
        return False
    element = jit_type.getElementType()
    if isinstance(element, torch.OptionalType):
        element = element.getElementType()
    return isinstance(element, torch.TensorType)


def _lean_supported(op) -> bool:
    """A functional op (it mutates nothing and returns no alias of an argument; an out variant
    mutates its out) without keyword-only arguments or tensor lists. Anything else goes to
    torch.library.register_autograd, which serves or refuses it. Read from the schema's public
    fields: torch._library.utils moves between releases (its is_out, present in the CPU wheel
    2.13, is missing from the GPU machine's 2.11)."""
    schema = op._schema
    return not schema.is_mutable and not any(r.alias_info is not None for r in schema.returns) and not any(
        a.kwarg_only or _holds_tensors(a.type) for a in schema.arguments) and not any(
        _holds_tensors(r.type) for r in schema.returns)


def register_autograd(op: torch._ops.OpOverload, backward, setup_context) -> None:
    """backward(ctx, *grads) -> one gradient (or None) per argument of the op, and
    setup_context(ctx, inputs, output) with every argument in inputs (defaults included), as
    torch.library.register_autograd takes them."""
    schema = op._schema
    if not _lean_supported(op):
        torch.library.register_autograd(f"{op._namespace}::{op._opname}", backward, setup_context=setup_context)
        return
    defaults = tuple(a.default_value for a in schema.arguments)
    below_autograd = torch._C._after_autograd_keyset

    def run_below_autograd(keyset, args):
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below_autograd, *args)

    class Formula(torch.autograd.Function):
        """The op's arguments, then the dispatch keyset last (no gradient)."""

        @staticmethod
        def forward(ctx, *args_and_keyset):
            *args, keyset = args_and_keyset
            output = run_below_autograd(keyset, args)
            setup_context(ctx, tuple(args) + defaults[len(args):], output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            # needs_input_grad as the formula expects it: one flag per argument of the op, the
            # trimmed defaults included, not the keyset; restored after, as a retained graph's
            # second backward reads it again. Gradients back for the arguments passed, then the keyset.
            flags = ctx.needs_input_grad
            passed = len(flags) - 1
            ctx.needs_input_grad = flags[:-1] + (False,) * (len(defaults) - passed)
            try:
                grads_in = backward(ctx, *grads)
            finally:
                ctx.needs_input_grad = flags
            return (*(grads_in if isinstance(grads_in, tuple) else (grads_in,))[:passed], None)

    Formula.__name__ = Formula.__qualname__ = f"AutogradFor_{op._namespace}_{op._opname}"

    def autograd_kernel(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return Formula.apply(*args, keyset)
        return run_below_autograd(keyset, args)

    library = torch.library.Library(op._namespace, "FRAGMENT")
    library.impl(op._opname, autograd_kernel, "Autograd", with_keyset=True)
    _LIBRARIES.append(library)   # a registration lives as long as its Library object


_LIBRARIES: list = []
