"""Reading dtypes written in the source: ``jnp.int8``, ``np.int32``, ``"int8"``, ``jnp.dtype("int8")``."""

from __future__ import annotations

from typing import Optional

import libcst as cst

from .aliases import ImportTable, dotted_name

__all__ = ["dtype_name", "is_int8_dtype", "is_int32_dtype", "is_integer_or_bool"]

_DTYPE_MODULES = ("jax.numpy", "numpy", "jax.dtypes", "ml_dtypes")
# Python types accepted as dtypes: ``x.astype(bool)``
_BUILTIN_DTYPES = {"bool": "bool", "int": "int", "float": "float", "complex": "complex"}


def dtype_name(node: cst.BaseExpression, imports: ImportTable) -> Optional[str]:
    """``"int8"`` for ``jnp.int8``, ``np.int8``, ``"int8"``, ``jnp.dtype("int8")``; ``None`` if unknown."""
    if isinstance(node, cst.SimpleString):
        v = node.evaluated_value
        return v if isinstance(v, str) else None
    if isinstance(node, cst.Call) and node.args:
        if imports.resolve(node.func) in ("jax.numpy.dtype", "numpy.dtype"):
            return dtype_name(node.args[0].value, imports)
        return None
    raw = dotted_name(node)
    if raw is None:
        return None
    q = imports.resolve_dotted(raw)
    if q is None:
        return _BUILTIN_DTYPES.get(raw)
    head, _, last = q.rpartition(".")
    return last if head in _DTYPE_MODULES else None


def is_int8_dtype(node: cst.BaseExpression, imports: ImportTable) -> bool:
    return dtype_name(node, imports) == "int8"


def is_int32_dtype(node: cst.BaseExpression, imports: ImportTable) -> bool:
    return dtype_name(node, imports) == "int32"


def is_integer_or_bool(name: str) -> bool:
    """An integer or boolean dtype name (``int32``, ``uint8``, ``bool_``, ``int``)."""
    return name.startswith(("int", "uint", "bool"))
