"""int8ify's flake8 plugin: flags JAX code that would break the int8 matmul contract.

``flake8 --select=JX,E9`` runs it; :func:`lint_source` is the same check as a library call. The
rules and their documentation are in :mod:`lint_plugin.rules`; ``docs/lint.md`` is the reference.
"""

from .engine import PARSE_ERROR_CODE, Violation, lint_source
from .plugin import Int8Checker, __version__
from .rules import RULES, Invalid, Rule, get_rule

__all__ = [
    "PARSE_ERROR_CODE",
    "RULES",
    "Int8Checker",
    "Invalid",
    "Rule",
    "Violation",
    "__version__",
    "get_rule",
    "lint_source",
]
