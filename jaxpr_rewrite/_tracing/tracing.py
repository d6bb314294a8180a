"""Calls as the rewrite sees them: which argument leaves are traced, which are static, and the traced program.

In the spirit of ``equinox.filter_make_jaxpr``, one rule decides for every entry point (``int8ify``, ``report``,
``verify``, ``quantize_params``, the command line): **arrays are traced, everything else is static**. Arrays
are JAX and numpy arrays, numpy scalars, ``jax.ShapeDtypeStruct`` (traced abstractly) and
:class:`~jaxpr_rewrite.quantized.QuantizedArray` (traced as the float array it stands for). Python numbers,
strings, functions and other leaves are static Python values, as with ``equinox.filter_jit``; so are the
arguments named by ``static_argnums`` / ``static_argnames``.

A :class:`Signature` is the hashable part of a call (tree structure, array types, static values keyed by type
and value, as ``jax.jit`` keys them: ``True`` and ``1`` are different programs).
"""

from __future__ import annotations

import inspect
import linecache
import os
import re
import struct
import traceback
from typing import Any, Callable, Iterable, NamedTuple

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr

from jx_codes import CONCRETIZATION, TRACED_CONDITION, Code

from .. import _compat
from .._core.errors import Int8ifyError, TracedValueError
from .._interpret.config import RewriteConfig
from .._quantized.array import is_quantized, QuantizedArray
from .._quantized.array_layout import METADATA_FIELDS
from .argument_updates import find_updates, relink, shared_objects

__all__ = ["Int8ifiedBase", "Signature", "StaticArgs", "Traced", "argument_tree", "closed_over_quantized_error",
           "function_name", "is_array", "resolve_static", "split_call", "target_of", "trace",
           "traced_value_error"]


class Int8ifiedBase:
    """The base class of :class:`~jaxpr_rewrite._api.Int8ified`, defined here so that the entry points below
    ``api`` (``report``, ``verify``, ``quantize_params``, the command line) tell a wrapped function from a plain
    one by type, the one way the package asks."""

    __slots__ = ()


def is_array(leaf) -> bool:
    """Whether a leaf is traced: an array (JAX, numpy, numpy scalar, tracer, ``ShapeDtypeStruct``) or a
    :class:`~jaxpr_rewrite.quantized.QuantizedArray`."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, QuantizedArray,
                             jax.core.Tracer))


def _static_key(value):
    """A hashable key for a static value that tells ``True``, ``1`` and ``1.0`` apart (they hash equal), and floats
    by their bits, as ``jax.jit`` does: ``0.0`` and ``-0.0`` are different programs, NaN is one (``nan != nan``
    would otherwise never find its program)."""
    if type(value) is tuple:
        return (tuple, tuple(_static_key(v) for v in value))
    if type(value) is float:
        return (float, struct.pack("<d", value))
    if type(value) is complex:
        return (complex, struct.pack("<dd", value.real, value.imag))
    return (type(value), value)


# The leaf types (pytree structure, leaves' shapes and dtypes) of QuantizedArrays found well-formed: a call passing
# the same weights again checks none of them (bounded: cleared when full)
_WELL_FORMED: set = set()
_WELL_FORMED_LIMIT = 1024


def _passed_to(leaf: QuantizedArray, fn_name: str) -> str:
    """What a check's error calls a QuantizedArray argument of ``fn_name``."""
    return f"a QuantizedArray passed to {fn_name} ({leaf!r})"


def _check_quantized(leaf: QuantizedArray, leaf_type, fn_name: str) -> None:
    """Raise :class:`~jaxpr_rewrite._core.errors.Int8ifyError` for a malformed QuantizedArray passed to ``fn_name``; its
    problems (:func:`~jaxpr_rewrite._quantized.array_layout.layout_problems`) depend on its ``leaf_type`` alone, so each
    type is checked once (an eager call's overhead, which competes with the program for the CPU)."""
    if leaf_type in _WELL_FORMED:
        return
    leaf.check(_passed_to(leaf, fn_name))
    if len(_WELL_FORMED) >= _WELL_FORMED_LIMIT:
        _WELL_FORMED.clear()
    _WELL_FORMED.add(leaf_type)


