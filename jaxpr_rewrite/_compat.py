"""The one module that touches JAX internals (``jax._src``).

Tested against JAX 0.8.3 to 0.12.0.1 (the range is pinned in pyproject.toml). Everything else in the package
uses public API; when a JAX upgrade breaks the rewrite, this file is where to look first.

What needs internals, and why:

* ``trace_to_jaxpr``: sub-jaxprs (scan bodies, cond branches, shard_map bodies) are re-traced at their
  exact input avals (weak types and varying-manual-axes included), which ``jax.make_jaxpr`` cannot take.
* ``shard_map_body_context``: a shard_map body can only be traced inside its mesh axis environment.
* ``wrap_jaxpr_thunk``: custom_jvp/custom_vjp keep their jvp/fwd rules as ``linear_util.WrappedFun`` thunks
  that produce jaxprs; the rewrite wraps them to rewrite what they produce.
* ``scaled_matmul_primitive``: ``jax.nn.scaled_matmul`` stages a ``jit`` around the ``scaled_matmul_wrapper``
  primitive, which lowers (through ``custom_partitioning``) to the ``scaled_matmul`` primitive of
  ``jax._src.cudnn.scaled_matmul_stablehlo``. JAX gives that primitive lowering rules for ``cuda`` (the
  cuDNN ``__op$block_scaled_dot`` custom call) and ``rocm`` only; on CPU lowering fails with "MLIR
  translation rule for primitive 'scaled_matmul' not found for platform cpu".
* ``trace_context``: the settings besides the arguments that ``jax.jit`` keys its own cache on (x64, the mesh
  in use, the default device, type promotion, matmul precision, ...); a program traced under other settings
  types its values differently (``jnp.arange`` int32 or int64, a sharding per value on an explicit mesh).
* ``result_struct`` (public API, named differently by version): a Pallas kernel's result type with the manual
  mesh axes it varies over, ``manual_axis_type`` since JAX 0.10, ``vma`` before.
* ``python_traceback``: the current Python stack as JAX records it; ``source_info_util.user_context`` only
  replaces the recorded stack with another one, so the shared int8 program is traced under a fresh stack (its
  equations then point at this library instead of the user line that happened to trace it first).
* ``has_lowering``: whether JAX already has a rule for a primitive on a platform, so that the emulation is
  registered only where JAX has none (never replacing JAX's own cuda/rocm rules).
* ``InconclusiveDimension``: the exception a comparison of ``jax.export`` symbolic dims raises when their
  constraints do not decide it (``jax._src.core.InconclusiveDimensionOperation`` in JAX 0.8-0.12; not public).
  The dot rule asks whether a symbolic contraction can overflow int32 sums, and says what to bound when it can.
* ``lowering_for_export``: whether a lowering rule runs for ``jax.export`` (``LoweringParameters.for_export`` of
  the rule's module context, JAX 0.8-0.12): XLA's layout constraint, which the TPU rule of
  :mod:`~jaxpr_rewrite._platforms.tpu_layout` lowers to, is a custom call that ``jax.export`` refuses to serialize.
* ``generalize_batchers``: JAX's batching rule for ``scaled_matmul`` / ``scaled_matmul_wrapper`` asserts
  that all four operands are batched along the same axis and assumes that axis is the leading one, so
  ``jax.vmap`` over a rewritten function with an unbatched weight fails (``AssertionError``). The rule is
  wrapped to move every batch axis to the front first (broadcasting unbatched operands), which is the
  case JAX's rule handles.

:func:`register_emulated_lowering` and :func:`generalize_batchers` are called when an fp8/fp4 backend is first
used (:func:`jaxpr_rewrite._backends.scaled_matmul.enable_emulation`), never at import; both are idempotent.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax
from jax.interpreters import batching, mlir
from jax._src import config as _config
from jax._src import core as _core
from jax._src import linear_util as _lu
from jax._src import shard_map as _shard_map
from jax._src import xla_bridge as _xb
from jax._src.cudnn import scaled_matmul_stablehlo as _scaled_matmul_stablehlo
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.lib import xla_client as _xla_client
from jax._src.mesh import use_abstract_mesh as _use_abstract_mesh

InconclusiveDimension = _core.InconclusiveDimensionOperation


def bind(primitive, invals, params: dict):
    """``primitive.bind`` with an equation's params, as ``jax.core.eval_jaxpr`` does it. JAX <= 0.9 splits
    ``get_bind_params`` into ``(subfuns, params)``; JAX 0.10 returns the params alone."""
    bind_params = primitive.get_bind_params(params)
    if isinstance(bind_params, tuple):
        subfuns, bind_params = bind_params
        return primitive.bind(*subfuns, *invals, **bind_params)
    return primitive.bind(*invals, **bind_params)


def scan_counts(params: dict) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation. JAX <= 0.10 has them as params; JAX 0.11 replaced both
    with ``ft_in``, a tree of the operands as ``(consts, carry, xs)`` whose parts count their leaves."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def can_inline_late() -> bool:
    """Whether ``jax.jit`` can ask XLA to inline its calls late (``jax.Inline.XLA_LATE``, JAX 0.11+)."""
    return getattr(jax, "Inline", None) is not None


def jit_inlined_late(fn: Callable, **jit_kwargs) -> Callable | None:
    """``jax.jit(fn)`` whose calls XLA inlines late instead of first (``jax.Inline.XLA_LATE``, JAX 0.11+);
    ``None`` where JAX cannot say so."""
    return jax.jit(fn, inline=jax.Inline.XLA_LATE, **jit_kwargs) if can_inline_late() else None


def trace_to_jaxpr(fn: Callable, in_avals: Sequence[Any], debug_info) -> tuple[Any, list[Any]]:
    """Trace ``fn(*args)`` at exactly ``in_avals`` to a jaxpr.

    Arguments:
        fn: a function of flat positional arrays returning a flat list of arrays.
        in_avals: the abstract values of its arguments, used verbatim.
        debug_info: the ``DebugInfo`` of the jaxpr being rewritten, kept on the result.

    Returns:
        ``(jaxpr, consts)``: an open jaxpr and the values of its constvars.
    """
    wrapped = _lu.wrap_init(fn, debug_info=debug_info)
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return jaxpr, consts


def shard_map_body_context(params) -> contextlib.ExitStack:
    """The axis environment and abstract mesh under which a ``shard_map`` body is traced.

    Arguments:
        params: the ``shard_map`` equation's params.

    Returns:
        A context manager, the same one ``jax._src.shard_map`` uses when it stages the body.
    """
    mesh = params["mesh"]
    manual = shard_map_manual_axes(params)
    stack = contextlib.ExitStack()
    stack.enter_context(_shard_map._extend_axis_env(mesh, manual))
    stack.enter_context(_use_abstract_mesh(_shard_map._as_manual_mesh(mesh, manual)))
    stack.enter_context(_config._check_vma(params["check_vma"]))
    return stack


def shard_map_manual_axes(params) -> frozenset:
    """The mesh axes a ``shard_map`` equation makes manual (its ``axis_names``): ``newly_manual_axes`` since JAX
    0.10, ``manual_axes`` in JAX <= 0.9 (a param, no internals)."""
    return params["newly_manual_axes"] if "newly_manual_axes" in params else params["manual_axes"]


def result_struct(shape, dtype, operands: Sequence) -> jax.ShapeDtypeStruct:
    """A kernel result's ``ShapeDtypeStruct`` varying over every manual mesh axis one of ``operands`` varies over:
    inside ``shard_map`` (``check_vma``) a ``pallas_call``'s ``out_shape`` must say it. JAX 0.10 holds that in
    the aval's ``manual_axis_type`` (its ``varying`` axes), JAX <= 0.9 in its ``vma``."""
    avals = [jax.typeof(x) for x in operands]
    if hasattr(avals[0], "manual_axis_type"):
        varying = frozenset().union(*(a.manual_axis_type.varying for a in avals))
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=avals[0].manual_axis_type.update(varying=varying))
    return jax.ShapeDtypeStruct(shape, dtype, vma=frozenset().union(*(getattr(a, "vma", frozenset()) for a in avals)))


