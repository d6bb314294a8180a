"""Lint one file: cheap pre-checks, one libcst parse, discovery, one walk, positions.

:func:`lint_source` is the whole pipeline and what the flake8 plugin calls; it never raises
(unless asked to, for tests): a file libcst cannot parse yields a single ``JX000`` result.
"""

from __future__ import annotations

import ast
import re
from typing import Dict, FrozenSet, Iterable, List, NamedTuple, Optional, Tuple

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from .dataflow import Hook, analyze
from .discovery import discover
from .prefilter import may_have_traced_code
from .rules import ANYWHERE, PLAIN, RULES, Rule

__all__ = ["PARSE_ERROR_CODE", "Violation", "lint_source", "might_contain_traced_code"]

PARSE_ERROR_CODE = "JX000"


class Violation(NamedTuple):
    line: int  # 1-based
    col: int   # 0-based, as flake8 plugins report it (flake8 prints col + 1)
    code: str
    message: str  # starts with the code


_JAX_WORDS = ("jax", "flax", "equinox", "int8ify")
_TRACED_MARKERS = re.compile(
    r"\b(?:jit|pjit|pmap|vmap|grad|value_and_grad|jacfwd|jacrev|hessian|checkpoint|remat|named_call"
    r"|shard_map|scan|map|associative_scan|cond|while_loop|fori_loop|switch|int8ify|filter_\w+"
    r"|compact|__call__)\b"
)


def might_contain_traced_code(source: str, extra_decorators: Iterable[str] = ()) -> bool:
    """A cheap text test: ``False`` means the file certainly has nothing for the rules to flag.

    Any alias (``from jax import jit as J``) still spells the original name in the import, so
    looking for the words is a safe over-approximation.
    """
    extra = [d.rsplit(".", 1)[-1] for d in extra_decorators if d]
    if not any(w in source for w in _JAX_WORDS) and not any(e in source for e in extra):
        return False
    if "int8" in source:
        return True
    if _TRACED_MARKERS.search(source):
        return True
    return any(e in source for e in extra)


_RULE_INSTANCES: List[Rule] = [cls() for cls in RULES.values()]
_DISPATCH_CACHE: Dict[Tuple[bool, bool], Dict[type, List[Hook]]] = {}


def _dispatch_for(traced: bool, plain: bool) -> Dict[type, List[Hook]]:
    key = (traced, plain)
    table = _DISPATCH_CACHE.get(key)
    if table is not None:
        return table
    table = {}
    for rule in _RULE_INSTANCES:
        if rule.scope == ANYWHERE:
            pass
        elif not traced:
            continue
        elif rule.scope == PLAIN and not plain:
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
    reason = getattr(exc, "message", None) or str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return Violation(int(line), int(col), PARSE_ERROR_CODE,
                     f"{PARSE_ERROR_CODE} could not parse this file with libcst, int8 rules skipped: {reason}")


# flake8's own inline-noqa syntax (flake8.defaults.NOQA_INLINE_REGEX)
_NOQA = re.compile(r"#\s*noqa(?::[\s]?(?P<codes>[A-Z][0-9]+(?:[,\s]+[A-Z][0-9]+)*))?", re.IGNORECASE)


def _noqa_in(lines: List[str], first: int, last: int, code: str) -> bool:
    for line in lines[first - 1:last]:
        if "noqa" not in line.lower():
            continue
        m = _NOQA.search(line)
        if m is None:
            continue
        codes = m.group("codes")
        if codes is None:
            return True
        if any(code.startswith(c.upper()) for c in re.split(r"[,\s]+", codes) if c):
            return True
    return False


def _span(node: cst.CSTNode, positions) -> Tuple[int, int]:  # type: ignore[no-untyped-def]
    """Lines a ``# noqa`` may sit on for a report on ``node``: the whole expression, or for a
    compound statement its header (``if (\n cond\n):`` spans three lines)."""
    rng = positions[node]
    start, end = rng.start.line, rng.end.line
    body = getattr(node, "body", None)
    if isinstance(node, (cst.If, cst.While)):
        if isinstance(body, cst.IndentedBlock) and body.body:
            end = positions[body.body[0]].start.line - 1
        else:
            end = start
    return start, max(start, end)


def lint_source(source: str, extra_decorators: Iterable[str] = (), *, raise_errors: bool = False,
                filename: Optional[str] = None, honour_noqa: bool = True,
                tree: Optional[ast.AST] = None) -> List[Violation]:
    """All violations in ``source``, sorted by position.

    flake8 applies ``# noqa`` only to the physical line it reports (and to multi-line strings);
    for a report on a statement or expression spanning several lines, a ``# noqa`` on any of its
    lines also suppresses it here (``honour_noqa=False`` mirrors ``flake8 --disable-noqa``).
    """
    extra: FrozenSet[str] = frozenset(d.strip() for d in extra_decorators if d and d.strip())
    if not might_contain_traced_code(source, extra):
        return []
    if "int8" not in source:  # JX102 applies anywhere; the other rules need traced code
        if tree is None:
            try:
                tree = ast.parse(source)
            except (SyntaxError, ValueError):
                tree = None  # let libcst report it
        if tree is not None and not may_have_traced_code(tree, extra):
            return []
    try:
        module = cst.parse_module(source)
    except Exception as exc:  # libcst raises ParserSyntaxError, occasionally others
        if raise_errors and not isinstance(exc, cst.ParserSyntaxError):
            raise
        return [_parse_error(exc)]
    try:
        info = discover(module, extra)
        has_traced = any(fi.traced for fi in info.functions)
        analyze_untraced = "int8" in source
        if not has_traced and not analyze_untraced:
            return []
        reports = analyze(info, _dispatch_for, analyze_untraced, module)
        if not reports:
            return []
        positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
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
                first, last = _span(node, positions)
                if last > first:
                    if lines is None:
                        lines = source.splitlines()
                    if _noqa_in(lines, first, last, code):
                        continue
            out.append(Violation(pos.line, pos.column, code, message))
        out.sort()
        return out
    except Exception as exc:
        if raise_errors:
            raise
        return [Violation(1, 0, PARSE_ERROR_CODE,
                          f"{PARSE_ERROR_CODE} int8ify lint failed on this file, int8 rules skipped "
                          f"(internal error {type(exc).__name__}: {exc}); please report it")]
