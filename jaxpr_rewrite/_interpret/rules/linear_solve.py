"""``lax.custom_linear_solve`` (behind ``jnp.linalg.solve`` and ``jax.scipy.sparse.linalg.cg``): its ``jaxprs``
param holds four sub-jaxprs; the forward pass is ``solve``, rewritten in place, while ``matvec``, ``vecmat`` and
``transpose_solve`` only define derivatives and stay float."""

from __future__ import annotations

from .common import swap_forward_params
from .registry import register

__all__ = []

register("custom_linear_solve", subjaxprs=("jaxprs",), derivative_only=("matvec", "vecmat", "transpose_solve"),
         rewrite=swap_forward_params("custom_linear_solve"))
