"""Stage 4, render: lowered instances -> the text of every generated file.

Everything is rendered in memory first; only when all of it succeeded are files written,
each only if its content changed (so ninja rebuilds only what changed), and files that no
longer belong to any spec are removed. Generation is all-or-nothing.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import jinja2

from .arch import DTYPE_BYTES, WGMMA_N
from .errors import SpecError
from .families import family
from .instance import KernelInstance
from .spec import Spec
from . import ninja
from . import op as op_decl
from .passes import banks

NAMESPACE = "attngen"
TORCH_DTYPES = {"fp32": "Float", "fp16": "Half", "bf16": "BFloat16", "e4m3": "Float8_e4m3fn"}


def environment(templates_dir: Path) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir)), undefined=jinja2.StrictUndefined,
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


def _render(env: jinja2.Environment, spec_file: str, template: str, **ctx) -> str:
    try:
        return env.get_template(template).render(spec_file=spec_file, template_name=template, **ctx)
    except jinja2.TemplateNotFound as exc:
        raise SpecError(spec_file, None, "template", f"template {exc.name} does not exist") from None
    except jinja2.TemplateError as exc:
        line = getattr(exc, "lineno", None)
        raise SpecError(f"templates/{template}", line, "template", str(exc)) from None


def render_instance(env, spec: Spec, inst: KernelInstance) -> str:
    d = inst.d
    ways = banks.ways(d.get("bank", {}))
    report = ", ".join(f"{k} {v:g}" for k, v in ways.items()) or "n/a (no shared memory)"
    return _render(env, spec.file, inst.template, inst=inst, p=inst.p, d=d,
                   kind_doc=" ".join(spec.kernels[inst.kind].doc.split()) or inst.kind,
                   reverse="true" if inst.a.get("direction") == "rev" else "false",
                   bank_report=report, smem_expr=family(inst.family).smem_bytes_at_runtime(inst))


def key_env(spec: Spec) -> dict:
    """The run-time variables as the C++ key's fields."""
    return {name: f"key.{name}" for name in spec.op.key}


def axes_match_cpp(spec: Spec, axes: dict) -> str:
    """C++ condition selecting the instances built for these axis values: the key holds each
    axis as the index of its value in the family's axis (dtype as the DType of that index)."""
    values = family(spec.family).axes
    terms = []
    for axis, value in axes.items():
        if axis == "dtype":
            terms.append(f"key.dtype == DType::k{value.upper()}")
        else:
            terms.append(f"key.{axis} == {values[axis].index(value)}")
    return " && ".join(terms)


TABLE_NOT_BUILT = ["This table's rows are not built: the extension was built without its instances",
                   "(codegen/core.py); a row gets its launcher when the runtime builds that instance on",
                   "first use and registers it by name."]


def dispatch_context(spec: Spec, instances: list[KernelInstance], built: bool = True) -> dict:
    """Everything the dispatch template prints, decided here: C++ conditions per rule, and per
    rule the candidate instances grouped by axis values, in `prefer` order. Without `built`, the
    same table with no launchers (an extension whose instances build on first use)."""
    runtime = key_env(spec)
    index = {inst.name: i for i, inst in enumerate(instances)}
    covers = [spec.kernels[inst.kind].covers.to_cpp({**runtime, **inst.p}) for inst in instances]
    def groups(members):
        by_axes = {}
        for inst in members:
            by_axes.setdefault(inst.axes, []).append(index[inst.name])
        return [{"match": axes_match_cpp(spec, dict(axes)), "entries": entries} for axes, entries in by_axes.items()]

    rules = [{"source": f"tuned: {rule.source}", "when": rule.when.to_cpp(runtime), "groups": groups(rule.instances),
              "jit_first": False} for rule in spec.tuned]
    for rule in spec.dispatch:
        kind = spec.kernels[rule.kind]
        members = sorted((i for i in instances if i.kind == rule.kind),
                         key=lambda i: tuple(i.p[k] for k in kind.prefer))
        rules.append({"source": f"{spec.file}:{rule.line}: when {rule.when.text} -> {rule.kind}",
                      "when": rule.when.to_cpp(runtime), "groups": groups(members),
                      "jit_first": kind.role == "fallback"})
    return {"family": spec.family, "op": spec.op.name, "instances": instances, "covers": covers,
            "launched": instances if built else [], "table_note": [] if built else TABLE_NOT_BUILT,
            "launchers": [i.launcher if built else "nullptr" for i in instances],
            "workspaces": [i.workspace if built else "nullptr" for i in instances],
            "roles": [spec.kernels[inst.kind].role for inst in instances],
            "runtime_vars": list(spec.op.key), "key_axes": [f"static_cast<int64_t>(key.{axis})" for axis in spec.axes],
            "rules": rules, "axis_names": ", ".join(spec.axes)}


