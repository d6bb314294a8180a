"""``int8ify``: wrap a function so that its traced program runs every float dot in int8."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable, NamedTuple

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr

from .errors import Int8ifyError
from .params import is_quantized
from .rewrite import Rewriter, RewriteConfig


def _is_dynamic_leaf(leaf) -> bool:
    """Arrays and Python numbers are traced; any other leaf (a function, a string) is static, as in
    ``equinox.filter_jit``."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)) or isinstance(
        leaf, jax.core.Tracer
    )


class _Program(NamedTuple):
    """One rewritten program, cached per input signature."""

    closed: ClosedJaxpr
    out_tree: Any
    run_compiled: Callable | None  # jit of the rewritten program, for calls outside any trace


def _quantized_signature(x):
    """A QuantizedArray's part of the cache key: its structure (contracting axes, dtype, smoothing or not)
    and the types of its arrays."""
    leaves, treedef = jax.tree_util.tree_flatten(x)
    return treedef, tuple(jax.typeof(leaf) for leaf in leaves)


def _run_jaxpr(jaxpr, consts, *args):
    return jax.core.eval_jaxpr(jaxpr, consts, *args)


class Int8ified:
    """A function whose float ``dot_general``s run as per-channel int8 dots.

    Calling it traces ``fn`` once per input signature (tree structure, shapes, dtypes, static values),
    rewrites the jaxpr, and caches the result. Under a JAX transformation (``jit``, ``vmap``, ``grad``,
    ``make_jaxpr``) the rewritten equations are emitted inline, so ``jax.make_jaxpr`` shows them; outside any
    transformation the rewritten program runs through a cached ``jax.jit``.
    """

    def __init__(
        self,
        fn: Callable,
        *,
        static_argnums: Iterable[int] = (),
        static_argnames: Iterable[str] = (),
        config: RewriteConfig,
    ):
        if not callable(fn):
            raise Int8ifyError(f"int8ify expects a callable, got {type(fn).__name__}")
        self.fn = fn
        self.config = config
        self._static_argnums, self._static_argnames = _resolve_static(fn, static_argnums, static_argnames)
        self._cache: dict = {}
        functools.update_wrapper(self, fn)

    # -- signature handling -----------------------------------------------------------------------------
    def _split(self, args, kwargs):
        """Split a call's arguments into a hashable signature key and the arrays the program takes.

        Returns:
            ``(key, dynamic)``: ``dynamic`` holds one entry per traced leaf: an array, or a
            :class:`QuantizedArray` (traced as a float array of its original type, passed as codes and
            scales).
        """
        static_pos = tuple((i, args[i]) for i in self._static_argnums if i < len(args))
        static_kw = tuple(sorted((k, v) for k, v in kwargs.items() if k in self._static_argnames))
        dyn_args = [a for i, a in enumerate(args) if i not in self._static_argnums]
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_argnames}
        leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs), is_leaf=is_quantized)
        is_dynamic = tuple(_is_dynamic_leaf(x) or is_quantized(x) for x in leaves)
        dynamic = [x for x, d in zip(leaves, is_dynamic) if d]
        static_leaves = tuple(x for x, d in zip(leaves, is_dynamic) if not d)
        avals = tuple(
            _quantized_signature(x) if is_quantized(x) else jax.typeof(x)
            for x in dynamic
        )
        key = (tree, is_dynamic, avals, static_pos, static_kw, static_leaves)
        try:
            hash(key)
        except TypeError as e:
            raise Int8ifyError(
                f"a static argument of {getattr(self.fn, '__name__', self.fn)} is not hashable ({e}); "
                "static arguments (static_argnums/static_argnames, and non-array leaves) must be hashable"
            ) from None
        return key, dynamic

    def _rebuild(self, key, dynamic):
        tree, is_dynamic, _, static_pos, static_kw, static_leaves = key
        dyn_iter, static_iter = iter(dynamic), iter(static_leaves)
        leaves = [next(dyn_iter) if d else next(static_iter) for d in is_dynamic]
        dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(tree, leaves)
        args = list(dyn_args)
        for i, value in sorted(static_pos):
            args.insert(i, value)
        return args, {**dyn_kwargs, **dict(static_kw)}

    # -- tracing ----------------------------------------------------------------------------------------
    def _program(self, key, dynamic) -> _Program:
        program = self._cache.get(key)
        if program is not None:
            return program
        out_tree_box = []

        def flat_fn(*flat):
            args, kwargs = self._rebuild(key, flat)
            out_flat, out_tree = jax.tree_util.tree_flatten(self.fn(*args, **kwargs))
            out_tree_box.append(out_tree)
            return out_flat

        # Pre-quantized weights are traced as the float arrays they stand for.
        traced = jax.make_jaxpr(flat_fn)(
            *(jax.ShapeDtypeStruct(x.shape, x.dtype) if is_quantized(x) else x for x in dynamic)
        )
        quantized = {i: x for i, x in enumerate(dynamic) if is_quantized(x)}
        rewriter = Rewriter(self.config)
        if quantized:
            closed = rewriter.with_quantized_inputs(traced, quantized)
        else:
            closed = rewriter.closed(traced)
        captures_tracer = any(isinstance(c, jax.core.Tracer) for c in closed.consts)
        run_compiled = None if captures_tracer else jax.jit(functools.partial(_run_jaxpr, closed.jaxpr))
        program = _Program(closed, out_tree_box[-1], run_compiled)
        # A program that closes over an outer tracer belongs to that trace alone: never reuse it.
        if not captures_tracer:
            self._cache[key] = program
        return program

    def rewritten_jaxpr(self, *args, **kwargs) -> ClosedJaxpr:
        """The rewritten program for these arguments, without running it.

        Returns:
            The ``ClosedJaxpr`` the call would evaluate, over the dynamic (array) leaves of the arguments.
        """
        key, dynamic = self._split(args, kwargs)
        return self._program(key, dynamic).closed

    def report(self, *args, **kwargs):
        """One row per dot_general, with the rewrite's decision and measured int8 error.

        Arguments:
            *args, **kwargs: the call's arguments; concrete arrays get each dot's error measured,
                ``jax.ShapeDtypeStruct`` only traces.

        Returns:
            A :class:`~jaxpr_rewrite.report.Report` (prints as an aligned table).
        """
        from .report import report

        return report(self, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        key, dynamic = self._split(args, kwargs)
        program = self._program(key, dynamic)
        dynamic = jax.tree_util.tree_leaves(dynamic)  # a QuantizedArray passes its arrays
        if program.run_compiled is not None and not any(isinstance(x, jax.core.Tracer) for x in dynamic):
            out = program.run_compiled(program.closed.consts, *dynamic)
        else:
            out = jax.core.eval_jaxpr(program.closed.jaxpr, program.closed.consts, *dynamic)
        return jax.tree_util.tree_unflatten(program.out_tree, out)

    def __get__(self, instance, owner):
        # Decorating a method: bind like a function would.
        if instance is None:
            return self
        return functools.partial(self, instance)

    def __repr__(self):
        return f"int8ify({getattr(self.fn, '__qualname__', self.fn)!r})"


def _resolve_static(fn, static_argnums, static_argnames):
    """Static argument positions and names, each completed from the other through ``fn``'s signature."""
    nums = {int(static_argnums)} if isinstance(static_argnums, int) else {int(i) for i in static_argnums}
    names = {static_argnames} if isinstance(static_argnames, str) else set(static_argnames)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = None
    if params is not None:
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
        nums = {i + len(positional) if i < 0 else i for i in nums}
        for i in nums:
            if i < len(positional):
                names.add(positional[i])
            elif not has_varargs:
                raise Int8ifyError(f"static_argnums={i} is out of range for {fn.__name__}{inspect.signature(fn)}")
        for name in list(names):
            if name in positional:
                nums.add(positional.index(name))
            elif name not in {p.name for p in params} and not any(p.kind == p.VAR_KEYWORD for p in params):
                raise Int8ifyError(f"static_argnames contains {name!r}, which is not a parameter of {fn.__name__}")
    elif any(i < 0 for i in nums):
        raise Int8ifyError("negative static_argnums need a function with an inspectable signature")
    return frozenset(nums), frozenset(names)


def int8ify(fn: Callable | None = None, /, *, static_argnums=(), static_argnames=(), **options):
    """Rewrite every float ``dot_general`` of ``fn``'s traced program into the per-channel int8 contract.

    Usable as ``int8ify(fn)``, ``int8ify(fn, **options)``, ``@int8ify`` and ``@int8ify(**options)``.

    Arguments:
        fn: the function to rewrite; any JAX-traceable function of pytrees.
        static_argnums, static_argnames: arguments passed through as Python values, as in ``jax.jit``.
            Leaves that are not arrays or numbers (functions, strings) are static automatically.
        **options: rewrite options (see :class:`RewriteConfig`).

    Returns:
        A callable with ``fn``'s signature (an :class:`Int8ified`).
    """
    if fn is None:
        return functools.partial(int8ify, static_argnums=static_argnums, static_argnames=static_argnames, **options)
    try:
        config = RewriteConfig(**options)
    except TypeError:
        known = sorted(f.name for f in __import__("dataclasses").fields(RewriteConfig))
        unknown = sorted(set(options) - set(known))
        raise Int8ifyError(f"unknown int8ify option(s) {unknown}; known options: {known}") from None
    return Int8ified(fn, static_argnums=static_argnums, static_argnames=static_argnames, config=config)
