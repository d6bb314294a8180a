"""Per-primitive rules, one module per primitive family, each registering one
:class:`~jaxpr_rewrite._interpret.rules.registry.PrimitiveRule` (rewrite, pre-quantized weights, ``quantize_params``'s
weight following, the report's measuring) in :data:`~jaxpr_rewrite._interpret.rules.registry.RULES`.

Adding a higher-order primitive is one new module here, imported below (see docs/rules.md).
"""

from . import (calls, casts, cond, custom_derivatives, dots, library_matmuls, linear_solve, remat,  # noqa: F401
               scan, shard_map, shapes, updates, while_loop)
from .registry import RULES, PrimitiveRule, RuleContext, register, rule_for

__all__ = ["RULES", "PrimitiveRule", "RuleContext", "register", "rule_for"]
