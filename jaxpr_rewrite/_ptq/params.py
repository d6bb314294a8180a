"""Weights quantized once: :func:`quantize_params`.

``quantize_params(fn, params, *example_args)`` follows every parameter leaf through ``fn``'s traced program and
quantizes, once, each leaf whose every use is as an operand of a rewritten matmul with one contraction: directly,
after a float cast (``flax`` layers with ``dtype=bfloat16``), inside a nested ``jit``, ``remat``, ``cond``,
``custom_jvp``, ``custom_vjp`` or ``shard_map``, as a constant of a ``while_loop`` or ``scan`` (decode loops), or as
the sliced ``xs`` of a ``scan`` over stacked layers.
It returns the same pytree with those leaves replaced by
:class:`~jaxpr_rewrite.quantized.QuantizedArray` (int8 codes + float32 scales, about 4x smaller than float32);
``int8ify(fn)(qparams, *args)`` then feeds the codes straight into the int8 dots, inside the loops too, and computes
the same numbers as the dynamic path, bit for bit. A leaf left float is never silent: ``explain=True`` returns the
reason for every leaf, and a leaf that feeds a matmul but stays float is named in a warning.

With ``smooth_alpha`` it also moves activation outliers into the weights (SmoothQuant, Xiao et al. 2023): per
contracting index ``k`` a factor ``s_k = max|x_k|**alpha / max|w_k|**(1 - alpha)`` from calibration inputs; the
weight is stored as ``s * w`` and the rewritten dot divides the activation by ``s`` before quantizing it.
``(x / s) @ (s * w) == x @ w`` in exact arithmetic, so the float function is unchanged, while a channel that is
large in every token no longer dictates every token's scale.
"""

from __future__ import annotations

import functools
import numbers
import uuid
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._interpret.config import RewriteConfig
from .._core.errors import Int8ifyError, QuantizationWarning
from .calibration import (calibration_batches, calibration_tracer, check_percentile, measure_activations,
                          static_scales, zero_measure)
from .._numerics.quantize import (absmax as nan_safe_absmax, compute_dtype, epilogue_factors, smoothing_inverse,
                                  to_compute)
from .._numerics.static_scales import StaticScale
from .._dots.operands import quantize
from .._quantized.array import CODE_LIMITS, QuantizedArray, is_quantized
from .._interpret.rules.dots import is_plain_dot
from .._core.scopes import matching_pattern
from .._tracing.tracing import target_of
from .._interpret.weight_uses import Use, plan_uses

__all__ = ["ACTIVATION_MODES", "QuantizationWarning", "quantize_params", "smoothing_factors", "weight_absmax"]

ACTIVATION_MODES = ("dynamic", "static")


def quantizable_uses(jaxpr, var, config: RewriteConfig) -> list[Use]:
    """The matmul uses of the program input ``var`` when :func:`quantize_params` would quantize it under ``config``
    (the weights an eager call of ``int8ify`` quantizes once), ``[]`` when it stays float."""
    if not config.uses_per_channel_int8:
        return []
    uses, _ = plan_uses(jaxpr, var, config)
    return uses


def quantized_weight(value, uses: list[Use]) -> QuantizedArray:
    """``value`` quantized for its matmul ``uses`` (from :func:`quantizable_uses`): after its casts, over their
    contracting axes, with its epilogue factors; the codes and scales the rewritten dots would compute from it."""
    use = uses[0]
    cast = functools.reduce(lambda v, dtype: v.astype(dtype), use.casts, value)
    return _quantize_weight(cast, tuple(a + value.ndim for a in use.from_end), 8, None).replace(
        dtype=np.dtype(value.dtype), value=value if use.keeps_value else None)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_weight(value, axes: tuple, bits: int, block_size: int | None) -> QuantizedArray:
    """:func:`~jaxpr_rewrite._dots.operands.quantize` with the scales' epilogue factors, in one compiled pass (block
    scales are regrouped per dot, so they keep none)."""
    q = quantize(value, axes, bits, block_size)
    if block_size is not None:
        return q
    factor, power = epilogue_factors(q.scales, q.exponents)
    return q.replace(epilogue_factor=factor, epilogue_power=power)


