"""int8ify's flake8 plugin: flags JAX code that would break the int8 matmul contract.

``flake8 --select=JX`` runs it; :func:`lint_source` is the same check as a library call.
"""

from .engine import PARSE_ERROR_CODE, Violation, lint_source
from .plugin import Int8Checker, __version__
from .rules import RULES, Rule, all_rules, get_rule

__all__ = [
    "PARSE_ERROR_CODE",
    "RULES",
    "Int8Checker",
    "Rule",
    "Violation",
    "__version__",
    "all_rules",
    "get_rule",
    "lint_source",
]
