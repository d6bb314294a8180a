"""The dtype of a matmul operand, when the source says it: so that JX101 names an int32 or a
boolean matmul as such instead of calling it a float matmul."""

from __future__ import annotations

from typing import Optional

import libcst as cst

from ..array_api import ARRAY_ATTRS_SAME, DTYPE_PRESERVING_FUNCS, DTYPE_PRESERVING_METHODS
from ..call_args import kwarg
from ..dtypes import dtype_name
from ..kinds import INT8
from ..walk import FunctionWalk

__all__ = ["operand_dtype"]

_MAX_DEPTH = 6  # names followed to their assigned value, casts and reshapes looked through
_BOOL_FUNCS = frozenset("jax.numpy." + n for n in (
    "logical_and", "logical_or", "logical_not", "logical_xor", "isnan", "isinf", "isfinite", "equal",
    "not_equal", "greater", "greater_equal", "less", "less_equal", "isclose", "signbit",
))
_INDEX_FUNCS = frozenset("jax.numpy." + n for n in ("argmax", "argmin", "argsort", "searchsorted", "bincount"))
_ORDERING = (cst.LessThan, cst.LessThanEqual, cst.GreaterThan, cst.GreaterThanEqual, cst.Equal, cst.NotEqual)


def operand_dtype(node: cst.BaseExpression, walk: FunctionWalk, depth: int = 0) -> Optional[str]:
    """``"int32"``, ``"bool"``, ``"float32"``, ... as the source spells the operand's dtype, else None."""
    if depth > _MAX_DEPTH:
        return None
    if walk.kind(node) == INT8:
        return "int8"
    deeper = depth + 1
    if isinstance(node, cst.Name):
        value = walk.bound_value(node.value)
        return operand_dtype(value, walk, deeper) if value is not None else None
    if isinstance(node, cst.Comparison):
        return "bool" if all(isinstance(c.operator, _ORDERING) for c in node.comparisons) else None
    if isinstance(node, cst.UnaryOperation):
        return "bool" if isinstance(node.operator, cst.Not) else operand_dtype(node.expression, walk, deeper)
    if isinstance(node, cst.Subscript):
        return operand_dtype(node.value, walk, deeper)
    if isinstance(node, cst.Attribute):
        return operand_dtype(node.value, walk, deeper) if node.attr.value in ARRAY_ATTRS_SAME else None
    if isinstance(node, cst.BinaryOperation):
        left, right = operand_dtype(node.left, walk, deeper), operand_dtype(node.right, walk, deeper)
        return left if left == right else None
    if isinstance(node, cst.Call):
        return _call_dtype(node, walk, deeper)
    return None


def _call_dtype(call: cst.Call, walk: FunctionWalk, depth: int) -> Optional[str]:
    imports = walk.info.imports
    func = call.func
    q = walk.qualname(func)
    if q is None:
        if isinstance(func, cst.Attribute):
            if func.attr.value == "astype" and call.args:
                return dtype_name(call.args[0].value, imports)
            if func.attr.value in DTYPE_PRESERVING_METHODS:
                return operand_dtype(func.value, walk, depth)
        return None
    dtype = kwarg(call, "dtype")
    if dtype is not None:
        return dtype_name(dtype, imports)
    if q == "jax.lax.convert_element_type" and len(call.args) > 1:
        return dtype_name(call.args[1].value, imports)
    if q in _BOOL_FUNCS:
        return "bool"
    if q in _INDEX_FUNCS:
        return "int32"
    if q in DTYPE_PRESERVING_FUNCS and call.args:
        return operand_dtype(call.args[0].value, walk, depth)
    # a dtype used as a function: ``jnp.int32(x)``
    return dtype_name(func, imports) if q.startswith(("jax.numpy.", "numpy.")) and _is_dtype_word(q) else None


def _is_dtype_word(q: str) -> bool:
    last = q.rpartition(".")[2]
    return last.rstrip("_").rstrip("0123456789") in ("int", "uint", "float", "bfloat", "complex", "bool")
