"""Stage 1, load: a YAML spec file -> typed, validated `Spec` objects.

Every problem is a SpecError naming file:line, the field and what was expected.
"""
from __future__ import annotations

from dataclasses import dataclass, field as dc_field
from pathlib import Path

from . import expr
from . import op as op_decl
from .arch import ARCHES
from .errors import SpecError
from .families import family as family_plugin
from .families import names as family_names
from .yamlloc import LocDict, LocList, load_located

TOP_KEYS = {"family", "arch", "op", "axes", "kernels", "dispatch", "tune"}
REQUIRED_TOP_KEYS = TOP_KEYS - {"tune"}
TUNE_KEYS = {"dtypes", "buckets", "kernels"}
BUCKET_KEYS = {"name", "when", "shape", "axes", "timing", "also"}
# How a bucket's candidates are timed: calls issued one after another from Python, or replayed
# from a CUDA graph (what serving engines do with small decode batches, where the host's issue
# time would otherwise hide the kernels' difference).
BUCKET_TIMINGS = ("eager", "graph")
BUCKET_REQUIRED = {"name", "when", "shape"}
OP_KEYS = {"name", "schema", "doc", "outputs", "key", "dispatch_axes", "args"}
KERNEL_KEYS = {"template", "doc", "role", "grid", "where", "covers", "prefer", "spill_bytes"}
# A kind's role: dispatched by the rules (the default); `fallback`, which an instance built on
# first use for the call goes before (codegen/jit.py); `bench`, never dispatched and built only
# into the benchmark extension (`python -m codegen build --bench`), not into the shipped one.
ROLES = ("dispatch", "fallback", "bench")
RULE_KEYS = {"kind", "when"}


@dataclass(frozen=True)
class KernelKind:
    name: str
    template: str
    doc: str
    role: str             # one of ROLES
    grid: dict            # param -> tuple of values, in declared order
    where: tuple          # Expr, all must hold
    covers: expr.Expr     # runtime: may this instance serve the call?
    prefer: tuple         # params to sort ascending by: the smallest covering bucket wins
    line: int
    param_lines: dict     # param -> line of its grid entry, for errors found by the passes
    where_lines: tuple = ()  # line of each where: expression
    # The ptxas spill bytes (stores or loads, per kernel) an instance may report: an expression
    # of the grid and axes, 0 where the spec says nothing (the compile tier holds the build to it).
    spill_bytes: expr.Expr | None = None


@dataclass(frozen=True)
class Rule:
    kind: str
    when: expr.Expr
    line: int


@dataclass(frozen=True)
class Bucket:
    """A shape bucket the tuned dispatch distinguishes, timed on its representative shape.
    `axes` fixes axis values (besides dtype) for this bucket: its candidates are timed at them
    and its winner serves only them (the delta rule's variant: an RWKV-7 winner is not
    Gated DeltaNet's). Axes it leaves free take the family's TunePlan value when timed, and the
    winner serves every value of them."""
    name: str
    when: expr.Expr
    shape: dict           # runtime shape: B, H, L, E, M
    line: int
    axes: dict = dc_field(default_factory=dict)
    timing: str = "eager"  # BUCKET_TIMINGS
    # More shapes the bucket's candidates are timed on: a candidate scores the geometric mean of
    # its times over `shape` and these, so that the winner holds across the calls the bucket
    # admits rather than on one shape whose near-ties flip from run to run.
    also: tuple = ()

    @property
    def shapes(self) -> tuple:
        return (self.shape, *self.also)


@dataclass(frozen=True)
class TuneSpec:
    dtypes: tuple
    buckets: tuple        # Bucket, in dispatch order
    kernels: dict         # kind -> KernelKind with the tuning grid and where


@dataclass(frozen=True)
class Spec:
    file: str
    family: str
    arch: str
    op: op_decl.OpDecl
    axes: dict            # axis -> tuple of values (dtype, direction, ...)
    kernels: dict         # name -> KernelKind, in declared order
    dispatch: tuple       # Rule, in order
    tune: TuneSpec | None = None
    tuned: tuple = ()     # dispatch.TunedRule from tuned/<arch>/<stem>.yaml, set by the pipeline

    @property
    def stem(self) -> str:
        return Path(self.file).stem


