"""The op declaration: a spec's `op:` section, parsed once, from which the op's whole torch
surface is generated (templates/op.h.j2, templates/op.cpp.j2), as torchgen does from a
`native_functions.yaml` line.

  schema     the torch schema: the one place the signature is written. It yields the C++
             argument struct, the signatures of `<op>`, `<op>_with` (plus `str instance`),
             `<op>_select` and `<op>_key`, and their registration.
  outputs    one entry per returned tensor: its shape in terms of the inputs and its dtype.
             The op allocates its outputs from them, and so does its Meta kernel, which is the
             fake implementation torch.compile traces with.
  key        the run-time dispatch variables (each with what it means), which the family's
             `fill_key` computes and the spec's `when:` / `covers:` read.
  args       (optional) the tensor arguments' declared layouts: `q: "[B, H, L, E]"` or
             `{shape: "[B, H, K, V]", dtype: like|float32, any_strides: bool}`. The op checks
             each (a CUDA tensor on the first one's device, its rank, q's dtype or float32, the
             dims that share a name with an earlier tensor, a contiguous last dim) before the
             family's own check(), with messages that name the argument.
  dispatch_axes
             where each spec axis is read from a call: `dtype: q` (q's dtype, one of
             axes.dtype, else a ValueError naming q), `direction: reverse` (a bool argument:
             false picks the axis' first value, true its second), `variant: variant` (an int
             argument: the index of the value in the family's axis).

Output shapes and dtypes are Python-syntax expressions over the arguments: `q` (q's sizes),
`[q[0], q[2], v[-1]]` (sizes), `a if cond else b` where cond is a bool argument, `x is None` or
`x is not None` for an optional one, or `fp8(x)` (a tensor argument holds float8 values); `+ - * //`
and integers; dtypes `float32`, `float16`, `bfloat16` or a tensor argument's name (its dtype).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass

ARG_TYPES = {  # schema type -> (C++ parameter type, C++ member type of the argument struct)
    "Tensor": ("const at::Tensor&", "const at::Tensor&"),
    "Tensor?": ("const std::optional<at::Tensor>&", "const std::optional<at::Tensor>&"),
    "bool": ("bool", "bool"),
    "int": ("int64_t", "int64_t"),
    "float": ("double", "double"),
    "str": ("const std::string&", "const std::string&"),
}
# Names the generated op functions (templates/op/op.cpp.j2) give their locals and extra parameters.
RESERVED_NAMES = frozenset({"args", "out", "key", "entry", "instance", "names", "role"})
OUTPUT_DTYPES = {"float32": "at::kFloat", "float16": "at::kHalf", "bfloat16": "at::kBFloat16"}
_ARG = re.compile(r"^(?P<type>Tensor(?:\([a-z]!?\))?\??|bool|int|float|str)\s+(?P<name>[A-Za-z_]\w*)"
                  r"(?:\s*=\s*(?P<default>\S+))?$")


class DeclError(ValueError):
    """A problem in an op declaration; the spec loader adds file:line and the field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


@dataclass(frozen=True)
class Arg:
    name: str
    type: str             # schema type without alias annotation: Tensor, Tensor?, bool, int, float, str
    schema_type: str      # as written (Tensor(a!)? keeps its alias annotation)
    default: str | None

    @property
    def is_tensor(self) -> bool:
        return self.type.startswith("Tensor")

    @property
    def optional(self) -> bool:
        return self.type.endswith("?")

    @property
    def cpp_param(self) -> str:
        return f"{ARG_TYPES[self.type][0]} {self.name}"

    @property
    def cpp_member(self) -> str:
        return f"{ARG_TYPES[self.type][1]} {self.name};"

    def schema(self, defaults: bool = True, alias: bool = True) -> str:
        text = f"{self.schema_type if alias else self.type} {self.name}"
        return text + (f"={self.default}" if defaults and self.default is not None else "")


@dataclass(frozen=True)
class Output:
    name: str
    shape_cpp: str        # C++ expression: std::vector<c10::SymInt> (or a SymIntArrayRef)
    dtype_cpp: str        # C++ expression: at::ScalarType
    like: str             # the tensor argument whose device (and layout) the output takes


