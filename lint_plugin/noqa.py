"""``# noqa`` on any line of a multi-line statement or expression.

flake8 applies ``# noqa`` only to the physical line it reports. For a report on a statement or an
expression spanning several lines, the plugin also honours a ``# noqa`` on any of its lines,
read with flake8's own syntax and matching: ``# noqa`` alone silences every code, ``# noqa: JX201``
only codes starting with ``JX201``.
"""

from __future__ import annotations

import re
from typing import Sequence, Tuple

import libcst as cst
from flake8.defaults import NOQA_INLINE_REGEXP

__all__ = ["noqa_span", "silenced"]

_CODE_SEPARATOR = re.compile(r"[,\s]")  # flake8.utils.COMMA_SEPARATED_LIST_RE


def silenced(lines: Sequence[str], first: int, last: int, code: str) -> bool:
    """Whether a ``# noqa`` on lines ``first``..``last`` (1-based, inclusive) silences ``code``."""
    for line in lines[first - 1:last]:
        if "noqa" not in line.lower():
            continue
        match = NOQA_INLINE_REGEXP.search(line)
        if match is None:
            continue
        codes_str = match.group("codes")
        if codes_str is None:
            return True  # a blanket ``# noqa``
        codes = tuple(c for c in _CODE_SEPARATOR.split(codes_str) if c)
        if code in codes or code.startswith(codes):
            return True
    return False


def noqa_span(node: cst.CSTNode, positions) -> Tuple[int, int]:  # type: ignore[no-untyped-def]
    """Lines a ``# noqa`` may sit on for a report on ``node``: the whole expression, or for a
    compound statement its header (``if (\\n cond\\n):`` spans three lines)."""
    rng = positions[node]
    start, end = rng.start.line, rng.end.line
    if isinstance(node, (cst.If, cst.While)):
        body = node.body
        if isinstance(body, cst.IndentedBlock) and body.body:
            end = positions[body.body[0]].start.line - 1
        else:
            end = start
    return start, max(start, end)