class StaticArgs(NamedTuple):
    """Which arguments of a function are static: positions and names, each completed from the other."""

    argnums: frozenset
    argnames: frozenset


def resolve_static(fn: Callable, static_argnums=(), static_argnames=()) -> StaticArgs:
    """Validate ``static_argnums`` / ``static_argnames`` against ``fn``'s signature, as ``jax.jit`` does.

    Raises:
        Int8ifyError: a position out of range, a name that is not a parameter, or a non-int position.
    """
    nums = (static_argnums,) if not isinstance(static_argnums, Iterable) else tuple(static_argnums)
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in nums):
        raise Int8ifyError(f"static_argnums must be ints, got {static_argnums!r}")
    if not all(isinstance(n, str) for n in names):
        raise Int8ifyError(f"static_argnames must be strings, got {static_argnames!r}")
    name = function_name(fn)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = None
    if params is None:
        if any(i < 0 for i in nums):
            raise Int8ifyError(f"negative static_argnums need a function with an inspectable signature ({name})")
        return StaticArgs(frozenset(int(i) for i in nums), frozenset(names))
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    has_varkw = any(p.kind == p.VAR_KEYWORD for p in params)
    resolved_nums, resolved_names = set(), set(names)
    for i in nums:
        i = int(i)
        if not has_varargs and not -len(positional) <= i < len(positional):
            raise Int8ifyError(
                f"static_argnums={i} is out of range for {name}{inspect.signature(fn)}, which takes "
                f"{len(positional)} positional argument(s)"
            )
        if i < 0:
            if has_varargs:
                raise Int8ifyError(f"negative static_argnums={i} is ambiguous for {name}, which takes *args")
            i += len(positional)
        resolved_nums.add(i)
        if i < len(positional):
            resolved_names.add(positional[i])
    for n in names:
        if n in positional:
            resolved_nums.add(positional.index(n))
        elif n not in {p.name for p in params} and not has_varkw:
            raise Int8ifyError(f"static_argnames contains {n!r}, which is not a parameter of {name}")
    return StaticArgs(frozenset(resolved_nums), frozenset(resolved_names))


class Signature(NamedTuple):
    """The hashable description of a call: everything but the traced arrays' values, and the settings it is
    traced under (x64, the mesh in use, ...: what ``jax.jit`` keys its cache on besides the arguments)."""

    tree: Any  # treedef of (dynamic positional args, dynamic kwargs), QuantizedArrays as leaves
    is_dynamic: tuple  # per leaf: traced or static
    avals: tuple  # per traced leaf: its type (a QuantizedArray: its structure and the types of its arrays)
    static_leaves: tuple  # the static leaves, in order
    static_positional: tuple  # ((position, value), ...) for static_argnums
    static_keywords: tuple  # ((name, value), ...) for static_argnames
    shared: tuple  # places sharing an object with another (argument_updates.shared_objects; only if a leaf repeats)
    key: Any  # the hashable cache key of the arguments
    context: Any  # the settings it is traced under, as JAX keys them (kept out of ``key``: compared as they are)

    def __hash__(self):
        return hash((self.key, self.context))

    def __eq__(self, other):
        return isinstance(other, Signature) and self.key == other.key and self.context == other.context


def target_of(fn, caller: str) -> tuple[Callable, RewriteConfig, Callable]:
    """``(function, options, signature_of)`` for an entry point that takes ``fn``: an ``int8ify``-wrapped
    function's own options and static arguments, or the default options and no static arguments for a plain one.

    ``signature_of(args, kwargs)`` returns ``(Signature, traced leaves)`` of a call.

    Raises:
        Int8ifyError: ``fn`` is not callable (``caller`` names the entry point in the message).
    """
    if isinstance(fn, Int8ifiedBase):
        return fn.fn, fn.config, fn.signature
    if not callable(fn):
        raise Int8ifyError(f"{caller} expects the model function as its first argument, got {type(fn).__name__} "
                           f"{fn!r:.40}")
    name = function_name(fn)
    no_static = StaticArgs(frozenset(), frozenset())
    return fn, RewriteConfig(), lambda args, kwargs: split_call(args, kwargs, no_static, name)


