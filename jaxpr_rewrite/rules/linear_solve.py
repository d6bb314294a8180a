"""``lax.custom_linear_solve``: its forward pass is the ``solve`` jaxpr, rewritten in place; ``matvec``,
``vecmat`` and ``transpose_solve`` only define derivatives and stay float
(:data:`~jaxpr_rewrite.jaxprs.DERIVATIVE_ONLY_PARAMS`)."""

from __future__ import annotations

from .common import swap_forward_params
from .registry import register

__all__ = []

register("custom_linear_solve", rewrite=swap_forward_params("custom_linear_solve"))
