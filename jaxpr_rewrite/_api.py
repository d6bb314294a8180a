"""``int8ify``: wrap a function so that its traced program runs every float matmul in int8."""

from __future__ import annotations

import collections
import functools
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, NamedTuple

import jax
from jax.extend.core import ClosedJaxpr

from ._core import platforms
from ._core.errors import Int8ifyError, RequantizationWarning
from ._inspect.report import Report, report
from ._interpret.config import RewriteConfig
from ._interpret.requantized import requantized_arguments
from ._interpret.rewrite import Rewriter
from ._ptq.params import quantizable_uses, quantized_weight
from ._quantized.array import is_quantized, materialise
from ._tracing.argument_updates import write_attributes, write_back
from ._tracing.tracing import (argument_tree, function_name, Int8ifiedBase, leaf_paths, resolve_static, Signature,
                               split_call, trace)

__all__ = ["Int8ified", "int8ify"]

DEFAULT_CACHE_SIZE = 64


class _Program(NamedTuple):
    """One traced program, cached per call signature."""

    float_jaxpr: ClosedJaxpr  # the program as written, over the traced leaves
    out_tree: Any  # the structure of the function's output, whose leaves the outputs start with
    updates: tuple  # the argument leaves the function replaces (last among the outputs), tracing.Traced
    attributes: tuple  # the Python attributes of its arguments the function sets, tracing.Traced
    rewriter: Rewriter  # shares the rewrite of repeated sub-jaxprs between the uses of this program
    cacheable: bool  # False when the program closes over a tracer of an enclosing trace
    consts: list  # float_jaxpr's constants, the weights among them quantized once (_quantized_constants)

    def run(self, flat_args: list) -> list:
        """Evaluate the rewritten program under the current trace (the rewrite happens as it is traced).

        An output that is quantized in the layout of a quantized input (that input returned, or written into: a
        model returned with its weights, a KV cache updated in place) stays quantized, so the next call gets it as
        this one did; any other is materialised (a weight transposed or broadcast on its way out is the float
        function's value)."""
        outs = self.rewriter.interpret(self.float_jaxpr.jaxpr, self.consts, flat_args)
        layouts = {_layout(x) for x in flat_args if is_quantized(x)}
        return [out if is_quantized(out) and _layout(out) in layouts else materialise(out) for out in outs]


def _layout(array) -> tuple:
    """A quantized array's layout: its pytree structure (metadata included) and its arrays' shapes and dtypes."""
    leaves, structure = jax.tree_util.tree_flatten(array)
    return structure, tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves)


def _warn_of_requantized_arguments(jaxpr, config: RewriteConfig, signature: Signature, dynamic: list) -> None:
    """A :class:`~jaxpr_rewrite._core.errors.RequantizationWarning` for each rewritten dot that quantizes a large
    float argument on every call at too few rows to pay for it
    (:func:`~jaxpr_rewrite._interpret.requantized.requantized_arguments`), naming the dot and the argument."""
    float_arguments = [i for i, x in enumerate(dynamic) if not is_quantized(x)]
    found = requantized_arguments(jaxpr, config, float_arguments)
    if found:
        paths = leaf_paths(signature)
        for dot in found:
            warnings.warn(dot.message(paths[dot.argument]), RequantizationWarning, stacklevel=4)


def _reads_activations_otherwise(dynamic: list) -> bool:
    """Whether a call's dots may read an activation through a pre-quantized weight's static activation scale or
    SmoothQuant factors (one among the call's traced leaves ``dynamic``). Then no array of the call is quantized
    ahead as a weight (an input passed again, a constant): it may be such an activation, and its dynamic codes
    would replace the scales its dot reads it with."""
    return any(is_quantized(x) and (x.activation_scale is not None or x.smooth is not None) for x in dynamic)


def _ahead_uses(jaxpr, var, config: RewriteConfig, calibrated) -> list:
    """The uses of ``var`` (an input or constant of ``jaxpr``) when it is quantized ahead as a weight: those of
    :func:`~jaxpr_rewrite._ptq.params.quantizable_uses`, unless one is a dot between two activations with calibrated
    scales (``calibrated``: the ids of those dots), which reads it with them."""
    uses = quantizable_uses(jaxpr, var, config)
    return [] if any(id(use.eqn) in calibrated for use in uses) else uses


