"""Line and column of the reported nodes.

libcst's ``PositionProvider`` generates the code of the whole module to find positions; on a large
file with a single report that costs as much as the parse. Here only the top-level statements that
hold a report go through it, each as a one-statement module, and ``ast`` line numbers (flake8's
tree) place each statement in the file. When the two trees do not line up (they always should),
the whole module goes through ``PositionProvider``.
"""

from __future__ import annotations

import ast
from typing import Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import libcst as cst
from libcst.metadata import CodePosition, CodeRange, MetadataWrapper, PositionProvider

from .cstwalk import iter_children

__all__ = ["Positions"]

_Table = Mapping[cst.CSTNode, CodeRange]


class Positions:
    """``positions[node]``: the ``CodeRange`` of a reported node (or of a node in the same top-level
    statement), in the lines of the whole file."""

    def __init__(self, module: cst.Module, tree: Optional[ast.AST], nodes: Iterable[cst.CSTNode]) -> None:
        starts = _statement_starts(module, tree) if isinstance(tree, ast.Module) else None
        # (positions relative to a statement, line offset of that statement)
        self._tables: List[Tuple[_Table, int]] = []
        if starts is None:
            self._tables.append((_resolve(module), 0))
            return
        wanted = {id(n) for n in nodes}
        for stmt, start in zip(module.body, starts):
            if not wanted:
                break
            found = _ids_in(stmt) & wanted
            if found:
                wanted -= found
                self._tables.append((_resolve(module.with_changes(header=(), body=(stmt,), footer=())), start - 1))

    def __getitem__(self, node: cst.CSTNode) -> CodeRange:
        for table, offset in self._tables:
            rng = table.get(node)
            if rng is not None:
                if not offset:
                    return rng
                return CodeRange(CodePosition(rng.start.line + offset, rng.start.column),
                                 CodePosition(rng.end.line + offset, rng.end.column))
        raise KeyError(node)


def _resolve(module: cst.Module) -> _Table:
    return MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)


def _ids_in(root: cst.CSTNode) -> Set[int]:
    out = set()
    pending = [root]
    while pending:
        node = pending.pop()
        out.add(id(node))
        pending.extend(iter_children(node))
    return out


def _statement_starts(module: cst.Module, tree: ast.Module) -> Optional[List[int]]:
    """The first line (comments and blank lines it owns included) of each top-level libcst statement,
    from the line numbers of the matching ``ast`` statements; None if the trees do not line up."""
    starts: List[int] = []
    ast_body: Sequence[ast.stmt] = tree.body
    i = 0
    for stmt in module.body:
        if i >= len(ast_body):
            return None
        first = ast_body[i]
        if isinstance(stmt, cst.SimpleStatementLine):
            i += len(stmt.body)  # ``a = 1; b = 2`` is one libcst line, two ast statements
        else:
            i += 1
        line = first.lineno
        lead = len(stmt.leading_lines)
        decorators = getattr(stmt, "decorators", ())
        if decorators:
            ast_decorators = getattr(first, "decorator_list", None)
            if not ast_decorators:
                return None
            line = min(d.lineno for d in ast_decorators)
            lead += len(decorators[0].leading_lines)
        starts.append(line - lead)
    if i != len(ast_body) or starts != sorted(starts):
        return None
    return starts
