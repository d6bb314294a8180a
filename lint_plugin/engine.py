"""Lint one file: the prefilter, one libcst parse, discovery, the data flow, positions, ``# noqa``.

:func:`lint_source` is the whole pipeline and what the flake8 plugin calls; it never raises
(unless asked to, for tests): a file libcst cannot parse yields a single ``JX000`` result, and a
file too deeply nested for the default recursion limit is analysed again with a deeper stack, or,
where that cannot run, with its deepest code skipped (one ``JX000`` result says where) and the rest
checked.
"""

from __future__ import annotations

import ast
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

import libcst as cst

from .deep_stack import DeepStackUnavailable, call_with_deep_stack
from .discovery import discover
from .fixpoint import analyze
from .masking import mask_deep_code, nesting_budget
from .noqa import noqa_span, silenced
from .positions import Positions
from .prefilter import applicable_rules
from .rules import ANYWHERE, PLAIN, RULES, Rule
from .traced_decorators import TracedDecorators
from .walk import Hook, Report

__all__ = ["PARSE_ERROR_CODE", "Violation", "lint_source"]

PARSE_ERROR_CODE = "JX000"


class Violation(NamedTuple):
    line: int  # 1-based
    col: int   # 0-based, as flake8 plugins report it (flake8 prints col + 1)
    code: str
    message: str  # starts with the code


_RULE_INSTANCES: List[Rule] = [cls() for cls in RULES.values()]
_DISPATCH_CACHE: Dict[Tuple[bool, bool], Dict[type, List[Hook]]] = {}


def _dispatch_for(traced: bool, plain: bool) -> Dict[type, List[Hook]]:
    """The rule hooks per node type for a walk of traced (``plain``: not under ``@int8ify``) or
    untraced code."""
    key = (traced, plain)
    table = _DISPATCH_CACHE.get(key)
    if table is not None:
        return table
    table = {}
    for rule in _RULE_INSTANCES:
        if rule.scope != ANYWHERE and (not traced or (rule.scope == PLAIN and not plain)):
            continue
        for attr in dir(rule):
            if attr.startswith("visit_"):
                node_type = getattr(cst, attr[len("visit_"):])
                table.setdefault(node_type, []).append(getattr(rule, attr))
    _DISPATCH_CACHE[key] = table
    return table


