"""The rule base class: a JX code of the table in :mod:`jx_codes`, a message, VALID/INVALID examples, and node
hooks."""

from __future__ import annotations

import textwrap
from typing import ClassVar, NamedTuple, Sequence

import libcst as cst

from jx_codes import Code

from ..walk import FunctionWalk

__all__ = ["ANYWHERE", "Invalid", "PLAIN", "Rule", "TRACED", "example_source"]

TRACED = "traced"      # any traced code
PLAIN = "plain"        # traced code not under @int8ify
ANYWHERE = "anywhere"  # every function and the module body


class Invalid(NamedTuple):
    """An example the rule flags exactly once: at ``line`` (1-based) and ``col`` (0-based, as flake8
    plugins report it; flake8 prints ``col + 1``) of :func:`example_source` of ``code``."""

    code: str
    line: int
    col: int


def example_source(code: str) -> str:
    """An example snippet as a file: dedented, without the blank first line of a triple-quoted string."""
    return textwrap.dedent(code).lstrip("\n")


class Rule:
    """One rule = one code.

    The class docstring is the rule's documentation (``docs/lint.md`` is generated from it, see
    :mod:`lint_plugin.reference`); it starts with the code's title. Subclasses set ``entry`` (the
    code's row of :data:`jx_codes.CODES`, which gives ``code``, ``name`` and ``instead``, what to do
    instead, shared with ``verify`` and the errors raised while tracing), ``message`` (a
    ``str.format`` template that says what to do instead, often as ``{instead}``; the reported text
    is ``"{code} {message}"``), ``scope`` (where the rule runs), ``VALID`` snippets (no report of this
    code) and ``INVALID`` examples (exactly one report of this code, at the given line and column).
    They implement
    ``visit_<NodeType>(node, walk)`` hooks, called once per node after the node's kind is known;
    ``walk`` is the :class:`~lint_plugin.walk.FunctionWalk` (``walk.kind(expr)``, ``walk.qualname(expr)``).
    """

    entry: ClassVar[Code]
    code: ClassVar[str] = ""
    name: ClassVar[str] = ""
    instead: ClassVar[str] = ""
    message: ClassVar[str] = ""
    scope: ClassVar[str] = TRACED
    VALID: ClassVar[Sequence[str]] = ()
    INVALID: ClassVar[Sequence[Invalid]] = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "entry" in cls.__dict__:
            cls.code, cls.name, cls.instead = cls.entry.code, cls.entry.name, cls.entry.instead

    def report(self, walk: FunctionWalk, node: cst.CSTNode, **fmt: str) -> None:
        walk.report(node, self.code, f"{self.code} {self.message.format(instead=self.instead, **fmt)}")