class _Ctx:
    """Error helper bound to one file."""

    def __init__(self, file: str):
        self.file = file

    def fail(self, line, field, message):
        raise SpecError(self.file, line, field, message)

    def mapping(self, value, line, field) -> LocDict:
        if not isinstance(value, LocDict):
            self.fail(line, field, f"expected a mapping, got {_kind(value)}")
        return value

    def keys(self, mapping: LocDict, allowed: set, required: set, field: str):
        for key in mapping:
            if key not in allowed:
                self.fail(mapping.line_of(key), f"{field}.{key}" if field else str(key),
                          f"unknown key; expected one of {sorted(allowed)}")
        for key in sorted(required):
            if key not in mapping:
                self.fail(mapping.line, f"{field}.{key}" if field else key, "missing required field")

    def string(self, mapping: LocDict, key, field) -> str:
        value = mapping[key]
        if not isinstance(value, str) or not value.strip():
            self.fail(mapping.line_of(key), field, f"expected a non-empty string, got {_kind(value)}")
        return value

    def expression(self, text, names, line, field, strings: bool = False) -> expr.Expr:
        try:
            return expr.parse(text, names, strings)
        except expr.ExprError as exc:
            self.fail(line, field, f"invalid expression: {exc}")


def _kind(value) -> str:
    if isinstance(value, LocDict):
        return "a mapping"
    if isinstance(value, LocList):
        return "a list" if value else "an empty list"
    return f"{type(value).__name__} {value!r}"