def _quantized_constants(closed: ClosedJaxpr, config: RewriteConfig, weights: "_QuantizedWeights",
                         ahead: bool = True, calibrated=frozenset()) -> list:
    """The constants of a traced program or of a closed jaxpr inside it (the arrays ``fn`` or a jitted function it
    calls close over) with each weight among them quantized once:
    each ``jax.Array`` constant :func:`~jaxpr_rewrite.quantize_params` would quantize were it a parameter (every use
    a rewritten matmul), with the codes and scales the program would compute from it, bit for bit, shared by the
    programs of every call signature through ``weights``.

    Left float, they would be quantized inside the compiled program, where XLA folds the quantization of a
    constant at compile time, slowly (about a second of compile time per million weights on CPU, with an
    error-level log line for each fold over a second) or not at all. Quantized here, eagerly, the program holds
    their int8 codes as constants instead. As for any pre-quantized weight, a derivative through such a matmul is
    the float matmul's at the weight's value inside the dot. With ``ahead`` false (see
    :func:`_reads_activations_otherwise`) they are left as they are, and so is an operand of a dot with calibrated
    scales (the ids of those dots in ``calibrated``)."""
    jaxpr = closed.jaxpr
    consts = list(closed.consts)
    if not ahead:
        return consts
    with jax.ensure_compile_time_eval():  # eagerly, also while an enclosing jit traces the call
        for i, (var, value) in enumerate(zip(jaxpr.constvars, consts)):
            uses = _ahead_uses(jaxpr, var, config, calibrated) if _is_weight_array(value) else []
            if uses:
                consts[i] = weights.quantized(value, uses)
    return consts


