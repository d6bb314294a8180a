"""Skip code nested too deep to analyse on the stack at hand, and check the rest of the file.

libcst nests what Python's ``ast`` keeps flat (each ``and`` of a chain, each ``elif``), and its parser,
its position provider and the analysis recurse once per level. The engine first retries a deep file in
a thread with a large stack (:mod:`lint_plugin.deep_stack`); where no such thread can run (an
address-space limit, a platform that refuses the stack size) or even it overflows, the file is linted
once more with its deepest parts masked here: each expression or statement nested deeper than the stack
allows is replaced, in the source text, by a placeholder that spans the same lines and ends at the same
column, so that every report outside it keeps its exact position.

Nesting is read from the ``ast`` (flake8's tree), whose traversal here is iterative, as libcst depth
estimated from above: two levels per ``ast`` level, one per term of a boolean chain and per ``elif``.
"""

from __future__ import annotations

import ast
import re
import sys
from typing import List, NamedTuple, Optional, Tuple

__all__ = ["Masked", "mask_deep_code", "nesting_budget"]

# Python frames the analysis and libcst spend per libcst level, at most (a call: Call, then Arg, about seven
# frames for the two), and the frames kept free for the pipeline around the deepest recursion
_FRAMES_PER_LEVEL = 4
_FRAMES_SPARE = 150
_MIN_BUDGET = 20
# libcst levels per ``ast`` level: a statement body (IndentedBlock, SimpleStatementLine), a subscript's slice
# (SubscriptElement, Index), a comprehension's parts and a lambda's defaults (CompFor/CompIf, Parameters/Param)
_BODY_LEVELS = 3
_NESTED_LEVELS = 3
_LEVELS = 2
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)?")


class Masked(NamedTuple):
    """The source with its deepest parts replaced, and where the first of them starts (None if none was)."""

    source: str
    first: Optional[Tuple[int, int]]  # (line, column), the line 1-based