# -- SmoothQuant -------------------------------------------------------------------------------------------------
def weight_absmax(weight, contracting: int):
    """``max|w_k|`` per index ``k`` of the contracting axis, in the weight's compute dtype (float64 for float64, whose
    magnitudes float32 would read as Inf or zero; float32 otherwise); Inf where ``w_k`` holds NaN or Inf."""
    w = to_compute(jnp.asarray(weight))
    return nan_safe_absmax(w, tuple(a for a in range(w.ndim) if a != contracting))


def smoothing_factors(activation_absmax, weight_absmax, alpha: float):
    """SmoothQuant factors ``max|x_k|**alpha / max|w_k|**(1 - alpha)`` per contracting index ``k``.

    Arguments:
        activation_absmax: absmax of the activations per contracting index (from calibration).
        weight_absmax: absmax of the weight(s) per contracting index (see :func:`weight_absmax`).
        alpha: how much of the outliers moves into the weight (0: none, 1: all).

    Returns:
        Factors in the weight absmax's compute dtype (float32, or float64 for a float64 weight), the float64 value
        rounded once; 1 where either side is all zero or not finite, and where the factor is not a normal float of
        that dtype (its reciprocal, which the activation is multiplied by, would be). Computed with numpy on the host:
        a device's float32 ``pow`` and division differ by platform (a GPU's division is approximate), and the factors
        are stored with the weights, so a checkpoint would depend on where it was quantized.
    """
    dtype = compute_dtype(np.asarray(weight_absmax).dtype)
    a = np.asarray(activation_absmax).astype(dtype).astype(np.float64)
    b = np.asarray(weight_absmax).astype(dtype).astype(np.float64)
    usable = (a > 0) & (b > 0) & np.isfinite(a) & np.isfinite(b)
    tiny, largest = np.finfo(dtype).tiny, np.finfo(dtype).max
    with np.errstate(over="ignore", divide="ignore"):  # out-of-range factors are replaced by 1 just below
        factors = (np.power(np.where(usable, a, 1.0), alpha) / np.power(np.where(usable, b, 1.0), 1 - alpha)).astype(
            dtype)
        usable &= (factors >= tiny) & (factors <= largest) & (1 / factors.astype(np.float64) >= tiny)
    return jnp.asarray(np.where(usable, factors, dtype.type(1)))


def _activation_absmax(closed, targets: dict) -> Callable:
    """:func:`~jaxpr_rewrite._ptq.calibration.measure_activations` of each parameter's activations' absmax per
    contracting index (what SmoothQuant's factors are made from)."""

    def statistic(eqn, operands, index, side):
        activation = to_compute(operands[1 - side])
        (contract,) = eqn.params["dimension_numbers"][0][1 - side]
        return nan_safe_absmax(activation, tuple(a for a in range(activation.ndim) if a != contract))

    return measure_activations(closed, targets, statistic)