class Int8ified(Int8ifiedBase):
    """A function whose float matmuls run as per-channel int8 matmuls.

    Calling it traces ``fn`` once per call signature (tree structure, shapes, dtypes, static values) and caches
    the program (the most recent ``cache_size`` signatures). Under a JAX transformation (``jit``, ``vmap``,
    ``grad``, ``make_jaxpr``) the rewritten equations are emitted inline, so ``jax.make_jaxpr`` shows them;
    outside any transformation the program runs through a cached ``jax.jit``.

    Attributes:
        fn: the wrapped function.
        config: the rewrite options (:class:`~jaxpr_rewrite._interpret.config.RewriteConfig`).
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
        self._name = function_name(fn)  # once: it is in every call's messages, and a repr can be costly
        self.config = config
        self._static = resolve_static(fn, static_argnums, static_argnames)
        self.cache_size = cache_size
        self._programs: collections.OrderedDict = collections.OrderedDict()
        self._compiled: dict = {}
        self._weight_uses: dict = {}  # Signature -> {position of a traced leaf: its matmul uses}
        self._weights = _QuantizedWeights()
        self._lock = threading.Lock()
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
        return _wrapper(self.fn, config=self.config.replace(**options), static_argnums=self.static_argnums,
                        static_argnames=self.static_argnames, cache_size=self.cache_size)

    # -- programs -------------------------------------------------------------------------------------------
    def signature(self, args: tuple, kwargs: dict) -> tuple[Signature, list]:
        """The call's :class:`~jaxpr_rewrite._tracing.tracing.Signature` and its traced leaves; static floats are told
        apart by their bits, as ``jax.jit`` does (``0.0`` and ``-0.0`` are different programs, NaN is one)."""
        return split_call(args, kwargs, self._static, self._name)

    def _key(self, signature: Signature) -> tuple:
        """A program's cache key: the call's signature and the platforms its program is traced for (the default
        device's may change between calls, under ``jax.default_device``)."""
        return signature, self.config.platforms or platforms.targeted()

    def _program(self, signature: Signature, dynamic: list) -> _Program:
        key = self._key(signature)
        with self._lock:
            program = self._programs.get(key)
            if program is not None:
                self._programs.move_to_end(key)
                return program
        float_jaxpr, out_tree, updates, attributes = trace(self.fn, signature, dynamic)
        cacheable = not any(isinstance(c, jax.core.Tracer) for c in float_jaxpr.consts)
        scales = self.config.activation_scales
        constants = functools.partial(
            _quantized_constants, config=self.config, weights=self._weights, ahead=not _reads_activations_otherwise(
                dynamic), calibrated=frozenset(() if scales is None else scales.assign(float_jaxpr.jaxpr)))
        program = _Program(float_jaxpr, out_tree, updates, attributes,
                           Rewriter(self.config, float_jaxpr.jaxpr, constants), cacheable, constants(float_jaxpr))
        _warn_of_requantized_arguments(float_jaxpr.jaxpr, self.config, signature, dynamic)
        # A program that closes over an outer tracer belongs to that trace alone: never reuse it.
        if cacheable:
            with self._lock:
                self._programs[key] = program
                while len(self._programs) > self.cache_size:
                    evicted, _ = self._programs.popitem(last=False)
                    self._compiled.pop(evicted, None)
                    self._weight_uses.pop(evicted[0], None)
        return program

    def _compiled_run(self, signature: Signature, program: _Program):
        key = self._key(signature)
        with self._lock:
            run = self._compiled.get(key)
            if run is None and key in self._programs:

                def run_program(*flat):
                    return program.run(list(flat))

                run_program.__name__ = run_program.__qualname__ = getattr(self.fn, "__name__", "int8ified")
                run = self._compiled[key] = jax.jit(run_program)
        return run

    def _with_quantized_weights(self, signature: Signature, program: _Program, dynamic: list) -> list:
        """The traced leaves of an eager call with the float arrays that come back replaced by their quantized
        copies, made once per array: the leaves :func:`~jaxpr_rewrite.quantize_params` would quantize, when they
        are ``jax.Array`` (immutable, so the same array passed again has the same codes) passed in an earlier
        call too. The result is the same, bit for bit; the call skips those weights' absmax and quantization.

        An activation passed again (the same input array) is such a leaf too, and its codes are those of its
        dynamic scales. So none is replaced in a call whose dots may read an activation otherwise
        (:func:`_reads_activations_otherwise`), nor an operand of a dot with calibrated scales. The static scale
        was otherwise dropped for the activation's dynamic one on the second call of the same input: other
        numbers than the first call's."""
        with self._lock:
            uses = self._weight_uses.get(signature)
        if uses is None:
            jaxpr = program.float_jaxpr.jaxpr
            calibrated = program.rewriter.static_dots
            uses = {} if _reads_activations_otherwise(dynamic) else {
                i: found for i, var in enumerate(jaxpr.invars)
                if (found := _ahead_uses(jaxpr, var, self.config, calibrated))}
            with self._lock:
                self._weight_uses[signature] = uses
        return [self._weights.get(x, uses[i]) if i in uses and _is_weight_array(x) else x
                for i, x in enumerate(dynamic)]

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
        :func:`jaxpr_rewrite._inspect.report.report`)."""
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
                outs = run(*self._with_quantized_weights(signature, program, dynamic))
            except ValueError as e:
                if "incompatible devices" in str(e):
                    _check_devices(self.fn, args, kwargs)
                raise
        else:
            outs = program.run(dynamic)
        if program.updates:  # state the function updates in its arguments (a Flax NNX module's variables)
            n_out = len(outs) - len(program.updates)
            write_back(argument_tree(signature, args, kwargs), program.updates, outs[n_out:], self._name)
            outs = outs[:n_out]
        if program.attributes:  # Python attributes it sets (a call counter), as running the function again would
            write_attributes(argument_tree(signature, args, kwargs), program.attributes)
        return jax.tree_util.tree_unflatten(program.out_tree, outs)

    def __get__(self, instance, owner):
        # Decorating a method: bind like a function would.
        if instance is None:
            return self
        return functools.partial(self, instance)

    def __repr__(self):
        return f"int8ify({getattr(self.fn, '__qualname__', self.fn)!r})"


def _is_weight_array(x) -> bool:
    # a jax.Array cannot change (a numpy array can, in place, between calls); a tracer is not a value yet; a deleted
    # one (donated to another computation, or .delete()) is passed as it is, so the call fails as the float
    # function's does instead of answering from the codes quantized while it lived
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and not x.is_deleted()


class _QuantizedWeights:
    """Quantized copies of the float arrays that eager calls pass again (weights come back; activations are
    new each call) and of the weights traced programs close over, each kept as long as its array lives."""

    def __init__(self):
        # (id(array), casts, axes) -> [weak reference to the array, its QuantizedArray once made]
        self._entries: dict = {}
        self._lock = threading.Lock()

    def get(self, array, uses):
        """``array`` as the call passes it: its quantized copy when the array was passed before (made on its
        second call), else the array itself (quantized inside the program, as every call would)."""
        entry, seen = self._entry(array, uses)
        if not seen:
            return array
        if entry[1] is None:
            entry[1] = quantized_weight(array, uses)
        return entry[1]

    def quantized(self, array, uses):
        """``array``'s quantized copy, made now unless it was before: a constant of a traced program (the same
        array in the programs of other call signatures gets the same copy)."""
        entry, _ = self._entry(array, uses)
        if entry[1] is None:
            entry[1] = quantized_weight(array, uses)
        return entry[1]

    def _entry(self, array, uses):
        """``array``'s entry ``[weak reference, quantized copy or None]`` and whether it was there before."""
        key = (id(array), tuple(uses[0].casts), uses[0].from_end)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0]() is array:
                return entry, True
            entry = self._entries[key] = [weakref.ref(array, lambda _, key=key: self._drop(key)), None]
        return entry, False

    def _drop(self, key):
        with self._lock:
            self._entries.pop(key, None)


