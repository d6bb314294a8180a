"""Recognising a broadcast product ``a[:, :, None] * b[None]``: the matmul JX103 looks for."""

from __future__ import annotations

from typing import FrozenSet, List, Optional

import libcst as cst

from ..aliases import dotted_name
from ..call_args import kwarg
from ..kinds import STATIC
from ..walk import FunctionWalk

__all__ = ["is_emulated_matmul"]

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


def _is_new_axis(index: cst.BaseExpression) -> bool:
    if isinstance(index, cst.Name) and index.value == "None":
        return True
    raw = dotted_name(index)
    return raw is not None and raw.endswith("newaxis")


def _subscript_new_axes(node: cst.Subscript) -> FrozenSet[int]:
    """Where ``x[...]`` inserts axes in its result: counted from the start, or from the end (negative)
    after an ``...``; a literal integer index removes its axis."""
    elements = [el.slice.value if isinstance(el.slice, cst.Index) else el.slice for el in node.slice]
    axes: List[int] = []
    position = 0
    seen_ellipsis = False
    after_ellipsis: List[bool] = []  # per result axis after the ``...``: inserted or not
    for index in elements:
        if isinstance(index, cst.Ellipsis):
            seen_ellipsis = True
        elif isinstance(index, cst.Integer):
            continue
        elif seen_ellipsis:
            after_ellipsis.append(_is_new_axis(index))
        else:
            if _is_new_axis(index):
                axes.append(position)
            position += 1
    axes += [i - len(after_ellipsis) for i, inserted in enumerate(after_ellipsis) if inserted]
    return frozenset(axes)


def new_axes(node: cst.BaseExpression, walk: FunctionWalk) -> Optional[FrozenSet[int]]:
    """Where ``node`` inserts axes (``x[:, None]``, ``x[..., jnp.newaxis]``, ``jnp.expand_dims(x, 1)``,
    through casts): their positions, an empty set when they cannot be read (``lax.broadcast_in_dim``),
    ``None`` when it inserts none."""
    node = _strip_casts(node, walk)
    if isinstance(node, cst.Subscript):
        return _subscript_new_axes(node) or None
    if isinstance(node, cst.Call) and walk.qualname(node.func) in _EXPAND:
        axis = kwarg(node, "axis") or kwarg(node, "dimensions")
        if axis is None and len(node.args) > 1 and node.args[1].keyword is None:
            axis = node.args[1].value
        return frozenset(_literal_ints(axis)) if axis is not None else frozenset()
    return None


def _literal_ints(node: cst.BaseExpression) -> List[int]:
    """The integers of ``1``, ``-1`` or ``(0, 2)``; none when any part is not a literal."""
    parts = [el.value for el in node.elements] if isinstance(node, (cst.Tuple, cst.List)) else [node]
    out = []
    for part in parts:
        sign = 1
        if isinstance(part, cst.UnaryOperation) and isinstance(part.operator, cst.Minus):
            sign, part = -1, part.expression
        if not isinstance(part, cst.Integer):
            return []
        out.append(sign * int(part.evaluated_value))
    return out


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


def is_emulated_matmul(node: cst.BaseExpression, walk: FunctionWalk, sum_axis: cst.BaseExpression) -> bool:
    """Whether summing the product ``node`` over ``sum_axis`` computes a matmul: a product of non-static arrays
    of which

    * two are expanded along different axes (``x[:, :, None] * w[None]``): each spans an axis the other is
      broadcast along, the B x D_in x D_out product of an emulated matmul (axes that cannot be read count as
      different); or
    * one is expanded (``pre[:, :, :, None] * x``, ``alpha[:, None] * probs``, ``softmax * pos[..., None]``)
      and another is not, and the sum runs over axes the expanded one spans: its items times the other's,
      summed over the axis they share, each broadcast along the other's free axis (a matrix-vector product,
      batched or not). The axes are compared where the source fixes them: both counted from the start
      (assuming the expanded factor is not broadcast to a higher rank) or both from the end.

    A name is followed to the expression it was assigned."""
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
    axes = [new_axes(f, walk) for f in factors if walk.kind(f) != STATIC]
    expanded = [a for a in axes if a is not None]
    if any(not a or not b or a != b for i, a in enumerate(expanded) for b in expanded[i + 1:]):
        return True
    summed = frozenset(_literal_ints(sum_axis))
    return None in axes and bool(summed) and any(_spans(a, summed) for a in expanded)


def _spans(inserted: FrozenSet[int], summed: FrozenSet[int]) -> bool:
    """Whether a factor with axes ``inserted`` spans every axis of ``summed``: none of them is inserted, all
    counted from the same end (a negative and a non-negative position may be one axis)."""
    positions = inserted | summed
    same_end = all(a >= 0 for a in positions) or all(a < 0 for a in positions)
    return bool(inserted) and same_end and not inserted & summed