@dataclass(frozen=True)
class TensorCheck:
    """A tensor argument's declared layout (op.args): its dims by name (a name shared with an
    earlier dim must agree with it), its dtype (`like`: the dtype axis' source tensor, or
    float32), whether any strides are taken (else the last dim must be contiguous)."""
    name: str
    dims: tuple           # dim names, outermost first
    dtype: str            # "like" or "float32"
    any_strides: bool
    optional: bool

    @property
    def layout(self) -> str:
        return "[" + ", ".join(self.dims) + "]"


@dataclass(frozen=True)
class OpDecl:
    name: str
    schema: str
    doc: str
    args: tuple           # Arg, in schema order
    returns: int          # number of returned tensors
    outputs: tuple        # Output, one per returned tensor
    key: dict             # run-time variable -> what it is
    dispatch_axes: dict   # axis -> the argument it is read from
    checks: tuple = ()    # TensorCheck, in declaration order (op.args)

    @property
    def tensor_args(self) -> tuple:
        return tuple(a for a in self.args if a.is_tensor)

    def arg(self, name: str) -> Arg:
        return next(a for a in self.args if a.name == name)

    # ---- the schemas of the helper ops, derived from the op's --------------------------------
    def _helper(self, suffix: str, extra: str, returns: str, defaults: bool, alias: bool) -> str:
        args = ", ".join([a.schema(defaults, alias) for a in self.args] + ([extra] if extra else []))
        return f"{self.name}{suffix}({args}) -> {returns}"

    @property
    def returns_schema(self) -> str:
        return self.schema.rsplit("->", 1)[1].strip()

    @property
    def with_schema(self) -> str:
        """`<op>_with`: the op through a named instance (defaults dropped: `instance` comes last)."""
        return self._helper("_with", "str instance", self.returns_schema, defaults=False, alias=True)

    @property
    def select_schema(self) -> str:
        return self._helper("_select", "", "str", defaults=True, alias=False)

    @property
    def key_schema(self) -> str:
        return self._helper("_key", "", "int[]", defaults=True, alias=False)

    @property
    def cpp_returns(self) -> str:
        return "at::Tensor" if self.returns == 1 else "std::tuple<" + ", ".join(["at::Tensor"] * self.returns) + ">"


def parse_schema(name: str, schema: str) -> tuple[tuple, int]:
    """(args, number of returned tensors) of a torch schema string; DeclError names what is wrong."""
    match = re.fullmatch(r"\s*(\w+)\((.*)\)\s*->\s*(.+?)\s*", " ".join(schema.split()))
    if not match or match.group(1) != name:
        raise DeclError("op.schema", f"expected '{name}(<arguments>) -> <returns>', got {schema!r}")
    args, seen = [], set()
    for text in filter(None, (t.strip() for t in match.group(2).split(","))):
        arg = _ARG.match(text)
        if not arg:
            raise DeclError("op.schema", f"argument {text!r}: expected '<type> <name>[=default]' with a type from "
                                         f"{sorted(ARG_TYPES)} (Tensor may carry an alias annotation)")
        schema_type = arg.group("type")
        plain = re.sub(r"\(.*\)", "", schema_type)
        if arg.group("name") in seen:
            raise DeclError("op.schema", f"argument {arg.group('name')!r} is declared twice")
        if arg.group("name") in RESERVED_NAMES:
            raise DeclError("op.schema", f"argument {arg.group('name')!r}: the generated bindings use that name; "
                                         f"choose another (reserved: {', '.join(sorted(RESERVED_NAMES))})")
        seen.add(arg.group("name"))
        args.append(Arg(arg.group("name"), plain, schema_type, arg.group("default")))
    returns = match.group(3)
    if returns == "Tensor":
        count = 1
    else:
        items = [r.strip() for r in returns.strip("()").split(",")]
        if not (returns.startswith("(") and all(r == "Tensor" for r in items)):
            raise DeclError("op.schema", f"returns {returns!r}: expected Tensor or a tuple (Tensor, ...)")
        count = len(items)
    if not any(a.is_tensor and not a.optional for a in args):
        raise DeclError("op.schema", "the op needs at least one (non-optional) Tensor argument")
    return tuple(args), count