def trace_context():
    """The hashable settings a traced program depends on besides its arguments, as ``jax.jit`` keys them."""
    return _config.trace_context()


def python_traceback():
    """The current Python stack, as JAX records it in a ``SourceInfo``."""
    return _xla_client.Traceback.get_traceback()


def wrap_jaxpr_thunk(thunk, transform: Callable[[tuple], tuple]):
    """Wrap a ``WrappedFun`` that returns ``(jaxpr, consts, *rest)`` so its result passes through ``transform``.

    Arguments:
        thunk: the custom_jvp ``jvp_jaxpr_fun`` or custom_vjp ``fwd_jaxpr_thunk`` param.
        transform: maps the thunk's result tuple to a new one of the same form.

    Returns:
        A new ``WrappedFun`` with the same debug info; it calls ``thunk`` lazily, as JAX does.
    """

    def wrapped(*args):
        return transform(tuple(thunk.call_wrapped(*args)))

    return _lu.wrap_init(wrapped, debug_info=thunk.debug_info)


# Platforms on which the emulation may be registered when JAX has no rule there.
EMULATED_PLATFORMS = ("cpu", "tpu")
_emulated: set[str] = set()


def emulated_platforms() -> tuple[str, ...]:
    """The platforms on which the ``scaled_matmul`` primitive runs the emulation registered here."""
    return tuple(sorted(_emulated))