def function_name(fn) -> str:
    """``fn``'s name for messages: its ``__name__``, else its ``repr`` (taken only then: a Flax module's repr prints
    the whole module tree)."""
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else repr(fn)


def _leaf_type(x, fn_name: str):
    if is_quantized(x):
        leaves, treedef = jax.tree_util.tree_flatten(x)
        # the static fields by type too: the structure compares length=64.0 equal to 64, and so would take a
        # malformed array for one found well formed
        metadata = _static_key(tuple(getattr(x, name) for name in METADATA_FIELDS))
        try:
            return treedef, metadata, tuple(jax.typeof(leaf) for leaf in leaves)
        except TypeError:  # a child that is no array (a string, say): the check names it
            x.check(_passed_to(x, fn_name))
            raise
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.core.ShapedArray(x.shape, x.dtype)
    return jax.typeof(x)


def split_call(args: tuple, kwargs: dict, static: StaticArgs = StaticArgs(frozenset(), frozenset()),
               fn_name: str = "the function") -> tuple[Signature, list]:
    """Split a call's arguments into its :class:`Signature` and the leaves that are traced.

    Returns:
        ``(signature, dynamic)``: ``dynamic`` holds one entry per traced leaf (an array, a
        ``ShapeDtypeStruct``, or a :class:`~jaxpr_rewrite.quantized.QuantizedArray`).

    Raises:
        Int8ifyError: a static value that is not hashable.
    """
    static_pos = tuple((i, args[i]) for i in sorted(static.argnums) if i < len(args))
    static_kw = tuple(sorted((k, v) for k, v in kwargs.items() if k in static.argnames))
    dyn_args, dyn_kwargs = _dynamic_parts(args, kwargs, static.argnums, static.argnames)
    leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs), is_leaf=is_quantized)
    is_dynamic = tuple(is_array(x) for x in leaves)
    dynamic = [x for x, d in zip(leaves, is_dynamic) if d]
    static_leaves = tuple(x for x, d in zip(leaves, is_dynamic) if not d)
    avals = tuple(_leaf_type(x, fn_name) for x in dynamic)
    for leaf, leaf_type in zip(dynamic, avals):
        if is_quantized(leaf):
            _check_quantized(leaf, leaf_type, fn_name)
    shared = () if len({id(x) for x in dynamic}) == len(dynamic) else shared_objects((dyn_args, dyn_kwargs), [
        leaf for leaf, d in zip(jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs), is_leaf=is_quantized)[0],
                                is_dynamic) if d])
    key = (tree, is_dynamic, avals, _static_key(static_leaves),
           tuple((i, _static_key(v)) for i, v in static_pos), tuple((k, _static_key(v)) for k, v in static_kw), shared)
    try:
        hash(key)
    except TypeError as e:
        modules = [x for x in static_leaves if callable(getattr(x, "apply", None)) and callable(x)]
        hint = ("; a module that is not a pytree (a Flax linen module, or a method decorated with @int8ify) is no "
                "argument to trace: int8ify the function of its variables, int8ify(model.apply)(variables, x)"
                if modules else "")
        raise Int8ifyError(
            f"a static argument of {fn_name} is not hashable ({e}); static arguments (static_argnums, "
            f"static_argnames, and leaves that are not arrays) must be hashable{hint}"
        ) from None
    return Signature(tree, is_dynamic, avals, static_leaves, static_pos, static_kw, shared, key,
                     _compat.trace_context()), dynamic