# ---- output expressions -> C++ ----------------------------------------------------------------

class _Translator:
    """Python-syntax shape / dtype expressions over the arguments -> C++ over the Args struct."""

    def __init__(self, args: tuple, field: str, text: str):
        self.args = {a.name: a for a in args}
        self.field, self.text = field, text

    def fail(self, why: str):
        raise DeclError(self.field, f"{why} in {self.text!r}")

    def parse(self, text) -> ast.AST:
        if not isinstance(text, str):
            self.fail(f"expected an expression string, got {type(text).__name__}")
        try:
            return ast.parse(text.strip(), mode="eval").body
        except SyntaxError as exc:
            self.fail(f"does not parse ({exc.msg})")

    def tensor(self, node) -> str:
        if not isinstance(node, ast.Name) or node.id not in self.args or not self.args[node.id].is_tensor \
                or self.args[node.id].optional:
            self.fail("expected the name of a (non-optional) tensor argument")
        return f"a.{node.id}"

    def condition(self, node) -> str:
        if isinstance(node, ast.Name) and node.id in self.args and self.args[node.id].type == "bool":
            return f"a.{node.id}"
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return f"!({self.condition(node.operand)})"
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot)) \
                and isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value is None \
                and isinstance(node.left, ast.Name) and self.args.get(node.left.id, None) is not None \
                and self.args[node.left.id].optional:
            has = f"a.{node.left.id}.has_value()"
            return has if isinstance(node.ops[0], ast.IsNot) else f"!{has}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "fp8" \
                and len(node.args) == 1 and not node.keywords:
            return f"at::isFloat8Type({self.tensor(node.args[0])}.scalar_type())"
        self.fail("a condition is a bool argument, `not <cond>`, `<optional argument> is [not] None`, or "
                  "`fp8(<tensor argument>)`")

    def size(self, node) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return f"c10::SymInt({node.value})"
        if isinstance(node, ast.Subscript):
            index = node.slice
            sign = 1
            if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub):
                sign, index = -1, index.operand
            if not (isinstance(index, ast.Constant) and isinstance(index.value, int)):
                self.fail("a size is <tensor>[<integer>]")
            return f"{self.tensor(node.value)}.sym_size({sign * index.value})"
        if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv):
            op = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "/"}[type(node.op)]
            return f"({self.size(node.left)} {op} {self.size(node.right)})"
        if isinstance(node, ast.Name) and node.id in self.args and self.args[node.id].type == "int":
            return f"c10::SymInt(a.{node.id})"
        self.fail("a size is an integer, an int argument, <tensor>[<i>], or + - * // of sizes")

    def shape(self, node) -> str:
        if isinstance(node, ast.IfExp):
            return f"({self.condition(node.test)} ? {self.shape(node.body)} : {self.shape(node.orelse)})"
        if isinstance(node, ast.Name):
            return f"{self.tensor(node)}.sym_sizes().vec()"
        if isinstance(node, (ast.List, ast.Tuple)):
            return "std::vector<c10::SymInt>{" + ", ".join(self.size(e) for e in node.elts) + "}"
        self.fail("a shape is a tensor argument (its sizes), a list of sizes, or `<shape> if <cond> else <shape>`")

    def dtype(self, node) -> str:
        if isinstance(node, ast.IfExp):
            return f"({self.condition(node.test)} ? {self.dtype(node.body)} : {self.dtype(node.orelse)})"
        if isinstance(node, ast.Name) and node.id in OUTPUT_DTYPES:
            return OUTPUT_DTYPES[node.id]
        if isinstance(node, ast.Name):
            return f"{self.tensor(node)}.scalar_type()"
        self.fail(f"a dtype is one of {sorted(OUTPUT_DTYPES)}, a tensor argument (its dtype), or a conditional")


def output(args: tuple, name: str, body: dict, field: str) -> Output:
    """One declared output: {shape: <expr>, dtype: <expr>, like: <tensor argument>}."""
    first = next(a.name for a in args if a.is_tensor and not a.optional)
    like = body.get("like", first)
    shape_text = body.get("shape")
    if shape_text is None:
        raise DeclError(f"{field}.shape", "missing required field")
    shape = _Translator(args, f"{field}.shape", shape_text)
    dtype = _Translator(args, f"{field}.dtype", body.get("dtype", like))
    _Translator(args, f"{field}.like", like).tensor(ast.Name(like) if isinstance(like, str) else like)
    return Output(name, shape.shape(shape.parse(shape_text)), dtype.dtype(dtype.parse(body.get("dtype", like))), like)