def scaled_matmul_primitive():
    """The ``scaled_matmul`` primitive (``multiple_results=True``; params: ``preferred_element_type``)
    that ``jax.nn.scaled_matmul`` finally lowers to."""
    return _scaled_matmul_stablehlo._scaled_matmul_p


def lowering_for_export(ctx) -> bool:
    """Whether the lowering rule context ``ctx`` lowers a program for ``jax.export``."""
    return bool(ctx.module_context.lowering_parameters.for_export)


def has_lowering(primitive, platform: str) -> bool:
    """Whether ``primitive`` has a lowering rule on ``platform`` (a platform-specific or a common one)."""
    return primitive in _mlir._platform_specific_lowerings.get(platform, {}) or primitive in _mlir._lowerings


def register_emulated_lowering(emulation: Callable, platforms=EMULATED_PLATFORMS) -> tuple[str, ...]:
    """Give the ``scaled_matmul`` primitive the lowering ``mlir.lower_fun(emulation)`` on each platform of
    ``platforms`` that JAX knows and has no rule for.

    Arguments:
        emulation: ``fn(a, b, a_scales, b_scales, *, preferred_element_type) -> [out]`` computing the
            documented math from the quantized operands.
        platforms: candidate platforms.

    Returns:
        The platforms registered by this call (empty when called again: registering is idempotent).
    """
    primitive = scaled_matmul_primitive()
    done = []
    for platform in platforms:
        if not _xb.is_known_platform(platform) or has_lowering(primitive, platform):
            continue
        mlir.register_lowering(primitive, mlir.lower_fun(emulation, multiple_results=True), platform=platform)
        _emulated.add(platform)
        done.append(platform)
    return tuple(done)


def generalize_batchers() -> tuple[str, ...]:
    """Replace the batching rules of ``scaled_matmul`` and ``scaled_matmul_wrapper`` by JAX's own rule
    applied after moving every batch axis to the front (broadcasting unbatched operands), so any operand
    may be unbatched and the batch axis may be anywhere.

    Returns:
        The names of the primitives whose rule was replaced by this call (empty when called again).
    """
    jax_rule = _scaled_matmul_stablehlo._scaled_matmul_batcher
    done = []
    for primitive in (_scaled_matmul_stablehlo._scaled_matmul_p, _scaled_matmul_stablehlo._scaled_matmul_p_wrapper):
        if getattr(batching.fancy_primitive_batchers.get(primitive), "_int8ify_general", False):
            continue

        def rule(axis_data, batched_args, batch_dims, *, _primitive=primitive, **params):
            if all(d is None for d in batch_dims):
                return _primitive.bind(*batched_args, **params), [None]
            args = [batching.bdim_at_front(a, d, axis_data.size) for a, d in zip(batched_args, batch_dims)]
            return jax_rule(args, (0,) * len(args), **params)

        rule._int8ify_general = True
        batching.fancy_primitive_batchers[primitive] = rule
        done.append(primitive.name)
    return tuple(done)
