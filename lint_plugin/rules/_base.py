"""The rule base class: a code, a message, VALID/INVALID examples, and node hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Sequence

import libcst as cst

if TYPE_CHECKING:  # pragma: no cover
    from ..dataflow import FunctionWalk

__all__ = ["Rule", "TRACED", "PLAIN", "ANYWHERE"]

TRACED = "traced"      # any traced code
PLAIN = "plain"        # traced code not under @int8ify
ANYWHERE = "anywhere"  # every function and the module body


class Rule:
    """One rule = one code.

    Subclasses set ``code`` (``JXnnn``), ``name``, ``message`` (a ``str.format`` template; the
    reported text is ``"{code} {message}"``), ``scope`` (where the rule runs) and ``VALID`` /
    ``INVALID`` example snippets (the test suite checks that every VALID snippet yields no report
    of this code and every INVALID one at least one). They implement ``visit_<NodeType>(node, walk)``
    hooks, called once per node, after the node's kind is known; ``walk`` is the
    :class:`~lint_plugin.dataflow.FunctionWalk` (``walk.kind(expr)``, ``walk.qualname(expr)``).
    """

    code: ClassVar[str] = ""
    name: ClassVar[str] = ""
    message: ClassVar[str] = ""
    scope: ClassVar[str] = TRACED
    VALID: ClassVar[Sequence[str]] = ()
    INVALID: ClassVar[Sequence[str]] = ()

    def report(self, walk: "FunctionWalk", node: cst.CSTNode, **fmt: str) -> None:
        walk.report(node, self.code, f"{self.code} {self.message.format(**fmt)}")