def check_dispatch_axes(args: tuple, axes: dict, dispatch_axes: dict) -> None:
    """Every spec axis is read from an argument of the right type."""
    by_name = {a.name: a for a in args}
    for axis in axes:
        if axis not in dispatch_axes:
            raise DeclError("op.dispatch_axes", f"axis {axis!r} is not read from any argument; expected "
                                                f"{axis}: <argument>")
    for axis, source in dispatch_axes.items():
        field = f"op.dispatch_axes.{axis}"
        if axis not in axes:
            raise DeclError(field, f"no axis {axis!r}; the spec's axes are {list(axes)}")
        arg = by_name.get(source)
        if axis == "dtype":
            if arg is None or arg.type != "Tensor":
                raise DeclError(field, f"expected a (non-optional) tensor argument, got {source!r}")
        elif arg is not None and arg.type == "int":
            pass  # the index of the axis value; the op rejects one out of range, naming the values
        else:
            if arg is None or arg.type != "bool":
                raise DeclError(field, f"expected a bool or int argument, got {source!r}")
            if len(axes[axis]) > 2:
                raise DeclError(field, f"a bool argument selects between two values; axis {axis!r} has "
                                       f"{len(axes[axis])} (an int argument selects any)")


_DIMS = re.compile(r"^\[\s*([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*\]$")


def tensor_checks(args: tuple, declared: dict) -> tuple:
    """op.args: {name: "[B, T, H, K]" or {shape: ..., dtype: like|float32, any_strides: bool}} ->
    TensorChecks; DeclError names the field."""
    by_name = {a.name: a for a in args}
    out = []
    for name, body in declared.items():
        field = f"op.args.{name}"
        arg = by_name.get(name)
        if arg is None or not arg.is_tensor:
            raise DeclError(field, f"{name!r} is not a tensor argument of the schema")
        if isinstance(body, str):
            body = {"shape": body}
        if not isinstance(body, dict) or "shape" not in body or set(body) - {"shape", "dtype", "any_strides"}:
            raise DeclError(field, "expected \"[D0, D1, ...]\" or {shape: \"[...]\", dtype: like|float32, any_strides: bool}")
        match = _DIMS.match(str(body["shape"]).strip())
        if not match:
            raise DeclError(field, f"shape {body['shape']!r}: expected dim names in brackets, as \"[B, T, H, K]\"")
        dtype = body.get("dtype", "like")
        if dtype not in ("like", "float32"):
            raise DeclError(field, f"dtype {dtype!r}: expected like (the dtype axis' tensor) or float32")
        any_strides = body.get("any_strides", False)
        if not isinstance(any_strides, bool):
            raise DeclError(field, f"any_strides: expected true or false, got {any_strides!r}")
        dims = tuple(d.strip() for d in match.group(1).split(","))
        out.append(TensorCheck(name, dims, dtype, any_strides, arg.optional))
    return tuple(out)


@dataclass(frozen=True)
class DimAgreement:
    """Dims of `name` that an earlier declared tensor `ref` binds: (index here, index there)."""
    ref: str
    pairs: tuple
    names: tuple


def agreements(checks: tuple) -> dict:
    """name -> [DimAgreement]: each dim name is bound by the first tensor that declares it (an
    optional tensor binds nothing: it may be absent)."""
    bound, out = {}, {}
    for check in checks:
        by_ref = {}
        for i, dim in enumerate(check.dims):
            if dim in bound and bound[dim][0] != check.name:
                ref, j = bound[dim]
                by_ref.setdefault(ref, []).append((i, j, dim))
            elif dim not in bound and not check.optional:
                bound[dim] = (check.name, i)
        out[check.name] = [DimAgreement(ref, tuple((i, j) for i, j, _ in items), tuple(d for *_, d in items))
                           for ref, items in by_ref.items()]
    return out