def load_spec(path: str | Path, templates_dir: str | Path) -> Spec:
    path = Path(path)
    file = str(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(file, None, "spec", f"cannot read: {exc.strerror}") from None
    ctx = _Ctx(file)
    doc = ctx.mapping(load_located(text, file), 1, "spec")
    ctx.keys(doc, TOP_KEYS, REQUIRED_TOP_KEYS, "")

    family = ctx.string(doc, "family", "family")
    fam = family_plugin(family)
    if fam is None:
        ctx.fail(doc.line_of("family"), "family", f"unknown family {family!r}; expected one of {family_names()}")
    arch = ctx.string(doc, "arch", "arch")
    if arch not in ARCHES:
        ctx.fail(doc.line_of("arch"), "arch", f"unknown arch {arch!r}; expected one of {sorted(ARCHES)}")

    axes = _load_axes(ctx, doc, fam)
    op = _load_op(ctx, doc, fam)
    kernels = _load_kernels(ctx, doc, fam, op, axes, Path(templates_dir))
    dispatch = _load_dispatch(ctx, doc, op, kernels)
    tune = _load_tune(ctx, doc, fam, op, axes, kernels, Path(templates_dir)) if "tune" in doc else None
    return Spec(file, family, arch, op, axes, kernels, dispatch, tune)


def _load_op(ctx: _Ctx, doc: LocDict, fam) -> op_decl.OpDecl:
    """The op declaration (codegen/op.py): the schema, the outputs, the dispatch key."""
    op = ctx.mapping(doc["op"], doc.line_of("op"), "op")
    ctx.keys(op, OP_KEYS, OP_KEYS - {"doc", "args"}, "op")
    name = ctx.string(op, "name", "op.name")
    schema = ctx.string(op, "schema", "op.schema")
    if not name.isidentifier():
        ctx.fail(op.line_of("name"), "op.name", f"expected an identifier, got {name!r}")
    lines = {"op.schema": op.line_of("schema"), "op.outputs": op.line_of("outputs"),
             "op.dispatch_axes": op.line_of("dispatch_axes"), "op.key": op.line_of("key"), "op.args": op.line_of("args")}
    try:
        args, returns = op_decl.parse_schema(name, schema)
        outputs_node = ctx.mapping(op["outputs"], op.line_of("outputs"), "op.outputs")
        if len(outputs_node) != returns:
            ctx.fail(op.line_of("outputs"), "op.outputs",
                     f"the schema returns {returns} tensor(s) but {len(outputs_node)} output(s) are declared")
        outputs = []
        for out_name, body in outputs_node.items():
            field = f"op.outputs.{out_name}"
            body = ctx.mapping(body, outputs_node.line_of(out_name), field)
            ctx.keys(body, {"shape", "dtype", "like"}, {"shape"}, field)
            lines[field] = outputs_node.line_of(out_name)
            if not str(out_name).isidentifier() or out_name in {a.name for a in args}:
                ctx.fail(outputs_node.line_of(out_name), field, "expected an identifier that names no argument")
            outputs.append(op_decl.output(args, out_name, dict(body), field))
        key = ctx.mapping(op["key"], op.line_of("key"), "op.key")
        for var, what in key.items():
            if not str(var).isidentifier() or not isinstance(what, str):
                ctx.fail(key.line_of(var), f"op.key.{var}", "expected <variable>: <what it is>")
        axes_node = ctx.mapping(op["dispatch_axes"], op.line_of("dispatch_axes"), "op.dispatch_axes")
        dispatch_axes = {str(axis): str(source) for axis, source in axes_node.items()}
        op_decl.check_dispatch_axes(args, fam.axes, dispatch_axes)
        checks = ()
        if "args" in op:
            declared = ctx.mapping(op["args"], op.line_of("args"), "op.args")
            lines.update({f"op.args.{name}": declared.line_of(name) for name in declared})
            checks = op_decl.tensor_checks(args, {str(k): (dict(v) if isinstance(v, dict) else v)
                                                  for k, v in declared.items()})
    except op_decl.DeclError as exc:
        ctx.fail(_decl_line(lines, exc.field), exc.field, str(exc))
    return op_decl.OpDecl(name, schema, " ".join(str(op.get("doc", "")).split()), args, returns, tuple(outputs),
                          dict(key), dispatch_axes, checks)


def _decl_line(lines: dict, field: str) -> int:
    """The line of the deepest declared field that `field` lies in."""
    while field not in lines and "." in field:
        field = field.rsplit(".", 1)[0]
    return lines.get(field)


def _values(ctx: _Ctx, value, line, field, allowed=None, allow_auto=False, allow_zero=False) -> tuple:
    if not isinstance(value, LocList) or not value:
        ctx.fail(line, field, f"expected a non-empty list, got {_kind(value)}")
    for i, item in enumerate(value):
        ok = (isinstance(item, int) and not isinstance(item, bool) and item >= (0 if allow_zero else 1)) \
            if allowed is None else item in allowed
        if allow_auto and item == "auto":
            ok = True
        if not ok:
            want = f"one of {sorted(allowed)}" if allowed else ("a non-negative" if allow_zero else "a positive") + " integer"
            want += " or 'auto'" if allow_auto else ""
            ctx.fail(value.line_of(i), field, f"expected {want}, got {_kind(item)}")
    if len(set(value)) != len(value):
        ctx.fail(line, field, "the list repeats a value")
    return tuple(value)


def _load_axes(ctx: _Ctx, doc: LocDict, fam) -> dict:
    axes = ctx.mapping(doc["axes"], doc.line_of("axes"), "axes")
    ctx.keys(axes, set(fam.axes), set(fam.axes), "axes")
    return {name: _values(ctx, axes[name], axes.line_of(name), f"axes.{name}", fam.axes[name])
            for name in axes}


def _load_kernels(ctx: _Ctx, doc: LocDict, fam, op, axes: dict, templates_dir: Path,
                  base: dict | None = None, prefix: str = "kernels") -> dict:
    """The kernel kinds; with `base` (tuning), each entry names a kind of `base` and brings
    only its tuning `grid` and `where`, the rest coming from the kind."""
    kernels = ctx.mapping(doc["kernels"], doc.line_of("kernels"), prefix)
    if not kernels:
        ctx.fail(kernels.line, prefix, "expected at least one kernel kind")
    out = {}
    for name, body in kernels.items():
        field = f"{prefix}.{name}"
        body = ctx.mapping(body, kernels.line_of(name), field)
        if base is not None:
            if name not in base:
                ctx.fail(kernels.line_of(name), field, f"unknown kernel kind {name!r}; expected one of {list(base)}")
            ctx.keys(body, {"grid", "where"}, {"grid"}, field)
            kind = base[name]
            body = LocDict({**{"template": kind.template, "covers": kind.covers.text, "doc": kind.doc,
                               "role": kind.role, "prefer": LocList(kind.prefer)}, **body})
            body.line, body.key_lines = kernels.line_of(name), dict(kernels[name].key_lines)
        ctx.keys(body, KERNEL_KEYS, {"template", "grid", "covers"}, field)
        template = ctx.string(body, "template", f"{field}.template")
        if template not in fam.lowerings:
            ctx.fail(body.line_of("template"), f"{field}.template",
                     f"family {fam.name!r} has no lowering for template {template!r}; expected one of "
                     f"{sorted(fam.lowerings)}")
        if not (templates_dir / template).is_file():
            ctx.fail(body.line_of("template"), f"{field}.template",
                     f"template file {templates_dir / template} does not exist")
        grid = _load_grid(ctx, body, field, fam.lowerings[template].params)
        grid_map = body["grid"]
        param_lines = {p: grid_map.line_of(p) for p in grid}
        derived = set(grid) | set(axes) | set(fam.derived_names)
        where = body.get("where", LocList())
        if isinstance(where, str):
            where = LocList([where])
            where.line, where.item_lines = body.line_of("where"), [body.line_of("where")]
        if not isinstance(where, LocList):
            ctx.fail(body.line_of("where"), f"{field}.where", f"expected a list of expressions, got {_kind(where)}")
        where_exprs = tuple(ctx.expression(w, derived, where.line_of(i), f"{field}.where[{i}]", strings=True)
                            for i, w in enumerate(where))
        covers = ctx.expression(body["covers"], set(grid) | set(op.key),
                                body.line_of("covers"), f"{field}.covers")
        prefer = body.get("prefer", LocList())
        if not isinstance(prefer, LocList) or any(p not in grid for p in prefer):
            ctx.fail(body.line_of("prefer"), f"{field}.prefer",
                     f"expected a list of grid parameters from {list(grid)}")
        role = body.get("role", "dispatch")
        if role not in ROLES:
            ctx.fail(body.line_of("role"), f"{field}.role", f"expected one of {list(ROLES)}, got {_kind(role)}")
        spill_bytes = None
        if "spill_bytes" in body:
            spill_bytes = ctx.expression(str(body["spill_bytes"]), derived, body.line_of("spill_bytes"),
                                         f"{field}.spill_bytes", strings=True)
        out[name] = KernelKind(name, template, str(body.get("doc", "")), role, grid, where_exprs, covers,
                               tuple(prefer), kernels.line_of(name), param_lines,
                               tuple(where.line_of(i) for i in range(len(where))), spill_bytes)
    return out


def _bucket_shape(ctx: _Ctx, fam, node, line: int, field: str) -> dict:
    """A bucket's shape (its `shape:` or one of its `also:`): every dim of the family's tuning
    plan (those with a default may be left out), positive integers, 0 or 1 for the dims that are
    switches."""
    shape = ctx.mapping(node, line, field)
    ctx.keys(shape, set(fam.tune.shape_dims), set(fam.tune.shape_dims) - set(fam.tune.defaults), field)
    for dim, size in shape.items():
        if dim in fam.tune.flags:
            if size not in (0, 1) or isinstance(size, bool):
                ctx.fail(shape.line_of(dim), f"{field}.{dim}", f"expected 0 or 1 (a switch), got {_kind(size)}")
        elif not isinstance(size, int) or isinstance(size, bool) or size < 1:
            ctx.fail(shape.line_of(dim), f"{field}.{dim}", f"expected a positive integer, got {_kind(size)}")
    return {**fam.tune.defaults, **shape}


def _bucket_axes(ctx: _Ctx, node: LocDict, axes: dict, field: str) -> dict:
    """A bucket's `axes:`: values of the spec's axes other than dtype (tune.dtypes says those)."""
    if "axes" not in node:
        return {}
    fixed = ctx.mapping(node["axes"], node.line_of("axes"), f"{field}.axes")
    for axis, value in fixed.items():
        if axis == "dtype" or axis not in axes:
            ctx.fail(fixed.line_of(axis), f"{field}.axes.{axis}",
                     f"expected an axis of the spec other than dtype ({[a for a in axes if a != 'dtype']})")
        if value not in axes[axis]:
            ctx.fail(fixed.line_of(axis), f"{field}.axes.{axis}", f"expected one of {list(axes[axis])}, got {value!r}")
    return dict(fixed)


def _load_tune(ctx: _Ctx, doc: LocDict, fam, op, axes: dict, kernels: dict, templates_dir: Path) -> TuneSpec:
    tune = ctx.mapping(doc["tune"], doc.line_of("tune"), "tune")
    ctx.keys(tune, TUNE_KEYS, TUNE_KEYS, "tune")
    dtypes = _values(ctx, tune["dtypes"], tune.line_of("dtypes"), "tune.dtypes", axes["dtype"])
    buckets_node = tune["buckets"]
    if not isinstance(buckets_node, LocList) or not buckets_node:
        ctx.fail(tune.line_of("buckets"), "tune.buckets", f"expected a non-empty list, got {_kind(buckets_node)}")
    buckets, names = [], set()
    for i, node in enumerate(buckets_node):
        field = f"tune.buckets[{i}]"
        node = ctx.mapping(node, buckets_node.line_of(i), field)
        ctx.keys(node, BUCKET_KEYS, BUCKET_REQUIRED, field)
        name = ctx.string(node, "name", f"{field}.name")
        if not name.isidentifier() or name in names:
            ctx.fail(node.line_of("name"), f"{field}.name", f"expected a new identifier, got {name!r}")
        names.add(name)
        when = ctx.expression(node["when"], set(op.key), node.line_of("when"), f"{field}.when")
        shape = _bucket_shape(ctx, fam, node["shape"], node.line_of("shape"), f"{field}.shape")
        also_node = node.get("also", [])
        if not isinstance(also_node, list) or not also_node and "also" in node:
            ctx.fail(node.line_of("also"), f"{field}.also", f"expected a non-empty list of shapes, got {_kind(also_node)}")
        also = tuple(_bucket_shape(ctx, fam, item, also_node.line_of(k), f"{field}.also[{k}]")
                     for k, item in enumerate(also_node))
        timing = node.get("timing", "eager")
        if timing not in BUCKET_TIMINGS:
            ctx.fail(node.line_of("timing"), f"{field}.timing", f"expected one of {', '.join(BUCKET_TIMINGS)}, got {timing!r}")
        buckets.append(Bucket(name, when, shape, node.line_of("name"), _bucket_axes(ctx, node, axes, field),
                              timing, also))
    kinds = _load_kernels(ctx, tune, fam, op, axes, templates_dir, base=kernels, prefix="tune.kernels")
    return TuneSpec(dtypes, tuple(buckets), kinds)


def _load_grid(ctx: _Ctx, body: LocDict, field: str, params: dict) -> dict:
    grid = ctx.mapping(body["grid"], body.line_of("grid"), f"{field}.grid")
    ctx.keys(grid, set(params), set(params), f"{field}.grid")
    # Keep the template's declared parameter order: it is the order of the instance name.
    return {p: _values(ctx, grid[p], grid.line_of(p), f"{field}.grid.{p}",
                       allow_auto=params[p] == "auto_ok", allow_zero=params[p] == "int0")
            for p in params}


def _load_dispatch(ctx: _Ctx, doc: LocDict, op, kernels: dict) -> tuple:
    rules = doc["dispatch"]
    if not isinstance(rules, LocList) or not rules:
        ctx.fail(doc.line_of("dispatch"), "dispatch", f"expected a non-empty list of rules, got {_kind(rules)}")
    out = []
    for i, rule in enumerate(rules):
        field = f"dispatch[{i}]"
        rule = ctx.mapping(rule, rules.line_of(i), field)
        ctx.keys(rule, RULE_KEYS, RULE_KEYS, field)
        kind = rule["kind"]
        if kind not in kernels:
            ctx.fail(rule.line_of("kind"), f"{field}.kind",
                     f"unknown kernel kind {kind!r}; expected one of {list(kernels)}")
        if kernels[kind].role == "bench":
            ctx.fail(rule.line_of("kind"), f"{field}.kind", f"kind {kind!r} has role bench: no rule dispatches it")
        when = ctx.expression(rule["when"], set(op.key), rule.line_of("when"), f"{field}.when")
        out.append(Rule(kind, when, rule.line_of(i)))
    return tuple(out)