def _check_devices(fn, args, kwargs) -> None:
    """Arrays committed to different devices cannot meet in one program: say which, by argument path."""
    placed = {}
    for prefix, tree in (("args", args), ("kwargs", kwargs)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if isinstance(leaf, jax.Array) and getattr(leaf, "committed", False):
                placed[prefix + jax.tree_util.keystr(path)] = leaf.sharding.device_set
    if len({frozenset(d) for d in placed.values()}) > 1:
        where = ", ".join(f"{path} on {sorted(d.id for d in devices)}" for path, devices in placed.items())
        raise Int8ifyError(f"the arrays passed to {function_name(fn)} are committed to different devices ({where}); "
                           "move them to one device (or one sharding's devices) with jax.device_put first")


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
        **options: rewrite options (see :class:`~jaxpr_rewrite._interpret.config.RewriteConfig`).

    Returns:
        A callable with ``fn``'s signature (an :class:`Int8ified`): the same one, with its cached programs, when
        ``fn`` was wrapped with the same options recently (so rebuilding it per call costs a lookup).
    """
    config = RewriteConfig.from_options(**options)
    if fn is _NO_FUNCTION:  # @int8ify(**options)
        return functools.partial(_wrapper, config=config, static_argnums=static_argnums,
                                 static_argnames=static_argnames, cache_size=cache_size)
    return _wrapper(fn, config=config, static_argnums=static_argnums, static_argnames=static_argnames,
                    cache_size=cache_size)


MAX_RECENT_WRAPPERS = 64
# (id(fn), options, static arguments, cache_size) -> the Int8ified built for them, least recently used first. It
# makes int8ify(f) built again for the same function and options the same object, with its traced programs and
# compiled runs, so jax.jit(int8ify(f)) built again hits jax.jit's cache too (as jax.jit(f) and
# equinox.filter_jit(f) do). It holds them strongly, as jax.jit's cache holds static arguments: the least
# recently used is dropped past MAX_RECENT_WRAPPERS.
_recent_wrappers: collections.OrderedDict = collections.OrderedDict()
_recent_lock = threading.Lock()


def _wrapper(fn: Callable, *, config: RewriteConfig, static_argnums, static_argnames, cache_size) -> Int8ified:
    """The :class:`Int8ified` of ``fn`` under these options: a recent one when there is one (a fresh one,
    unshared, when the options cannot be hashed, e.g. an unhashable ``skip_if``)."""
    wrapper = Int8ified(fn, config=config, static_argnums=static_argnums, static_argnames=static_argnames,
                        cache_size=cache_size)
    key = (id(fn), config, wrapper._static, cache_size)
    try:
        hash(key)
    except TypeError:
        return wrapper
    with _recent_lock:
        recent = _recent_wrappers.get(key)
        if recent is not None and recent.fn is fn:  # (the entry holds fn, so its id is not reused meanwhile)
            _recent_wrappers.move_to_end(key)
            return recent
        _recent_wrappers[key] = wrapper
        while len(_recent_wrappers) > MAX_RECENT_WRAPPERS:
            _recent_wrappers.popitem(last=False)
    return wrapper
