"""YAML with line numbers: every mapping and list remembers where each entry stood.

PyYAML's composer already knows the marks; we keep them instead of throwing them away, so
that every later error can say file:line.
"""
from __future__ import annotations

from typing import Any

import yaml

from .errors import SpecError


class LocDict(dict):
    """A mapping that knows its own line and the line of each key (1-based)."""

    line: int
    key_lines: dict

    def line_of(self, key) -> int:
        return self.key_lines.get(key, self.line)


class LocList(list):
    """A list that knows its own line and the line of each item (1-based)."""

    line: int
    item_lines: list

    def line_of(self, index: int) -> int:
        return self.item_lines[index] if index < len(self.item_lines) else self.line


def _convert(node: yaml.Node, loader: yaml.SafeLoader, file: str) -> Any:
    if isinstance(node, yaml.MappingNode):
        out = LocDict()
        out.line = node.start_mark.line + 1
        out.key_lines = {}
        for key_node, value_node in node.value:
            key = _convert(key_node, loader, file)
            if key in out:
                raise SpecError(file, key_node.start_mark.line + 1, str(key), "duplicate key")
            out[key] = _convert(value_node, loader, file)
            out.key_lines[key] = key_node.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        out = LocList(_convert(item, loader, file) for item in node.value)
        out.line = node.start_mark.line + 1
        out.item_lines = [item.start_mark.line + 1 for item in node.value]
        return out
    return loader.construct_object(node, deep=True)


def load_located(text: str, file: str) -> Any:
    """Parse YAML text into LocDict/LocList/scalars; a syntax error becomes a SpecError."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        raise SpecError(file, line, "yaml", f"syntax error: {exc.problem or exc}") from None
    finally:
        loader.dispose()
    if node is None:
        raise SpecError(file, 1, "spec", "the file is empty; expected a mapping with 'family:'")
    return _convert(node, loader, file)