def _arg_type(spec: Spec, name: str) -> str:
    return spec.op.arg(name).type


def key_axes_cpp(spec: Spec) -> list[tuple[str, str]]:
    """(axis, the C++ expression that fills the key's field from the arguments `a`): dtype from
    a tensor's dtype, a bool argument as 0 or 1, an int argument as the index itself (checked)."""
    out = []
    for axis, source in spec.op.dispatch_axes.items():
        if axis == "dtype":
            out.append((axis, f'dtype_of("{source}", a.{source})'))
        elif _arg_type(spec, source) == "bool":
            out.append((axis, f"a.{source} ? 1 : 0"))
        else:
            out.append((axis, f"a.{source}"))
    return out


def declared_checks_cpp(spec: Spec) -> list[str]:
    """The C++ statements of op.cpp's check_declared, from op.args (codegen/op.py TensorCheck):
    per tensor, its device (CUDA, with the first declared tensor), rank, dtype, the dims it shares
    with earlier tensors, and a contiguous last dim. An optional tensor is checked when given."""
    checks, op = spec.op.checks, spec.op
    if not checks:
        return []
    agree = op_decl.agreements(checks)
    like = op.dispatch_axes["dtype"]
    first = checks[0].name
    lines = [f'const std::string op = "{op.name}";']
    for check in checks:
        t = f"(*a.{check.name})" if check.optional else f"a.{check.name}"
        body = [f'detail::declared_device(op, "{check.name}", {t}, "{first}", '
                f'{"nullptr" if check.name == first else "&a." + first});',
                f'detail::declared_rank(op, "{check.name}", {t}, {len(check.dims)}, "{check.layout}");']
        if check.dtype == "float32":
            body.append(f'detail::declared_float32(op, "{check.name}", {t}, "{check.layout}");')
        elif check.name != like:
            body.append(f'detail::declared_dtype_like(op, "{check.name}", {t}, "{like}", a.{like});')
        for ag in agree[check.name]:
            pairs = ", ".join(f"{{{i}, {j}}}" for i, j in ag.pairs)
            body.append(f'detail::declared_agree(op, "{check.name}", {t}, "{ag.ref}", a.{ag.ref}, {{{pairs}}}, '
                        f'"{", ".join(ag.names)}");')
        if not check.any_strides:
            body.append(f'detail::declared_last_contiguous(op, "{check.name}", {t});')
        if check.optional:
            lines += [f"if (a.{check.name}) {{"] + ["  " + b for b in body] + ["}"]
        else:
            lines += body
    return lines


def _camel(text: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in text.split("_"))


def axis_constants_cpp(spec: Spec) -> list[tuple[str, int]]:
    """(C++ name, index) of each value of an axis read from an int argument (kVariantRwkv7 = 0):
    what the family's C++ compares that argument with, in the family's axis order."""
    fam = family(spec.family)
    return [(f"k{_camel(axis)}{_camel(value)}", i) for axis, source in spec.op.dispatch_axes.items()
            if axis != "dtype" and _arg_type(spec, source) == "int" for i, value in enumerate(fam.axes[axis])]


def op_context(spec: Spec, namespace: str = NAMESPACE) -> dict:
    """What the op's own templates (templates/op/, the family's op_impl.h.j2 and params.cuh.j2) print."""
    fam = family(spec.family)
    return dict(op=spec.op, family=spec.family, namespace=namespace, dtypes=list(fam.axes["dtype"]),
                key_axes=key_axes_cpp(spec), declared_checks=declared_checks_cpp(spec),
                axis_values={axis: list(values) for axis, values in fam.axes.items()},
                axis_constants=axis_constants_cpp(spec), index_axes=[(source, fam.axes[axis]) for axis, source in
                                                         spec.op.dispatch_axes.items() if _arg_type(spec, source) == "int"],
                torch_dtypes={d: TORCH_DTYPES[d] for d in spec.axes["dtype"]},
                constants=fam.support_constants, exported=fam.exported_constants)


