"""The abstract values of the intra-function data flow.

``STATIC``: a Python value known at trace time (shapes, dtypes, config, literals, loop counters).
``UNKNOWN``: could be either; rules never flag on it ("when unsure, do not flag").
``TRACED``: an array (or pytree of arrays) that is a tracer under ``jit``.
``INT8``: a traced array known to have dtype int8.
``MODULE_SELF``: ``self`` inside a flax linen, flax nnx or equinox module: each attribute has the
kind the class gives it (see :mod:`lint_plugin.module_classes`), submodule calls are traced.
``VARIABLE``: an nnx Variable (``nnx.Param(...)``): a box around a traced array. Reading it
(``.value``, ``[...]``) or computing with it gives a traced array; its truthiness is ``len()`` of
the array, static.
"""

STATIC = 0
UNKNOWN = 1
TRACED = 2
INT8 = 3
MODULE_SELF = 4
VARIABLE = 5


def is_traced(kind: int) -> bool:
    return kind == TRACED or kind == INT8


def truth(kind: int) -> int:
    """The kind of ``bool(value)`` for a value of this kind."""
    return STATIC if kind == VARIABLE else kind


def combine(*kinds: int) -> int:
    """The kind of a value computed from values of these kinds."""
    result = STATIC
    for k in kinds:
        if k == TRACED or k == INT8 or k == VARIABLE:
            return TRACED
        if k == UNKNOWN:
            result = UNKNOWN
    return result


def join(a: int, b: int) -> int:
    """The kind of a name bound to ``a`` on one path and ``b`` on another."""
    if a == b:
        return a
    if is_traced(a) and is_traced(b):
        return TRACED
    return UNKNOWN


def merge_seed(a: "int | None", b: int) -> int:
    """Parameter kind seen from two call sites: traced if any caller passes a traced value."""
    if a is None or a == b:
        return b
    if is_traced(a) or is_traced(b):
        return TRACED
    return UNKNOWN