def leaf_paths(signature: Signature) -> list[str]:
    """Each traced leaf's path among the call's arguments, as messages name it (``args[2]['k']``, ``kwargs['x']``)."""
    positions = jax.tree_util.tree_unflatten(signature.tree, list(range(len(signature.is_dynamic))))
    paths = {index: jax.tree_util.keystr(path) for path, index in jax.tree_util.tree_flatten_with_path(positions)[0]}
    names = [paths[i] for i, dynamic in enumerate(signature.is_dynamic) if dynamic]
    return [("args" + name[3:]) if name.startswith("[0]") else ("kwargs" + name[3:]) for name in names]


def _rebuilt_tree(signature: Signature, dynamic) -> tuple[list, dict]:
    """``(dynamic positional args, dynamic kwargs)``: the tree :func:`split_call` flattened, rebuilt (objects shared
    where the caller's are)."""
    dyn_iter, static_iter = iter(dynamic), iter(signature.static_leaves)
    leaves = [next(dyn_iter) if d else next(static_iter) for d in signature.is_dynamic]
    root = jax.tree_util.tree_unflatten(signature.tree, leaves)
    relink(root, signature.shared)
    return root


def _with_static(signature: Signature, dyn_args, dyn_kwargs) -> tuple[list, dict]:
    """The call's ``(args, kwargs)``: its dynamic ones with its static ones put back."""
    args = list(dyn_args)
    for i, value in signature.static_positional:
        args.insert(i, value)
    return args, {**dyn_kwargs, **dict(signature.static_keywords)}


def argument_tree(signature: Signature, args: tuple, kwargs: dict) -> tuple[list, dict]:
    """A call's own ``(dynamic positional args, dynamic kwargs)``, the tree :func:`split_call` flattened, holding the
    caller's objects (where :func:`~jaxpr_rewrite._tracing.argument_updates.write_back` sets what the call updated)."""
    return _dynamic_parts(args, kwargs, {i for i, _ in signature.static_positional},
                          {k for k, _ in signature.static_keywords})


def _dynamic_parts(args, kwargs: dict, argnums, argnames) -> tuple[list, dict]:
    return ([a for i, a in enumerate(args) if i not in argnums], {k: v for k, v in kwargs.items() if k not in argnames})


def _abstract(x):
    """What ``jax.make_jaxpr`` traces a leaf as: a QuantizedArray as the float array it stands for."""
    if is_quantized(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_explicit_sharding_of(x))
    return x


def _explicit_sharding_of(q: QuantizedArray):
    """The sharding of the float array ``q`` stands for, where its codes live on a mesh with explicit axes: the
    codes' own (the float array's layout, a 4-bit array's packed last axis sharded alike); else ``None``. Explicit
    axes make a sharding part of every type, so the float program traced with a stand-in sharded otherwise would
    type the weight's matmul, and all that follows, unlike the program the caller wrote."""
    sharding = jax.typeof(q.codes).sharding
    if not getattr(getattr(sharding, "mesh", None), "explicit_axes", ()):
        return None
    return sharding


class Traced(NamedTuple):
    """A call traced: its float program and how to read the program's outputs."""

    jaxpr: ClosedJaxpr  # over the traced leaves (a QuantizedArray is one input of its float type)
    out_tree: Any  # the tree structure of ``fn``'s output, whose leaves the program's outputs start with
    updates: tuple  # the paths of the argument leaves the call replaced, whose new values are the last outputs
    attributes: tuple  # (path of an object, name, value) of each Python attribute the call set (write_attributes)