# The op's files rendered from templates/op/ for every spec: {template: output name in the family's directory}.
OP_FILES = {"op/interface.h.j2": "interface.h", "op/op.cpp.j2": "op.cpp"}


def render_support(env, spec: Spec, namespace: str = NAMESPACE) -> dict[str, str]:
    """The family's files that are not instances: its headers, the op's interface and bindings."""
    ctx = op_context(spec, namespace)
    files = {out: _render(env, spec.file, template, **ctx)
             for template, out in family(spec.family).support_files.items()}
    files.update({f"{spec.family}/{out}": _render(env, spec.file, template, **ctx) for template, out in OP_FILES.items()})
    return files


def render_common(env) -> dict[str, str]:
    """The headers every family shares (templates/common)."""
    files = {}
    for template in sorted(env.list_templates(filter_func=lambda t: t.startswith("common/")
                                              and t.endswith((".cuh.j2", ".h.j2")))):
        files[template[:-3]] = _render(env, "specs/", template, wgmma_n=WGMMA_N)
    return files


def render_spec(env, spec: Spec, instances: list[KernelInstance], namespace: str = NAMESPACE,
                built: bool = True) -> dict[str, str]:
    """All files of one spec, as {path under generated/: content}; without `built`, those of an
    extension whose instances build on first use (its table and bindings, no kernel)."""
    files = render_support(env, spec, namespace)
    files[f"{spec.family}/dispatch.cpp"] = _render(env, spec.file, "op/dispatch.cpp.j2",
                                                   **dispatch_context(spec, instances, built))
    for inst in instances if built else ():
        files[inst.filename] = render_instance(env, spec, inst)
    return files


def manifest(specs_and_instances) -> str:
    """A JSON list of every instance: what `make list` prints and what tests iterate."""
    rows = []
    for spec, instances in specs_and_instances:
        for inst in instances:
            d = {k: v for k, v in inst.d.items() if not k.endswith("_param")}
            rows.append({"name": inst.name, "family": inst.family, "op": inst.op, "kind": inst.kind,
                         "spec": spec.file, "file": inst.filename, **inst.a, "params": inst.p,
                         "derived": d, "dtype_bytes": DTYPE_BYTES[inst.a["dtype"]]})
    return json.dumps(rows, indent=1, sort_keys=False) + "\n"


def render_all(templates_dir: Path, specs_and_instances, namespace: str = NAMESPACE,
               layout: "ninja.Layout" = ninja.DEFAULT_LAYOUT, built: bool = True) -> dict[str, str]:
    """Every generated file, as {path under the generated dir: content}. The tuner renders its
    candidates with another op namespace and layout, into a build of their own; without `built`,
    the extension's host files with tables whose instances build on first use (codegen/core.py)."""
    env = environment(templates_dir)
    files = render_common(env)
    for spec, instances in specs_and_instances:
        files.update(render_spec(env, spec, instances, namespace, built))
    ops = [(spec.family, spec.op.name) for spec, _ in specs_and_instances]
    files["extension.cpp"] = _render(env, "specs/", "op/extension.cpp.j2", namespace=namespace, ops=ops)
    files["manifest.json"] = manifest(specs_and_instances)
    files["build.ninja"] = ninja.build_file(specs_and_instances, files, layout)
    return files


def write_tree(out_dir: Path, files: dict[str, str]) -> dict[str, list]:
    """Write `files` under out_dir: unchanged files are left alone (their mtime too), stale
    ones removed. Each write goes through a temp file and an atomic rename."""
    out_dir.mkdir(parents=True, exist_ok=True)
    changed, removed = [], []
    for rel, content in sorted(files.items()):
        path = out_dir / rel
        if path.is_file() and path.read_text() == content:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as fh:
            fh.write(content)
        os.replace(tmp, path)
        changed.append(rel)
    for path in sorted(out_dir.rglob("*")):
        rel = path.relative_to(out_dir).as_posix()
        if path.is_file() and rel not in files:
            path.unlink()
            removed.append(rel)
    for path in sorted(out_dir.rglob("*"), reverse=True):
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    return {"changed": changed, "removed": removed}
