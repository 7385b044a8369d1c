"""The layering the architecture promises, read from the import statements of the tree:
bench -> attngen (runtime) -> codegen (compiler), never upwards, and no import cycle between
codegen's stage modules (a package counts as one node: passes and families may not import
each other both ways)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("codegen", "attngen", "bench")   # lowest first


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the modules `path` imports (relative imports resolved)."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)  # `from . import x` names a module
    return out


def _tree(top: str) -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in sorted((ROOT / top).rglob("*.py"))}


def test_no_layer_imports_one_above_it():
    for low, top in enumerate(LAYERS):
        above = LAYERS[low + 1:]
        for module, imports in _tree(top).items():
            bad = sorted(name for name in imports if name.split(".")[0] in above)
            assert not bad, f"{module} ({top}) imports {bad} from a layer above it"


def _node(module: str) -> str:
    """codegen.families.paged -> codegen.families; codegen.render -> codegen.render."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _graph(tree: dict[str, set[str]]) -> dict[str, set[str]]:
    nodes = {_node(m) for m in tree}
    graph: dict[str, set[str]] = {}
    for module, imports in tree.items():
        deps = {_node(name) for name in imports if _node(name) in nodes}
        graph.setdefault(_node(module), set()).update(deps - {_node(module), "codegen"})
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as a path that returns to its start, or None (depth-first search)."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                trail = path + [node]
                return trail[trail.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, path + [node])
                if found:
                    return found
        state[node] = 2
        return None
    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_codegen_has_no_import_cycle_between_its_parts():
    cycle = _find_cycle(_graph(_tree("codegen")))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_sees_a_cycle():
    """Not vacuous: the family plug-ins import passes, so passes importing a family (as the
    lowering driver once did from passes/__init__.py) is reported."""
    tree = _tree("codegen")
    assert any(name.startswith("codegen.passes") for name in tree["codegen.families.paged"])
    tree["codegen.passes"] = tree["codegen.passes"] | {"codegen.families.family"}
    assert _find_cycle(_graph(tree)) in (["codegen.families", "codegen.passes", "codegen.families"],
                                         ["codegen.passes", "codegen.families", "codegen.passes"])
