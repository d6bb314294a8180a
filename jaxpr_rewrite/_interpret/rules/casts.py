"""Casts and transposes: a pre-quantized weight keeps its codes through a float cast (``Dense(dtype=bfloat16)``)
and a transpose (``x @ w.T``), and ``quantize_params`` follows a weight through both."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .registry import RuleContext, register

__all__ = []


def _casts_to_float(eqn) -> bool:
    return jnp.issubdtype(eqn.params["new_dtype"], jnp.floating)


def _convert_quantized(context: RuleContext, eqn, invals):
    """A float-to-float cast keeps the codes."""
    (value,) = invals
    if not _casts_to_float(eqn):
        return None
    return [value.astype(eqn.params["new_dtype"])]


def _follow_convert(trail, eqn, positions, where):
    """A float cast is followed, remembered in the chain of casts (each one rounds)."""
    if not _casts_to_float(eqn):
        return None
    return trail.follow(trail.jaxpr, eqn.outvars[0], casts=trail.casts + (np.dtype(eqn.params["new_dtype"]),))


def _transpose_quantized(context: RuleContext, eqn, invals):
    """A transposed weight keeps its codes, transposed."""
    (value,) = invals
    if value.smooth is not None:
        return None  # smoothing factors follow the contracting axis of the untransposed layout
    transposed = value.transpose(eqn.params["permutation"])
    return None if transposed is None else [transposed]  # (None: blocks that cannot follow the new axis order)


def _follow_transpose(trail, eqn, positions, where):
    """A transpose is followed, its permutation applied to the leaf axes the value's axes are."""
    permuted = tuple(trail.axes[p] for p in eqn.params["permutation"])
    return trail.follow(trail.jaxpr, eqn.outvars[0], axes=permuted)


def _label_convert(params) -> list[str]:
    return [f"new_dtype={np.dtype(params['new_dtype']).name}"]


register("convert_element_type", quantized=_convert_quantized, follow=_follow_convert, label=_label_convert)
register("transpose", quantized=_transpose_quantized, follow=_follow_transpose)
