"""Recognising a broadcast product ``a[:, :, None] * b[None]``: the matmul JX103 looks for."""

from __future__ import annotations

from typing import List, Optional

import libcst as cst

from ..aliases import dotted_name
from ..kinds import STATIC
from ..walk import FunctionWalk

__all__ = ["is_broadcast_product"]

_EXPAND = frozenset({"jax.numpy.expand_dims", "jax.lax.expand_dims", "jax.lax.broadcast_in_dim"})
_CASTS = frozenset({"jax.lax.convert_element_type", "jax.numpy.asarray"})
# ``b = a; c = b``: how many plain renamings a product is followed through
_MAX_RENAMES = 4


def _strip_casts(node: cst.BaseExpression, walk: FunctionWalk) -> cst.BaseExpression:
    while isinstance(node, cst.Call):
        f = node.func
        if isinstance(f, cst.Attribute) and f.attr.value == "astype":
            node = f.value
            continue
        if walk.qualname(f) in _CASTS and node.args:
            node = node.args[0].value
            continue
        break
    return node


def has_new_axis(node: cst.BaseExpression, walk: FunctionWalk) -> bool:
    """``x[:, None]``, ``x[..., jnp.newaxis]``, ``jnp.expand_dims(x, 1)`` (through casts)."""
    node = _strip_casts(node, walk)
    if isinstance(node, cst.Subscript):
        for el in node.slice:
            s = el.slice
            if isinstance(s, cst.Index):
                v = s.value
                if isinstance(v, cst.Name) and v.value == "None":
                    return True
                raw = dotted_name(v)
                if raw is not None and raw.endswith("newaxis"):
                    return True
        return False
    if isinstance(node, cst.Call):
        return walk.qualname(node.func) in _EXPAND
    return False


def _direct_factors(node: cst.BaseExpression, walk: FunctionWalk) -> Optional[List[cst.BaseExpression]]:
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Multiply):
        return [node.left, node.right]
    if isinstance(node, cst.Call) and len(node.args) == 2 and walk.qualname(node.func) == "jax.numpy.multiply":
        return [node.args[0].value, node.args[1].value]
    return None


def product_factors(node: cst.BaseExpression, walk: FunctionWalk) -> Optional[List[cst.BaseExpression]]:
    """The factors of ``a * b * c`` or ``jnp.multiply(a, b)`` (a parenthesised sub-product is one
    factor); ``None`` if not a product."""
    top = _direct_factors(node, walk)
    if top is None:
        return None
    out: List[cst.BaseExpression] = []
    pending = top[::-1]  # a stack, popped left to right; long chains need no recursion
    while pending:
        factor = pending.pop()
        sub = None if factor.lpar else _direct_factors(factor, walk)
        if sub is None:
            out.append(factor)
        else:
            pending.extend(sub[::-1])
    return out


def is_broadcast_product(node: cst.BaseExpression, walk: FunctionWalk) -> bool:
    """A product of at least two non-static arrays, at least one with an inserted axis; a name is
    followed to the expression it was assigned."""
    for _ in range(_MAX_RENAMES):
        if not isinstance(node, cst.Name):
            break
        value = walk.bound_value(node.value)
        if value is None:
            return False
        node = value
    factors = product_factors(node, walk)
    if factors is None:
        return False
    arrays = [f for f in factors if walk.kind(f) != STATIC]
    return len(arrays) >= 2 and any(has_new_axis(f, walk) for f in arrays)
