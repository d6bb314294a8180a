"""``int8ify``: wrap a function so that its traced program runs every float matmul in int8."""

from __future__ import annotations

import collections
import functools
import struct
import threading
import weakref
from typing import Any, Callable, Iterable, NamedTuple

import jax
from jax.extend.core import ClosedJaxpr

from .config import RewriteConfig
from .errors import Int8ifyError
from .quantized import materialise
from .report import Report, report
from .rewrite import Rewriter
from .tracing import Signature, resolve_static, split_call, trace

__all__ = ["Int8ified", "int8ify"]

DEFAULT_CACHE_SIZE = 64


class _Program(NamedTuple):
    """One traced program, cached per call signature."""

    float_jaxpr: ClosedJaxpr  # the program as written, over the traced leaves
    out_tree: Any
    rewriter: Rewriter  # shares the rewrite of repeated sub-jaxprs between the uses of this program
    cacheable: bool  # False when the program closes over a tracer of an enclosing trace

    def run(self, flat_args: list) -> list:
        """Evaluate the rewritten program under the current trace (the rewrite happens as it is traced)."""
        outs = self.rewriter.interpret(self.float_jaxpr.jaxpr, self.float_jaxpr.consts, flat_args)
        return [materialise(out) for out in outs]


class Int8ified:
    """A function whose float matmuls run as per-channel int8 matmuls.

    Calling it traces ``fn`` once per call signature (tree structure, shapes, dtypes, static values) and caches
    the program (the most recent ``cache_size`` signatures). Under a JAX transformation (``jit``, ``vmap``,
    ``grad``, ``make_jaxpr``) the rewritten equations are emitted inline, so ``jax.make_jaxpr`` shows them;
    outside any transformation the program runs through a cached ``jax.jit``.

    Attributes:
        fn: the wrapped function.
        config: the rewrite options (:class:`~jaxpr_rewrite.config.RewriteConfig`).
        static_argnums, static_argnames: the static arguments, positions and names completed from each other.
    """

    def __init__(self, fn: Callable, *, config: RewriteConfig, static_argnums=(), static_argnames=(),
                 cache_size: int = DEFAULT_CACHE_SIZE):
        if not callable(fn):
            raise Int8ifyError(f"int8ify expects a callable, got {type(fn).__name__}")
        if not isinstance(cache_size, int) or isinstance(cache_size, bool) or cache_size < 1:
            raise Int8ifyError(f"cache_size must be a positive int, got {cache_size!r}")
        if not isinstance(static_argnames, (str, Iterable)):
            raise Int8ifyError(f"static_argnames must be a parameter name or names (strings), got "
                               f"{static_argnames!r}")
        self.fn = fn
        self.config = config
        self._static = resolve_static(fn, static_argnums, static_argnames)
        self.cache_size = cache_size
        self._cache = _shared_cache(fn, (config, self._static, cache_size))
        # Only the identity attributes: copying fn's __dict__ (the default) would overwrite this wrapper's own
        # fn/config/caches with a wrapped model's attributes, or with an inner wrapper's.
        functools.update_wrapper(self, fn, updated=())

    @property
    def static_argnums(self) -> tuple[int, ...]:
        return tuple(sorted(self._static.argnums))

    @property
    def static_argnames(self) -> tuple[str, ...]:
        return tuple(sorted(self._static.argnames))

    def with_options(self, **options) -> "Int8ified":
        """The same function with some options changed (the others kept), e.g. ``f.with_options(skip="*attn*")``."""
        return Int8ified(self.fn, config=self.config.replace(**options), static_argnums=self.static_argnums,
                         static_argnames=self.static_argnames, cache_size=self.cache_size)

    # -- programs -------------------------------------------------------------------------------------------
    def signature(self, args: tuple, kwargs: dict) -> tuple[Signature, list]:
        """The call's :class:`~jaxpr_rewrite.tracing.Signature` and its traced leaves; static floats are told
        apart by their bits, as ``jax.jit`` does (``0.0`` and ``-0.0`` are different programs, NaN is one)."""
        signature, dynamic = split_call(args, kwargs, self._static, getattr(self.fn, "__name__", repr(self.fn)))
        return signature._replace(key=_bitwise(signature.key)), dynamic

    def _program(self, signature: Signature, dynamic: list) -> _Program:
        cache = self._cache
        with cache.lock:
            program = cache.programs.get(signature)
            if program is not None:
                cache.programs.move_to_end(signature)
                return program
        float_jaxpr, out_tree = trace(self.fn, signature, dynamic)
        cacheable = not any(isinstance(c, jax.core.Tracer) for c in float_jaxpr.consts)
        program = _Program(float_jaxpr, out_tree, Rewriter(self.config), cacheable)
        # A program that closes over an outer tracer belongs to that trace alone: never reuse it.
        if cacheable:
            with cache.lock:
                cache.programs[signature] = program
                while len(cache.programs) > self.cache_size:
                    evicted, _ = cache.programs.popitem(last=False)
                    cache.compiled.pop(evicted, None)
        return program

    def _compiled_run(self, signature: Signature, program: _Program):
        cache = self._cache
        with cache.lock:
            run = cache.compiled.get(signature)
            if run is None and signature in cache.programs:

                def run_program(*flat):
                    return program.run(list(flat))

                run_program.__name__ = run_program.__qualname__ = getattr(self.fn, "__name__", "int8ified")
                run = cache.compiled[signature] = jax.jit(run_program)
        return run

    def float_jaxpr(self, *args, **kwargs) -> ClosedJaxpr:
        """The program as written, traced for these arguments: what the rewrite starts from (the same cached
        trace that :meth:`rewritten_jaxpr` and calls use).

        Arguments:
            *args, **kwargs: the call's arguments (arrays or ``jax.ShapeDtypeStruct``).

        Returns:
            The ``ClosedJaxpr`` over the traced leaves of the arguments.
        """
        signature, dynamic = self.signature(args, kwargs)
        return self._program(signature, dynamic).float_jaxpr

    def rewritten_jaxpr(self, *args, **kwargs) -> ClosedJaxpr:
        """The rewritten program for these arguments, without running it.

        Arguments:
            *args, **kwargs: the call's arguments (arrays or ``jax.ShapeDtypeStruct``).

        Returns:
            The ``ClosedJaxpr`` the call evaluates, over the traced leaves of the arguments (a
            :class:`~jaxpr_rewrite.quantized.QuantizedArray` contributes its arrays: codes, scales, ...).
        """
        signature, dynamic = self.signature(args, kwargs)
        program = self._program(signature, dynamic)
        flat = jax.tree_util.tree_leaves(dynamic)
        structure = jax.tree_util.tree_structure(dynamic)
        return jax.make_jaxpr(lambda *leaves: program.run(jax.tree_util.tree_unflatten(structure, leaves)))(*flat)

    def report(self, *args, **kwargs) -> Report:
        """One row per matmul, with the rewrite's decision and measured int8 error (see
        :func:`jaxpr_rewrite.report.report`)."""
        return report(self, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        signature, dynamic = self.signature(args, kwargs)
        program = self._program(signature, dynamic)
        flat = jax.tree_util.tree_leaves(dynamic)  # a QuantizedArray passes its arrays
        run = None
        if program.cacheable and not any(isinstance(x, jax.core.Tracer) for x in flat):
            run = self._compiled_run(signature, program)
        if run is not None:
            try:
                outs = run(*dynamic)
            except ValueError as e:
                if "incompatible devices" in str(e):
                    _check_devices(self.fn, args, kwargs)
                raise
        else:
            outs = program.run(dynamic)
        return jax.tree_util.tree_unflatten(program.out_tree, outs)

    def __get__(self, instance, owner):
        # Decorating a method: bind like a function would.
        if instance is None:
            return self
        return functools.partial(self, instance)

    def __repr__(self):
        return f"int8ify({getattr(self.fn, '__qualname__', self.fn)!r})"

    # Wrappers of one function with the same options share one cache, so they are the same function to JAX too:
    # ``jax.jit(int8ify(f))`` rebuilt per call then hits jax.jit's own cache as ``jax.jit(f)`` does.
    def __eq__(self, other):
        return isinstance(other, Int8ified) and other._cache is self._cache

    def __hash__(self):
        return hash(id(self._cache))


class _Cache:
    """The traced programs (per call signature, least recently used last) and their compiled runs."""

    def __init__(self):
        self.programs: collections.OrderedDict = collections.OrderedDict()
        self.compiled: dict = {}
        self.lock = threading.Lock()


MAX_SHARED_FUNCTIONS = 256
# id(fn) -> (weak reference to fn, {(config, static arguments, cache_size): _Cache}), least recently used first:
# what makes ``int8ify(f)`` built again for the same function and options reuse its programs, as ``jax.jit(f)``
# does. The entry goes when fn is collected, or when more than MAX_SHARED_FUNCTIONS functions are wrapped.
_shared_caches: collections.OrderedDict = collections.OrderedDict()
_shared_lock = threading.Lock()


def _shared_cache(fn: Callable, options: tuple) -> _Cache:
    """The cache of ``fn`` under ``options``; a fresh one when fn cannot be weakly referenced or the options
    cannot be hashed (an unhashable ``skip_if``), which then belongs to one wrapper alone."""
    try:
        hash(options)
        reference = weakref.ref(fn, functools.partial(_forget, id(fn)))
    except TypeError:
        return _Cache()
    with _shared_lock:
        entry = _shared_caches.get(id(fn))
        if entry is None or entry[0]() is not fn:
            entry = _shared_caches[id(fn)] = (reference, {})
            while len(_shared_caches) > MAX_SHARED_FUNCTIONS:
                _shared_caches.popitem(last=False)
        _shared_caches.move_to_end(id(fn))
        return entry[1].setdefault(options, _Cache())


def _forget(fn_id: int, reference) -> None:
    with _shared_lock:
        entry = _shared_caches.get(fn_id)
        if entry is not None and entry[0] is reference:
            del _shared_caches[fn_id]


def _bitwise(key):
    """A cache key with every Python float (and complex) replaced by its bits: ``0.0 == -0.0`` and
    ``nan != nan`` would otherwise share, or never find, a program."""
    if type(key) is tuple:
        return tuple(_bitwise(k) for k in key)
    if type(key) is float:
        return (float, struct.pack("<d", key))
    if type(key) is complex:
        return (complex, struct.pack("<dd", key.real, key.imag))
    return key


def _check_devices(fn, args, kwargs) -> None:
    """Arrays committed to different devices cannot meet in one program: say which, by argument path."""
    placed = {}
    for prefix, tree in (("args", args), ("kwargs", kwargs)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if isinstance(leaf, jax.Array) and getattr(leaf, "committed", False):
                placed[prefix + jax.tree_util.keystr(path)] = leaf.sharding.device_set
    if len({frozenset(d) for d in placed.values()}) > 1:
        where = ", ".join(f"{path} on {sorted(d.id for d in devices)}" for path, devices in placed.items())
        name = getattr(fn, "__name__", repr(fn))
        raise Int8ifyError(f"the arrays passed to {name} are committed to different devices ({where}); move them "
                           "to one device (or one sharding's devices) with jax.device_put first")


_NO_FUNCTION = object()


def int8ify(fn: Callable = _NO_FUNCTION, /, *, static_argnums=(), static_argnames=(), cache_size=DEFAULT_CACHE_SIZE,
            **options):
    """Rewrite every float matmul of ``fn``'s traced program into the per-channel int8 contract.

    Usable as ``int8ify(fn)``, ``int8ify(fn, **options)``, ``@int8ify`` and ``@int8ify(**options)``.

    Arguments:
        fn: the function to rewrite; any JAX-traceable function of pytrees.
        static_argnums, static_argnames: arguments passed through as Python values, as in ``jax.jit``. Leaves
            that are not arrays (Python numbers, strings, functions) are static automatically.
        cache_size: how many call signatures keep their traced program (least recently used ones are dropped).
        **options: rewrite options (see :class:`~jaxpr_rewrite.config.RewriteConfig`).

    Returns:
        A callable with ``fn``'s signature (an :class:`Int8ified`).
    """
    config = RewriteConfig.from_options(**options)
    if fn is _NO_FUNCTION:  # @int8ify(**options)
        return functools.partial(Int8ified, config=config, static_argnums=static_argnums,
                                 static_argnames=static_argnames, cache_size=cache_size)
    return Int8ified(fn, config=config, static_argnums=static_argnums, static_argnames=static_argnames,
                     cache_size=cache_size)