def nesting_budget() -> int:
    """How many libcst levels the analysis can nest from the current frame without reaching the recursion
    limit."""
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return max(_MIN_BUDGET, (sys.getrecursionlimit() - depth - _FRAMES_SPARE) // _FRAMES_PER_LEVEL)


class _Region(NamedTuple):
    start: Tuple[int, int]  # (line, column in characters), 1-based line
    end: Tuple[int, int]
    kind: str  # "expression", "statement" or "elif"


def mask_deep_code(source: str, tree: ast.Module, budget: int) -> Masked:
    """``source`` (parsed as ``tree``) with every expression and statement nested deeper than ``budget``
    libcst levels replaced by a placeholder of the same extent: ``(___)`` for an expression (a name no code
    binds, so its kind is unknown), ``pass`` for a statement, ``else: pass`` for the rest of an ``elif``
    chain."""
    lines = _LINE.findall(source)
    regions = _deep_regions(tree, budget, lines)
    if not regions:
        return Masked(source, None)
    regions.sort()
    for region in reversed(regions):  # from the end, so that earlier positions stay valid
        _replace(lines, region)
    return Masked("".join(lines), regions[0].start)


def _deep_regions(tree: ast.Module, budget: int, lines: List[str]) -> List[_Region]:
    regions: List[_Region] = []
    pending: List[Tuple[ast.AST, int]] = [(stmt, _LEVELS) for stmt in tree.body]
    while pending:
        node, depth = pending.pop()
        if depth > budget and isinstance(node, (ast.expr, ast.stmt)) and _has_children(node):
            regions.append(_region(node, lines))
            continue
        if isinstance(node, ast.JoinedStr):
            continue  # the positions inside an f-string are not its source's before Python 3.12
        if isinstance(node, ast.BoolOp):
            pending.extend(_bool_chain(node, depth, budget, lines, regions))
            continue
        for field, value in ast.iter_fields(node):
            children = value if isinstance(value, list) else [value]
            for child in children:
                if isinstance(child, (ast.expr, ast.stmt, ast.excepthandler, ast.comprehension, ast.arguments,
                                      ast.arg, ast.keyword, ast.withitem, ast.match_case)):
                    pending.append((child, depth + _levels(node, field, child, lines)))
    return regions


def _levels(parent: ast.AST, field: str, child: ast.AST, lines: List[str]) -> int:
    """libcst levels between ``parent`` and its ``child`` in ``field``, from above."""
    if isinstance(child, ast.stmt):
        if field == "orelse" and isinstance(parent, ast.If) and _is_elif(child, lines):
            return 1  # libcst nests each ``elif`` in the ``If`` before it
        return _BODY_LEVELS
    if isinstance(parent, (ast.Subscript, ast.comprehension, ast.arguments, ast.Lambda)) \
            or isinstance(child, ast.comprehension):
        return _NESTED_LEVELS
    return _LEVELS


def _bool_chain(node: ast.BoolOp, depth: int, budget: int, lines: List[str],
                regions: List[_Region]) -> List[Tuple[ast.AST, int]]:
    """The terms of ``a and b and c`` to walk, at their libcst depths (libcst nests the chain to the left:
    the first two terms are ``len(values) - 1`` levels down, the last one level), after masking the terms
    nested deeper than ``budget`` as one region."""
    values = node.values
    depths = [depth + len(values) - max(i, 1) for i in range(len(values))]
    deep = [i for i, d in enumerate(depths) if d > budget]
    if deep:
        first, last = _region(values[0], lines), _region(values[deep[-1]], lines)
        regions.append(_Region(first.start, last.end, "expression"))
    return [(value, d) for value, d in zip(values, depths) if d <= budget]


def _has_children(node: ast.AST) -> bool:
    return any(isinstance(child, (ast.expr, ast.stmt)) for child in ast.iter_child_nodes(node))


def _is_elif(node: ast.stmt, lines: List[str]) -> bool:
    return isinstance(node, ast.If) and lines[node.lineno - 1].lstrip().startswith("elif")


def _column(lines: List[str], line: int, byte_offset: int) -> int:
    """The character column of an ``ast`` byte offset on a 1-based line."""
    return len(lines[line - 1].encode("utf-8")[:byte_offset].decode("utf-8", errors="replace"))


def _region(node: ast.AST, lines: List[str]) -> _Region:
    start_line, start_col = node.lineno, node.col_offset  # type: ignore[attr-defined]
    decorators = getattr(node, "decorator_list", None)
    if decorators:  # a decorated definition starts at its first ``@``
        start_line = min(d.lineno for d in decorators)
        text = lines[start_line - 1]
        start_col = len(text.encode("utf-8")) - len(text.lstrip().encode("utf-8"))
    end_line, end_col = node.end_lineno, node.end_col_offset  # type: ignore[attr-defined]
    # a simple statement is masked as an expression statement, which keeps what follows it on its line in place
    compound = isinstance(node, ast.stmt) and isinstance(getattr(node, "body", None), list)
    kind = "elif" if _is_elif(node, lines) else "statement" if compound else "expression"
    return _Region((start_line, _column(lines, start_line, start_col)),
                   (end_line, _column(lines, end_line, end_col)), kind)  # type: ignore[arg-type]


def _placeholder(region: _Region) -> List[str]:
    """The text replacing ``region``, one string per line it spans (without line endings)."""
    (start_line, start_col), (end_line, end_col) = region.start, region.end
    spanned = end_line - start_line
    if region.kind != "expression":
        # a compound statement ends its line: only a comment follows it there, which may move
        first = "else: pass" if region.kind == "elif" else "pass"
        return [first] + [""] * spanned
    if not spanned:
        width = end_col - start_col
        return ["()" if width < 3 else "(" + "_" * (width - 2) + ")"]
    return ["(_"] + [""] * (spanned - 1) + [" " * (end_col - 1) + ")"]


def _replace(lines: List[str], region: _Region) -> None:
    (start_line, start_col), (end_line, end_col) = region.start, region.end
    first, last = lines[start_line - 1], lines[end_line - 1]
    body = last.rstrip("\r\n")
    ending = last[len(body):]
    new = _placeholder(region)
    new[0] = first[:start_col] + new[0]
    new[-1] += body[end_col:] + ending
    for i in range(len(new) - 1):
        line = lines[start_line - 1 + i]
        new[i] += line[len(line.rstrip("\r\n")):]  # each line keeps its own ending
    lines[start_line - 1:end_line] = new
