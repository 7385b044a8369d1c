"""Small integer/boolean expressions used by `where:`, `when:` and `covers:`.

They are written in Python syntax, checked against a whitelist of node types and names,
evaluated in Python (expansion) and translated to C++ (dispatch), so one text drives both.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "/", ast.Mod: "%"}
_PY_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
              ast.Mult: lambda a, b: a * b, ast.FloorDiv: lambda a, b: a // b,
              ast.Mod: lambda a, b: a % b}
_CMPOPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}


class ExprError(ValueError):
    pass


INT_LIMIT = 2**63 - 1


@dataclass(frozen=True)
class Expr:
    """A parsed expression and the names it may use."""

    text: str
    tree: ast.Expression

    def names(self) -> set[str]:
        return {n.id for n in ast.walk(self.tree) if isinstance(n, ast.Name)}

    def evaluate(self, env: dict) -> int | bool:
        return _eval(self.tree.body, env)

    def to_cpp(self, env: dict | None = None) -> str:
        """C++ text; names found in `env` are replaced by their (compile-time) values."""
        return _cpp(self.tree.body, env or {})


def parse(text: str, allowed_names: set[str], strings: bool = False) -> Expr:
    """Parse `text`; raise ExprError saying what is wrong if it is not a valid expression.
    `strings`: string constants are allowed (compared with axis values such as dtype in `where:`,
    which is evaluated in Python only, never translated to C++)."""
    if isinstance(text, bool):
        text = "True" if text else "False"
    if not isinstance(text, str):
        raise ExprError(f"expected an expression string, got {type(text).__name__} {text!r}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExprError(f"does not parse: {text!r} ({exc.msg})") from None
    for node in ast.walk(tree):
        _check_node(node, text, strings)
        if isinstance(node, ast.Name) and node.id not in allowed_names:
            raise ExprError(
                f"unknown name {node.id!r} in {text!r}; expected one of {sorted(allowed_names)}")
    return Expr(text, tree)


def _check_node(node: ast.AST, text: str, strings: bool) -> None:
    ok = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub,
          ast.BinOp, ast.Compare, ast.Name, ast.Load, ast.Constant, ast.Tuple, ast.In, ast.NotIn,
          *_BINOPS, *_CMPOPS)
    if not isinstance(node, ok):
        raise ExprError(f"{type(node).__name__} is not allowed in {text!r}")
    if isinstance(node, ast.Constant) and not isinstance(node.value, (int, bool)) \
            and not (strings and isinstance(node.value, str)):
        kinds = "integer, boolean and string" if strings else "integer and boolean"
        raise ExprError(f"only {kinds} constants are allowed in {text!r}")


def _eval(node: ast.AST, env: dict):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.Tuple):
        return tuple(_eval(e, env) for e in node.elts)
    if isinstance(node, ast.BoolOp):
        vals = (_eval(v, env) for v in node.values)
        return all(vals) if isinstance(node.op, ast.And) else any(vals)
    if isinstance(node, ast.UnaryOp):
        val = _eval(node.operand, env)
        return (not val) if isinstance(node.op, ast.Not) else -val
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, env), _eval(node.right, env)
        op = type(node.op)
        if not all(isinstance(x, int) for x in (a, b)):
            raise ExprError(f"arithmetic takes integers, got {type(a).__name__} and {type(b).__name__}")
        if op in (ast.FloorDiv, ast.Mod) and b == 0:
            raise ExprError("division by zero")
        out = _PY_BINOPS[op](a, b)
        if abs(out) > INT_LIMIT:  # C++ evaluates the same text in 64 bits
            raise ExprError(f"{a} {_BINOPS[op]} {b} leaves the 64-bit range")
        return out
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env)
        for op, comp in zip(node.ops, node.comparators):
            right = _eval(comp, env)
            if isinstance(op, ast.In):
                ok = left in right
            elif isinstance(op, ast.NotIn):
                ok = left not in right
            else:
                ok = {ast.Eq: left == right, ast.NotEq: left != right, ast.Lt: left < right,
                      ast.LtE: left <= right, ast.Gt: left > right, ast.GtE: left >= right}[type(op)]
            if not ok:
                return False
            left = right
        return True
    raise ExprError(f"cannot evaluate {ast.dump(node)}")


def _cpp(node: ast.AST, env: dict) -> str:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool):
            return "true" if node.value else "false"
        return str(node.value)
    if isinstance(node, ast.Name):
        if node.id in env:
            val = env[node.id]
            return ("true" if val else "false") if isinstance(val, bool) else str(val)
        return node.id
    if isinstance(node, ast.BoolOp):
        joiner = " && " if isinstance(node.op, ast.And) else " || "
        return "(" + joiner.join(_cpp(v, env) for v in node.values) + ")"
    if isinstance(node, ast.UnaryOp):
        return ("!" if isinstance(node.op, ast.Not) else "-") + "(" + _cpp(node.operand, env) + ")"
    if isinstance(node, ast.BinOp):
        return f"({_cpp(node.left, env)} {_BINOPS[type(node.op)]} {_cpp(node.right, env)})"
    if isinstance(node, ast.Compare):
        parts, left = [], node.left
        for op, comp in zip(node.ops, node.comparators):
            if isinstance(op, (ast.In, ast.NotIn)):
                if not isinstance(comp, ast.Tuple):
                    raise ExprError("'in' needs a literal tuple on its right")
                x = _cpp(left, env)
                alts = " || ".join(f"{x} == {_cpp(e, env)}" for e in comp.elts)
                parts.append(f"({alts})" if isinstance(op, ast.In) else f"!({alts})")
            else:
                parts.append(f"({_cpp(left, env)} {_CMPOPS[type(op)]} {_cpp(comp, env)})")
            left = comp
        return parts[0] if len(parts) == 1 else "(" + " && ".join(parts) + ")"
    raise ExprError(f"cannot translate {ast.dump(node)}")
