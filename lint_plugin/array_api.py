"""How values flow through array operations: which attributes, methods and functions return arrays
(tracers under ``jit``), Python values known at trace time, or keep the int8 dtype.

The tables are read by :class:`lint_plugin.walk.FunctionWalk`; :func:`api_call_kind` and
:func:`method_call_kind` turn a call into the kind of its result.
"""

from __future__ import annotations

from typing import FrozenSet, List, Tuple

import libcst as cst

from .aliases import ImportTable
from .call_args import kwarg
from .dtypes import is_int8_dtype
from .kinds import INT8, MODULE_SELF, STATIC, TRACED, UNKNOWN, VARIABLE, is_traced
from .names import NNX_VARIABLES

__all__ = [
    "ARRAY_ATTRS_SAME",
    "ARRAY_ATTRS_TRACED",
    "COMBINE_BUILTINS",
    "DTYPE_PRESERVING_FUNCS",
    "DTYPE_PRESERVING_METHODS",
    "NUMPY_DELEGATING_FUNCS",
    "NUMPY_OK_FUNCS",
    "STATIC_ATTRS",
    "STATIC_BUILTINS",
    "api_call_kind",
    "delegates_to_method",
    "is_array_api",
    "method_call_kind",
]

# attributes of an array that are Python values (metadata)
STATIC_ATTRS: FrozenSet[str] = frozenset({"shape", "ndim", "dtype", "size", "sharding", "aval", "weak_type",
                                          "itemsize", "nbytes", "named_shape"})
# attributes of an array that are the same array, dtype included
ARRAY_ATTRS_SAME: FrozenSet[str] = frozenset({"T", "mT"})
# attributes that are arrays (``.at`` is an indexer whose methods return arrays; ``.value`` reads an
# nnx Variable)
ARRAY_ATTRS_TRACED: FrozenSet[str] = frozenset({"real", "imag", "at", "value"})

# methods whose result has the dtype of the array they are called on (an int8 array stays int8)
DTYPE_PRESERVING_METHODS: FrozenSet[str] = frozenset({
    "reshape", "transpose", "swapaxes", "squeeze", "ravel", "flatten", "clip", "T", "copy", "repeat", "take",
    "__getitem__",
})
_ARRAY_METHODS = frozenset({
    "sum", "mean", "max", "min", "any", "all", "prod", "std", "var", "argmax", "argmin", "cumsum",
    "cumprod", "round", "conj", "conjugate", "nonzero", "sort", "argsort", "dot", "trace",
    "diagonal", "set", "add", "multiply", "divide", "power", "apply", "get", "view",
    "block_until_ready", "astype",
}) | DTYPE_PRESERVING_METHODS

# builtins whose result is a Python value whatever they are given
STATIC_BUILTINS: FrozenSet[str] = frozenset({
    "len", "isinstance", "issubclass", "hasattr", "callable", "type", "id", "str", "repr", "range",
    "int", "float", "bool", "complex", "print", "format", "hash", "dir", "vars", "slice",
})
# builtins whose result is as traced as their arguments
COMBINE_BUILTINS: FrozenSet[str] = frozenset({"abs", "max", "min", "sum", "round", "pow", "divmod", "list",
                                              "tuple", "sorted", "reversed", "set", "frozenset"})

# functions whose result has the dtype of their first array argument (when no ``dtype=`` is given)
DTYPE_PRESERVING_FUNCS: FrozenSet[str] = frozenset(
    ["jax.numpy." + n for n in ("reshape", "transpose", "swapaxes", "moveaxis", "expand_dims",
                                "squeeze", "broadcast_to", "ravel", "clip", "flip", "roll", "tile",
                                "repeat", "negative", "abs", "atleast_1d", "atleast_2d", "take",
                                "asarray", "array")]
    + ["jax.lax." + n for n in ("reshape", "transpose", "broadcast_in_dim", "squeeze",
                                "expand_dims", "dynamic_slice", "slice", "stop_gradient",
                                "dynamic_slice_in_dim", "slice_in_dim", "index_in_dim")]
)
# ``self.<method>(...)`` of a linen module that returns variables (traced) whatever its arguments
_LINEN_TRACED_METHODS = frozenset({"param", "variable", "get_variable", "perturb", "make_rng", "sow",
                                   "get_variables"})

_JNP = "jax.numpy."
# jnp/lax/jax functions whose result is a Python value (or dtype) even on traced input.
_STATIC_RESULT_FUNCS = frozenset(
    [_JNP + n for n in (
        "shape", "ndim", "size", "result_type", "dtype", "issubdtype", "iinfo", "finfo",
        "promote_types", "isdtype", "can_cast", "isscalar", "iscomplexobj", "isrealobj",
    )]
    + ["jax.dtypes.canonicalize_dtype", "jax.dtypes.result_type", "jax.dtypes.issubdtype",
       "jax.tree_util.tree_structure", "jax.tree.structure", "jax.devices", "jax.device_count",
       "jax.local_device_count", "jax.process_index", "jax.process_count", "jax.lax.axis_size",
       "jax.core.concrete_or_error", "jax.numpy.broadcast_shapes"]
)