def trace(fn: Callable, signature: Signature, dynamic: list) -> Traced:
    """Trace ``fn`` on a call's arguments (nothing runs).

    Returns:
        The :class:`Traced` program. Its outputs are ``fn``'s output leaves, then the new value of each leaf
        ``fn`` replaced inside its arguments (state a Flax NNX module updates in place:
        :mod:`~jaxpr_rewrite._tracing.argument_updates`); the Python attributes it set come with it.
    """
    out_tree_box, updates_box = [], []

    def flat_fn(*flat):
        dyn_args, dyn_kwargs = root = _rebuilt_tree(signature, flat)
        args, kwargs = _with_static(signature, dyn_args, dyn_kwargs)
        out_flat, out_tree = jax.tree_util.tree_flatten(fn(*args, **kwargs))
        paths, values, attributes = find_updates(root, _rebuilt_tree(signature, flat), signature.is_dynamic, flat,
                                                 function_name(fn), signature.shared)
        out_tree_box.append(out_tree)
        updates_box.append((paths, attributes))
        return [*out_flat, *values]

    try:
        closed = jax.make_jaxpr(flat_fn)(*(_abstract(x) for x in dynamic))
    except _TRACING_ERRORS as exc:
        raise traced_value_error(exc) from exc
    except TypeError as exc:
        if QuantizedArray.__name__ not in str(exc):
            raise
        raise closed_over_quantized_error(exc, fn) from exc
    return Traced(closed, out_tree_box[-1], *updates_box[-1])


def closed_over_quantized_error(exc: TypeError, fn: Callable | None = None) -> Int8ifyError:
    """The error for a :class:`~jaxpr_rewrite.quantized.QuantizedArray` the traced function reached other than as
    an argument (closed over, a module attribute), which JAX cannot compute with: where, and what works instead;
    for a function that is itself a pytree holding one (a quantized Equinox module), how to pass it in."""
    if fn is not None and any(is_quantized(leaf) for leaf in jax.tree_util.tree_leaves(fn, is_leaf=is_quantized)):
        return Int8ifyError(
            f"the function, a {type(fn).__name__}, holds QuantizedArrays (a quantized module called as it is); int8ify "
            "reads quantized weights from its arguments: pass the module in, int8ify(lambda m, x: m(x))(module, x)")
    frame = _user_frame(exc)
    where = f" at {frame.filename}:{frame.lineno}" if frame is not None else ""
    first = str(exc).strip().splitlines()[0]
    return Int8ifyError(
        f"the function uses a QuantizedArray it does not take as an argument{where} ({first}); int8ify reads "
        "quantized weights from its arguments: pass them in, int8ify(fn)(qparams, x), or close over the float "
        "weights, which int8ify quantizes once when it traces the program")


# -- a traced value used as a Python value ------------------------------------------------------------------------
_TRACING_ERRORS = (
    jax.errors.TracerBoolConversionError,
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (jax, np, __import__("jaxlib"))
) + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)  # the package
# an explicit ``bool(x)`` is a conversion (JX202), as the lint rules see it; ``if x:``, ``x and y`` are branches
_EXPLICIT_BOOL = re.compile(r"\bbool\(")


def _user_frame(exc: BaseException):
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_LIBRARY_DIRS) and not frame.filename.startswith("<frozen"):
            return frame
    return frames[-1] if frames else None


def _code_of(exc: BaseException, text: str) -> Code:
    """One code per cause, as the lint plugin reports the line: a traced value's truth value taken by Python
    control flow is JX201; anything else that needs a concrete value (``bool()``, ``int()``, ``float()``,
    ``.item()``, a numpy function given a tracer, a traced shape) is JX202."""
    if isinstance(exc, jax.errors.TracerBoolConversionError) and not _EXPLICIT_BOOL.search(text):
        return TRACED_CONDITION
    return CONCRETIZATION


def traced_value_error(exc: BaseException) -> TracedValueError:
    """The :class:`~jaxpr_rewrite._core.errors.TracedValueError` for one of JAX's tracer-conversion errors: the user's
    line, its code (JX201 or JX202, see :func:`_code_of`) and that code's advice from :mod:`jx_codes`."""
    frame = _user_frame(exc)
    file, line = (frame.filename, frame.lineno) if frame is not None else (None, None)
    text = (linecache.getline(file, line) if file else "") or (frame.line if frame is not None else "") or ""
    text = text.strip()
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    code = _code_of(exc, text)
    advice = f"{code.title.rstrip('.')}: {code.instead}"
    return TracedValueError(code.code, file, line, text, advice, f"{type(exc).__name__}: {first}".rstrip(": "),
                            type(exc).__name__)
