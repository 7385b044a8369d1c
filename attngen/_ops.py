"""The generated ops as the runtime calls them: one `Op` per op declared in a spec.

Every op's torch surface is generated from its declaration (templates/op/op.cpp.j2): the op, its
Meta kernel (the fake implementation torch.compile traces), and the helpers `<op>_with`
(through a named instance), `<op>_select` (the instance dispatch picks), `<op>_key` (the
dispatch key as numbers) and `<op>_instances` (by role). They take the op's own arguments, so
this class needs nothing per op but its name.
"""
from __future__ import annotations

import sys

import torch

from . import _autograd, _ext, _jit

BENCH_NAMESPACE = "attngen_bench"   # the benchmark extension's ops (bench-role kinds; _ext.load_bench)
_AXIS_VALUES: dict = {}


def constant_result(fn):
    """torch.compiler.assume_constant_result without importing torch._dynamo when attngen is
    imported: that import took 4.4 s of a 12 s second process on the H100 machine
    (bench/results/h100/first_use_profile.txt); on the 2-core CPU machine, `import attngen` after
    torch took 1.02-1.18 s with it and 0.017 s without.
    The mark is the attribute torch's own decorator sets (torch/_dynamo/decorators.py);
    tests/unit/test_import_time.py checks that the two agree, so a torch that marks otherwise
    fails there, not silently under torch.compile. Where torch._dynamo is already imported,
    torch's decorator itself is applied."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    return mark_constant(fn)


def mark_constant(fn):
    """The mark torch.compiler.assume_constant_result leaves on `fn`, set without torch._dynamo."""
    fn._dynamo_marked_constant = True
    return fn


@constant_result
def _axis_values(op: str, axis: str) -> tuple:
    """The values of `axis` in the order `op`'s int argument numbers them, read from the extension
    once. A constant to torch.compile, which cannot trace an op that returns strings (fullgraph
    failed on `variant("rwkv7")` before)."""
    if (op, axis) not in _AXIS_VALUES:
        _ext.load()
        _AXIS_VALUES[op, axis] = tuple(getattr(torch.ops.attngen, f"{op}_axis_values")(axis))
    return _AXIS_VALUES[op, axis]


_CONSTANTS: dict = {}


@constant_result
def exported_constant(name: str) -> int:
    """An int a family exports from the extension (its `exported_constants`: the delta rule's
    checkpoint interval, the decode kinds' query-token limit), read once; a constant to
    torch.compile, which cannot trace the op that returns it."""
    if name not in _CONSTANTS:
        _ext.load()
        _CONSTANTS[name] = int(getattr(torch.ops.attngen, name)())
    return _CONSTANTS[name]


@constant_result
def _load_extension() -> bool:
    """_ext.load(), a constant to torch.compile: run eagerly where the first call of a process
    is traced (dynamo cannot trace the file checks and the library load: fullgraph failed there)."""
    _ext.load()
    return True


class Op:
    def __init__(self, name: str):
        self.name = name
        self._autograd = False

    def register_autograd(self, backward, setup_context) -> None:
        """The op's autograd formula (hand-written, in the family's module), once per process."""
        if not self._autograd:
            _autograd.register_autograd(self.packet().default, backward, setup_context)
            self._autograd = True

    def _namespace(self):
        _load_extension()
        return torch.ops.attngen

    def packet(self):
        """torch.ops.attngen.<op>: what autograd and fake registrations name."""
        return getattr(self._namespace(), self.name)

    def __call__(self, *args):
        """The op through its dispatch; a call no compiled instance covers builds one on first use."""
        run = getattr(self._namespace(), self.name)
        return _jit.call(self.name, lambda: run(*args))

    def forced(self, instance: str, *args):
        """The op through the named instance: a shipped one (built on first use where the extension
        was built without its instances), or a bench-role one of the benchmark extension (`python
        -m codegen build --bench`); an error if it does not cover the call."""
        ops = self._namespace()
        args = self._with_defaults(args)
        if instance not in self.instances() and instance in self.bench_instances():
            return getattr(getattr(torch.ops, BENCH_NAMESPACE), f"{self.name}_with")(*args, instance)
        run = getattr(ops, f"{self.name}_with")
        return _jit.call(self.name, lambda: run(*args, instance))

    def _with_defaults(self, args: tuple) -> tuple:
        """`args` completed with the op's declared defaults: `<op>_with` declares none (its
        instance comes last), so a call that stops short of trailing optional arguments (as the
        op itself allows) gets them here."""
        declared = getattr(self._namespace(), self.name).default._schema.arguments
        return tuple(args) + tuple(a.default_value for a in declared[len(args):])

    def select(self, *args) -> str:
        """The instance the generated dispatch picks for these arguments ('' if none)."""
        return getattr(self._namespace(), f"{self.name}_select")(*args)

    def key(self, *args) -> list:
        return list(getattr(self._namespace(), f"{self.name}_key")(*args))

    def instances(self, role: str = "") -> list[str]:
        """The shipped extension's instances of this op, of one role ('dispatch', 'fallback') or all."""
        return list(getattr(self._namespace(), f"{self.name}_instances")(role))

    def axis_index(self, axis: str, value: str) -> int:
        """The number an int argument passes to select `value` of `axis` (the family's axis order)."""
        return _axis_values(self.name, axis).index(value)

    def bench_instances(self) -> list[str]:
        """The benchmark extension's instances of this op ([] where it is not built, or built
        without this op's spec: `codegen build --bench --spec ...`)."""
        if not _ext.load_bench():
            return []
        namespace = getattr(torch.ops, BENCH_NAMESPACE)
        if not hasattr(namespace, f"{self.name}_instances"):
            return []
        return list(getattr(namespace, f"{self.name}_instances")("bench"))