# numpy functions that are fine on tracers (they only read static metadata).
NUMPY_OK_FUNCS: FrozenSet[str] = frozenset({
    "shape", "ndim", "size", "dtype", "result_type", "issubdtype", "iinfo", "finfo",
    "promote_types", "can_cast", "isscalar",
})

# numpy functions that call the array's own method when given an array that is not a numpy one (numpy's
# ``_wrapreduction`` and ``_wrapfunc``): ``np.sum(x)`` on a tracer is ``x.sum()``, a tracer, not an error.
NUMPY_DELEGATING_FUNCS: FrozenSet[str] = frozenset({
    "sum", "mean", "max", "min", "amax", "amin", "prod", "std", "var", "any", "all", "argmax", "argmin",
    "cumsum", "cumprod", "round", "transpose", "reshape", "squeeze", "swapaxes", "repeat",
})

_ARRAY_API_PREFIXES: Tuple[str, ...] = (
    "jax.numpy.", "jax.lax.", "jax.nn.", "jax.random.", "jax.scipy.", "jax.image.",
)
_JAX_WORLD = ("jax.", "flax.", "equinox.", "optax.")
_NOT_ARRAY_RESULT = ("jax.tree", "jax.device_get")


def delegates_to_method(q: str, arg_kinds: List[int]) -> bool:
    """Whether the numpy function ``q`` runs as its first argument's own method: a traced array's."""
    return q.rpartition(".")[2] in NUMPY_DELEGATING_FUNCS and bool(arg_kinds) and is_traced(arg_kinds[0])


def is_array_api(qualname: str) -> bool:
    """A jax function returning arrays (so its result under a trace is a tracer)."""
    return qualname.startswith(_ARRAY_API_PREFIXES)


def api_call_kind(q: str, call: cst.Call, arg_kinds: List[int], imports: ImportTable) -> int:
    """The kind of the result of calling the imported function ``q``."""
    if q in _STATIC_RESULT_FUNCS:
        return STATIC
    if q in NNX_VARIABLES:
        return VARIABLE
    any_traced = any(is_traced(k) for k in arg_kinds)
    if q.startswith("numpy."):
        # numpy runs on the host: with no tracer among its arguments, its result is a Python-side
        # constant (given a tracer it raises, which JX202 reports, or calls the tracer's own method)
        if q.endswith(".int8"):
            return INT8
        if delegates_to_method(q, arg_kinds):
            return TRACED
        return UNKNOWN if any_traced else STATIC
    if q == "jax.lax.convert_element_type":
        dt = kwarg(call, "new_dtype")
        if dt is None and len(call.args) > 1 and call.args[1].keyword is None:
            dt = call.args[1].value
        return INT8 if dt is not None and is_int8_dtype(dt, imports) else TRACED
    if is_array_api(q):
        if q.endswith(".int8"):
            return INT8
        dt = kwarg(call, "dtype")
        if dt is not None and is_int8_dtype(dt, imports):
            return INT8
        if q in DTYPE_PRESERVING_FUNCS and arg_kinds and arg_kinds[0] == INT8 and dt is None:
            return INT8
        return TRACED
    if any_traced and q.startswith(_JAX_WORLD) and not q.startswith(_NOT_ARRAY_RESULT):
        return TRACED
    return UNKNOWN


def method_call_kind(recv: int, method: str, call: cst.Call, arg_kinds: List[int], imports: ImportTable,
                     linen_self: bool) -> int:
    """The kind of ``recv.method(...)`` for a receiver of kind ``recv``; ``linen_self``: the receiver
    is ``self`` of a flax linen module."""
    any_traced = any(is_traced(k) for k in arg_kinds)
    if method == "astype":
        if call.args and is_int8_dtype(call.args[0].value, imports):
            return INT8
        if is_traced(recv):
            return TRACED
        return STATIC if recv == STATIC else UNKNOWN
    if recv == MODULE_SELF:
        if linen_self and method in _LINEN_TRACED_METHODS:
            return TRACED
        return TRACED if any_traced else UNKNOWN  # a submodule or method applied to arrays
    if recv == VARIABLE:
        return TRACED if method == "get_value" else UNKNOWN
    if is_traced(recv):
        if method in ("item", "tolist"):
            return STATIC
        if method in _ARRAY_METHODS:
            return INT8 if recv == INT8 and method in DTYPE_PRESERVING_METHODS else TRACED
        return UNKNOWN
    if recv == STATIC:
        return STATIC if all(k == STATIC for k in arg_kinds) else UNKNOWN
    return UNKNOWN