# -- entry point ------------------------------------------------------------------------------------------------
def quantize_params(fn: Callable, params, *example_args, smooth_alpha: float | None = None, calibration=None,
                    smooth_skip=(), activations: str = "dynamic", activation_percentile: float | None = None,
                    explain: bool = False, bits: int = 8, **example_kwargs):
    """Quantize, once, the leaves of ``params`` that ``int8ify(fn)`` would quantize on every call.

    A leaf is quantized when every use of it in ``fn(params, *example_args)`` is as an operand of a matmul that
    the rewrite replaces, all with the same contracting axes, reached directly or through float casts, nested
    ``jit``/``remat``/``cond``, the constants of ``while_loop``/``scan`` or the ``xs`` of a ``scan``. Any other
    leaf stays as it is, and the rewrite keeps quantizing it per call, so the numbers never change.

    Arguments:
        fn: the function, plain or already wrapped with :func:`~jaxpr_rewrite.int8ify` (its options and static
            arguments are then used: a matmul the options skip does not get quantized weights).
        params: a pytree, ``fn``'s first argument.
        *example_args, **example_kwargs: the other arguments (only their shapes and dtypes matter, unless they are
            the calibration input).
        smooth_alpha: if set (0 to 1, 0.5 is the usual choice), weights with one contracting axis that feed
            top-level dots also get SmoothQuant factors from the activations they meet on the calibration inputs.
            The numbers then differ from the dynamic path (that is the point: a smaller int8 error where
            activations have outlier channels); without it they are bit-identical.
        calibration: an iterable of argument tuples (the arguments after ``params``, with ``example_kwargs``) to
            measure activations on; defaults to ``[example_args]``.
        smooth_skip: name-scope patterns (``fnmatch``, as ``int8ify(skip=...)``); weights of dots whose scope
            matches one are quantized without smoothing.
        activations: ``"dynamic"`` (the contract: each call measures its activations' per-row scales) or
            ``"static"``: weights whose every matmul is a top-level ``dot_general`` of ``fn``'s program also store
            one per-tensor scale for the activations those dots meet, calibrated on ``calibration`` (after
            smoothing); the rewritten dot then quantizes the activation with it (one multiply, round, clip; no
            absmax, no scale computation). Activations beyond the calibrated range saturate at +-127; NaN and Inf
            still make the outputs they feed non-finite.
        activation_percentile: with ``activations="static"``, calibrate on this percentile of ``|x|`` (e.g.
            ``99.99``, the largest over the calibration batches) instead of its maximum: the rare outliers then
            saturate, and every other value gets a finer scale.
        explain: also return, per leaf (by its ``jax.tree_util.keystr`` path), what was done and why.
        bits: 8, or 4 for W4A8 (codes in ``[-7, 7]`` packed two per byte, scales ``absmax / 7``, per channel; the
            dots unpack them to int8 and run the same int8 x int8 -> int32 dot). 4-bit weights differ from the
            dynamic path by the coarser codes; 8-bit ones are bit-identical to it.

    Returns:
        ``params`` with the quantizable leaves replaced by :class:`~jaxpr_rewrite.quantized.QuantizedArray`; with
        ``explain=True``, ``(qparams, explanation)``.

    Warns:
        QuantizationWarning: when a leaf that feeds a rewritten matmul stays float (``explain=True`` instead
            returns every leaf's reason and does not warn).
    """
    function, config, signature_of = target_of(fn, "quantize_params")
    paths_and_leaves, tree = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)
    paths = [jax.tree_util.keystr(path) for path, _ in paths_and_leaves]
    leaves = [leaf for _, leaf in paths_and_leaves]
    if any(is_quantized(x) for x in leaves):
        raise Int8ifyError("quantize_params got params that are already quantized")
    if bits not in CODE_LIMITS:
        raise Int8ifyError(f"quantize_params: bits must be one of {sorted(CODE_LIMITS)}, got {bits!r}")
    if smooth_alpha is not None:
        # any real number (numpy scalars too), but not a bool: smooth_alpha=True is a mistake, not 1.0
        if not isinstance(smooth_alpha, numbers.Real) or isinstance(smooth_alpha, (bool, np.bool_)) or not (
                0 <= smooth_alpha <= 1):
            raise Int8ifyError(f"smooth_alpha must be in [0, 1] (a real number), got {smooth_alpha!r}")
        smooth_alpha = float(smooth_alpha)
    if activations not in ACTIVATION_MODES:
        raise Int8ifyError(f"activations must be one of {ACTIVATION_MODES}, got {activations!r}")
    if activation_percentile is not None:
        if activations != "static":
            raise Int8ifyError("activation_percentile calibrates static activation scales: pass activations='static'")
        check_percentile(activation_percentile, "activation_percentile")

    calibration = calibration_batches(calibration, example_args, "quantize_params")
    traced = calibration_tracer(function, signature_of, params, len(leaves), example_kwargs, "quantize_params")

    example, inputs, _ = traced(example_args)
    jaxpr = example.jaxpr
    plans, explanation = {}, {}
    for i, path in enumerate(paths):
        if i not in inputs:
            explanation[path] = "static (not an array)"
            continue
        uses, reason = plan_uses(jaxpr, jaxpr.invars[inputs[i]], config)
        if not (config.uses_per_channel_int8 or config.int8_block_size is not None) and uses:
            uses, reason = [], "kept float: the options do not use per-channel int8 scales"
        if uses:
            plans[i] = uses
        else:
            explanation[path] = reason

    smooth = {}
    if smooth_alpha is not None:
        smooth = _smoothing(plans, leaves, smooth_alpha, smooth_skip, calibration, traced, paths)
    static: dict = {}
    if activations == "static":
        static = static_scales(plans, smooth, calibration, traced, config, activation_percentile, paths, explanation)

    new_leaves = []
    zero_calibrated = []  # static scales measured on activations that were all zero: scale 1
    for i, leaf in enumerate(leaves):
        if i not in plans:
            new_leaves.append(leaf)
            continue
        use = plans[i][0]
        value = jnp.asarray(leaf)
        factors, group = smooth.get(i, (None, None))
        quantized_value = functools.reduce(lambda v, dtype: v.astype(dtype), use.casts, value)
        if factors is not None:  # smooth * w in the weight's compute dtype (float32 would overflow a float64 weight)
            axis = use.from_end[0] + value.ndim
            computed = to_compute(quantized_value)
            scaled = computed * lax.broadcast_in_dim(factors.astype(computed.dtype), value.shape, (axis,))
            quantized_value = scaled.astype(quantized_value.dtype)
        # one fused, compiled pass per weight (its only temporary is its output), waited for, so one weight's
        # temporaries are alive at a time: eager, every op's float intermediate is materialised, and dispatched
        # asynchronously every layer's could be queued at once, so the peak would grow with the model
        axes = tuple(a + value.ndim for a in use.from_end)
        q = jax.block_until_ready(_quantize_weight(quantized_value, axes, bits, config.int8_block_size))
        absmax, activation_group = static.get(i, (None, None))
        activation_scale = None if absmax is None else StaticScale.of(absmax).stored()
        if absmax is not None and float(absmax) == 0:
            zero_calibrated.append(paths[i])
        inverse = None if factors is None else smoothing_inverse(factors)
        new_leaves.append(q.replace(dtype=np.dtype(value.dtype), smooth=factors, smooth_inverse=inverse,
                                    smooth_group=group, activation_scale=activation_scale,
                                    activation_group=activation_group, value=value if use.keeps_value else None))
        casts = ", ".join(d.name for d in use.casts)
        cast = f" after {'a cast' if len(use.casts) == 1 else 'casts'} to {casts}" if use.casts else ""
        smoothing = " with SmoothQuant factors" if factors is not None else ""
        scaled = " and a static activation scale" if i in static else ""
        width = " to 4 bits" if bits == 4 else ""
        width += f" in blocks of {config.int8_block_size}" if config.int8_block_size is not None else ""
        kept = "; its float values kept for its lookups" if use.keeps_value else ""
        explanation.setdefault(paths[i], f"quantized{width}: {len(plans[i])} matmul use(s), contracting axes "
                                         f"{q.contracting}{cast}{smoothing}{scaled}{kept}")

    if not explain:
        surprising = {p: r for p, r in explanation.items() if r.startswith("kept float") and "feeds no matmul" not in r}
        if surprising:
            lines = "; ".join(f"{p}: {r.removeprefix('kept float: ')}" for p, r in surprising.items())
            warnings.warn(f"quantize_params left {len(surprising)} parameter(s) that feed a matmul in float "
                          f"(int8ify quantizes them on every call instead): {lines}", QuantizationWarning,
                          stacklevel=2)
    if zero_calibrated:
        warnings.warn(f"quantize_params(activations='static'): the activations met by {', '.join(zero_calibrated)}'s "
                      f"matmuls {zero_measure(activation_percentile, 'were')} on the calibration inputs, so their "
                      f"static scale is 1 (codes step by 1.0: activations below 0.5 in magnitude quantize to 0); "
                      f"calibrate on representative inputs", QuantizationWarning, stacklevel=2)
    qparams = jax.tree_util.tree_unflatten(tree, new_leaves)
    return (qparams, {p: explanation[p] for p in paths}) if explain else qparams