def _parse_error(exc: Exception) -> Violation:
    line = getattr(exc, "raw_line", 1) or 1
    col = getattr(exc, "raw_column", 0) or 0
    reason = getattr(exc, "message", None) or (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return Violation(int(line), int(col), PARSE_ERROR_CODE,
                     f"{PARSE_ERROR_CODE} could not parse this file with libcst, int8 rules skipped: {reason}")


def _internal_error(what: str) -> Violation:
    return Violation(1, 0, PARSE_ERROR_CODE,
                     f"{PARSE_ERROR_CODE} int8ify lint failed on this file, int8 rules skipped ({what}); "
                     "please report it")


_MAX_DETAIL = 200


def _describe(exc: BaseException) -> str:
    """``Type: detail`` for an internal error, without calling ``str()`` on what it carries: libcst puts
    nodes in its ``KeyError``s, and a deep node's ``repr`` recurses past the stack again."""
    plain = all(isinstance(a, (str, int, float)) for a in exc.args)
    detail = " ".join(str(a) for a in exc.args) if plain else ""
    detail = detail.splitlines()[0][:_MAX_DETAIL] if detail else ""
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _from_recursion(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised while handling, a ``RecursionError``: libcst's position
    provider turns one into a ``KeyError`` as its context managers unwind."""
    seen = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, RecursionError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def lint_source(source: str, extra_decorators: Iterable[str] = (), *, raise_errors: bool = False,
                honour_noqa: bool = True, tree: Optional[ast.AST] = None) -> List[Violation]:
    """All violations in ``source``, sorted by position.

    ``extra_decorators``: the ``--jx-traced-decorators`` names; ``tree``: the file's ``ast`` if
    already parsed (flake8's), for the prefilter; ``honour_noqa=False`` mirrors
    ``flake8 --disable-noqa`` for the multi-line ``# noqa`` handling of :mod:`lint_plugin.noqa`.
    """
    extra = TracedDecorators(extra_decorators)

    def run() -> List[Violation]:
        return _lint(source, extra, honour_noqa, tree, raise_errors)

    try:
        return run()
    except Exception as exc:
        if not _from_recursion(exc):
            if raise_errors:
                raise
            return [_internal_error(f"internal error {_describe(exc)}")]
    # deeply nested but valid code: analyse it again with room to recurse
    try:
        return call_with_deep_stack(run)
    except DeepStackUnavailable as exc:
        why = f"{exc}: {_describe(exc.__cause__ or exc)}"
    except Exception as exc:
        if not _from_recursion(exc):
            if raise_errors:
                raise
            return [_internal_error(f"internal error: {_describe(exc)}")]
        why = "too deep even for a larger stack"
    # the deepest code skipped, the rest of the file checked
    try:
        return _lint(source, extra, honour_noqa, tree, raise_errors, skip_deep=why)
    except Exception as exc:
        if raise_errors:
            raise
        what = "nesting too deep even with a larger stack" if _from_recursion(exc) else "internal error"
        return [_internal_error(f"{what}: {_describe(exc)}")]


def _lint(source: str, extra: TracedDecorators, honour_noqa: bool, tree: Optional[ast.AST],
          raise_errors: bool, skip_deep: Optional[str] = None) -> List[Violation]:
    """The pipeline; ``skip_deep`` (why the stack cannot hold the whole file): analyse ``source`` with the code
    nested too deep for the current stack masked (:mod:`lint_plugin.masking`), and say so in one ``JX000``."""
    need = applicable_rules(source, tree, extra)
    if not need.traced and not need.anywhere:
        return []
    parsed, skipped = source, []
    if skip_deep is not None and isinstance(need.tree, ast.Module):
        masked = mask_deep_code(source, need.tree, nesting_budget())
        if masked.first is not None:
            parsed = masked.source
            skipped = [_skipped_note(masked.first, skip_deep)]
    try:
        module = cst.parse_module(parsed)
    except Exception as exc:  # libcst raises ParserSyntaxError, occasionally others
        if _from_recursion(exc) or (raise_errors and not isinstance(exc, cst.ParserSyntaxError)):
            raise
        return [_parse_error(exc)]
    info = discover(module, extra)
    if not need.anywhere and not any(fi.traced for fi in info.functions):
        return skipped
    reports = analyze(info, module, _dispatch_for, need.anywhere)
    if not reports:
        return skipped
    return sorted(_violations(reports, module, need.tree, source, honour_noqa) + skipped)


def _skipped_note(first: Tuple[int, int], why: str) -> Violation:
    """The ``JX000`` result of a file linted with its deepest code skipped, at the first part skipped."""
    line, col = first
    return Violation(line, col, PARSE_ERROR_CODE,
                     f"{PARSE_ERROR_CODE} code nested too deep to analyse here ({why}): the parts nested deepest, "
                     "from here on, were skipped and the rest of this file was checked")


def _violations(reports: List[Report], module: cst.Module, tree: Optional[ast.AST], source: str,
                honour_noqa: bool) -> List[Violation]:
    """Positions for the reports (one per position and code), less those a multi-line ``# noqa`` silences."""
    positions = Positions(module, tree, (node for node, _, _ in reports))
    seen = set()
    out: List[Violation] = []
    lines: Optional[List[str]] = None
    for node, code, message in reports:
        pos = positions[node].start
        key = (pos.line, pos.column, code)
        if key in seen:
            continue
        seen.add(key)
        if honour_noqa:
            first, last = noqa_span(node, positions)
            if last > first:
                if lines is None:
                    lines = source.splitlines()
                if silenced(lines, first, last, code):
                    continue
        out.append(Violation(pos.line, pos.column, code, message))
    out.sort()
    return out