def _smoothing(plans, leaves, alpha, smooth_skip, calibration, traced, paths) -> dict:
    """SmoothQuant factors for the planned leaves with one contracting axis and only top-level dot uses:
    ``leaf index -> (factors, group token)``; weights reading one activation share one factor vector.

    Raises:
        Int8ifyError: the activations a leaf's matmuls meet hold NaN or Inf on the calibration inputs: the
            factors of those channels could not be measured (they would quietly be 1, no smoothing).
    """
    patterns = (smooth_skip,) if isinstance(smooth_skip, str) else tuple(smooth_skip)
    single = {}
    for i, uses in plans.items():
        scopes = [str(u.eqn.source_info.name_stack) for u in uses]
        if any(matching_pattern(scope, patterns) is not None for scope in scopes):
            continue
        if len(uses[0].from_end) == 1 and all(u.direct and not u.casts for u in uses):
            single[i] = uses
    absmax: dict = {}
    measurers: dict = {}  # id(program) -> its jitted measuring function, compiled once per input signature
    for args in calibration:
        closed, call_inputs, dynamic = traced(args)
        if id(closed) not in measurers:
            targets = {}
            for i in single:
                for eqn in closed.jaxpr.eqns:
                    positions = [k for k, v in enumerate(eqn.invars[:2])
                                 if v is closed.jaxpr.invars[call_inputs[i]]]
                    if is_plain_dot(eqn) and positions:
                        targets[id(eqn)] = (i, positions[0])
            measurers[id(closed)] = _activation_absmax(closed, targets)
        measured = measurers[id(closed)](closed.consts, jax.tree_util.tree_leaves(dynamic))
        for i, value in measured.items():
            absmax[i] = value if i not in absmax else jnp.maximum(absmax[i], value)
    for i, value in absmax.items():
        if not np.isfinite(np.asarray(value)).all():
            raise Int8ifyError(f"quantize_params(smooth_alpha=...): the activations met by {paths[i]}'s matmuls hold "
                               f"NaN or Inf on the calibration inputs, so no SmoothQuant factors can be calibrated")
    # weights reading the same activation (same variable, same axis) share one factor vector, taken from the
    # largest of their weights, so the program divides and quantizes that activation once for all of them
    groups: dict = {}
    for i, uses in single.items():
        reads = frozenset((u.eqn.invars[1 - u.side], u.eqn.params["dimension_numbers"][0][1 - u.side]) for u in uses)
        groups.setdefault(reads, []).append(i)
    token = uuid.uuid4().hex[:12]
    smooth = {}
    for number, group in enumerate(groups.values()):
        if not all(i in absmax for i in group):
            continue
        w_absmax = functools.reduce(jnp.maximum, [
            weight_absmax(leaves[i], single[i][0].from_end[0] + np.ndim(leaves[i])) for i in group
        ])
        factors = smoothing_factors(absmax[group[0]], w_absmax, alpha)
        smooth.update({i: (factors, f"{token}-{number}") for i in group})
    return smooth
