"""Calibration: measuring the activations a program's dots meet (:func:`measure_activations`, for SmoothQuant and
static scales), static activation scales for :func:`~jaxpr_rewrite.quantize_params` (one per-tensor scale per
weight, calibrated on the activations its top-level dots quantize), and :func:`calibrate_activation_dots` (one per
operand of each top-level dot between two activations)."""

from __future__ import annotations

import functools
import numbers
import uuid
import warnings
from collections.abc import Mapping
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Var

from .._core.errors import Int8ifyError, QuantizationWarning
from .._core.scopes import join_scope
from .._core.source import describe_source
from .._dots.operands import smoothed_activation
from .._interpret.evaluate import bind, evaluate
from .._interpret.rewrite import dependents
from .._interpret.rules.dots import is_plain_dot, skip_reason
from .._interpret.weight_uses import plan_uses
from .._numerics.quantize import nan_safe_magnitude, smoothing_inverse, to_compute
from .._numerics.static_scales import smallest_static_absmax
from .._quantized.activations import ActivationScales, CalibratedDot, describe_dot, top_level_dots
from .._quantized.array import is_quantized, materialise
from .._tracing.tracing import target_of, trace

__all__ = ["calibrate_activation_dots", "calibration_batches", "calibration_tracer", "check_percentile",
           "measure_activations", "static_scales", "zero_measure"]


def check_percentile(value, option: str) -> None:
    """Raise :class:`~jaxpr_rewrite._core.errors.Int8ifyError` unless ``value`` (the ``option`` named) is a real number
    in (0, 100] (not a bool)."""
    if isinstance(value, (bool, np.bool_)) or not (isinstance(value, numbers.Real) and 0 < value <= 100):
        raise Int8ifyError(f"{option} must be a number in (0, 100], got {value!r}")


def calibration_batches(calibration, example_args: tuple, caller: str) -> list:
    """The calibration inputs as a list of argument tuples (the arguments after ``params``), one per batch.

    Arguments:
        calibration: ``None`` (then ``[example_args]``), or an iterable of argument tuples (or lists).
        example_args: the call's arguments after ``params``.
        caller: the function named in an error.

    Raises:
        Int8ifyError: ``calibration`` is an array, or not iterable, or one of its items is not a sequence of
            arguments (an array, a number, a dict): ``tuple()`` would split an array into its rows, one argument
            each, and the call then fails with a count of arguments that names neither ``calibration`` nor the
            cause. Or it holds no batch (an empty list, a generator already consumed): nothing would be
            calibrated, and the caller would quietly fall back to dynamic scales.
    """
    if calibration is None:
        return [tuple(example_args)]
    if _is_array(calibration) or not _is_iterable(calibration):
        raise _not_argument_tuples(caller, _described(calibration))
    batches = []
    for i, args in enumerate(calibration):
        if _is_array(args) or isinstance(args, Mapping) or not _is_iterable(args):
            raise _not_argument_tuples(caller, f"a {type(calibration).__name__} whose item {i} is {_described(args)}")
        batches.append(tuple(args))
    if not batches:
        raise Int8ifyError(f"{caller}: calibration holds no batch (an empty {type(calibration).__name__}, or a "
                           f"generator already consumed), so nothing could be calibrated; pass at least one argument "
                           f"tuple, or calibration=None to calibrate on the example arguments")
    return batches


def _is_array(value) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _is_iterable(value) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


def _described(value) -> str:
    if _is_array(value):
        return f"an array of shape {tuple(value.shape)} ({np.dtype(value.dtype).name})"
    return f"a {type(value).__name__}"


def _not_argument_tuples(caller: str, given: str) -> Int8ifyError:
    return Int8ifyError(f"{caller}: calibration must be a sequence of argument tuples (the arguments after params), "
                        f"one per batch, e.g. calibration=[(x1,), (x2,)], not {given}; wrap each batch's arguments "
                        f"in a tuple: calibration=[(x,) for x in batches]")


def calibration_tracer(function: Callable, signature_of: Callable, params, n_leaves: int, example_kwargs: dict,
                       caller: str) -> Callable:
    """``traced(args) -> (program, inputs, traced leaves)`` for the calls ``function(params, *args,
    **example_kwargs)``: the float program (traced once per input signature, so calibration batches of one shape
    share it), ``inputs`` mapping the index of each traced leaf of ``params`` (``n_leaves`` of them) to its
    position among the program's inputs, and the call's traced leaves."""
    programs: dict = {}

    def traced(args):
        signature, dynamic = signature_of((params, *args), example_kwargs)
        if signature not in programs:
            if 0 in {i for i, _ in signature.static_positional}:
                raise Int8ifyError(f"{caller} needs params (the first argument) to be traced, not static")
            closed = trace(function, signature, dynamic).jaxpr
            # the params' leaves come first among the call's leaves; the static ones are not program inputs
            inputs, position = {}, 0
            for i, is_dynamic in enumerate(signature.is_dynamic[:n_leaves]):
                if is_dynamic:
                    inputs[i] = position
                    position += 1
            programs[signature] = closed, inputs
        return (*programs[signature], dynamic)

    return traced


def calibrate_activation_dots(fn: Callable, params, *example_args, calibration=None,
                              percentile: float | None = None, **example_kwargs) -> ActivationScales:
    """Calibrate static scales for the matmuls between two activations of ``fn(params, *example_args)``.

    A top-level ``dot_general`` of ``fn``'s program whose two operands both depend on the arguments after
    ``params`` (attention's ``q . k`` and ``p . v``; not a dot with a weight, whose activation
    :func:`~jaxpr_rewrite.quantize_params` with ``activations="static"`` calibrates) gets one per-tensor scale per
    operand: the largest ``max|x|`` (or ``percentile`` of ``|x|``) over the ``calibration`` inputs, divided by 127.
    ``int8ify(fn, activation_scales=scales)`` then quantizes those operands with them: one multiply, a round and a
    clip, no absmax and no scale computation per call. Values beyond the calibrated range saturate at +-127; NaN
    and Inf still make every output they feed non-finite. Dots the options skip are not calibrated; dots inside a
    nested ``jit``, loop or branch keep dynamic scales.

    Arguments:
        fn: the function, plain or wrapped with :func:`~jaxpr_rewrite.int8ify` (its options and static arguments
            are used).
        params: ``fn``'s first argument (float or quantized weights: only the activations are measured).
        *example_args, **example_kwargs: the other arguments.
        calibration: an iterable of argument tuples (the arguments after ``params``, with ``example_kwargs``);
            defaults to ``[example_args]``.
        percentile: calibrate on this percentile of ``|x|`` (in (0, 100]) instead of its maximum.

    Returns:
        The :class:`~jaxpr_rewrite._quantized.activations.ActivationScales` to pass as ``int8ify``'s
        ``activation_scales``.

    Raises:
        Int8ifyError: bad options, params given as a static argument, or NaN or Inf in a calibrated activation.
    """
    function, config, signature_of = target_of(fn, "calibrate_activation_dots")
    if percentile is not None:
        check_percentile(percentile, "percentile")
    n_leaves = len(jax.tree_util.tree_leaves(params, is_leaf=is_quantized))
    traced = calibration_tracer(function, signature_of, params, n_leaves, example_kwargs, "calibrate_activation_dots")
    calibration = calibration_batches(calibration, example_args, "calibrate_activation_dots")
    measured: dict = {}
    measurers: dict = {}  # id(program) -> (its jitted measuring function, its calibrated dots, its dot count)
    dots = n_dots = None
    for args in calibration:
        closed, inputs, dynamic = traced(args)
        if id(closed) not in measurers:
            found = _activation_dots(closed.jaxpr, set(inputs.values()), config)
            targets = {id(eqn): (position, None) for position, eqn in found.items()}
            measurers[id(closed)] = (_operand_statistic(closed, targets, percentile), found,
                                     len(top_level_dots(closed.jaxpr)))
        measure, program_dots, program_n_dots = measurers[id(closed)]
        if dots is None:
            dots, n_dots = program_dots, program_n_dots
        elif (sorted(program_dots), program_n_dots) != (sorted(dots), n_dots):
            raise Int8ifyError("calibrate_activation_dots: the calibration inputs trace to programs with different "
                               "matmuls; calibrate each program on inputs of its own")
        for position, value in measure(closed.consts, dynamic).items():
            measured[position] = value if position not in measured else jnp.maximum(measured[position], value)
    calibrated, zero_calibrated = [], []
    for position, eqn in dots.items():
        absmax = tuple(float(a) for a in np.asarray(measured[position]))
        if not all(np.isfinite(absmax)):
            raise Int8ifyError(f"calibrate_activation_dots: the operands of the dot_general at {describe_source(eqn)} "
                               f"hold NaN or Inf on the calibration inputs, so no static scale can be calibrated")
        for operand, value in zip(eqn.invars[:2], absmax):
            smallest = smallest_static_absmax(operand.aval.dtype)
            if 0 < value < smallest:
                raise Int8ifyError(f"calibrate_activation_dots: an operand of the dot_general at "
                                   f"{describe_source(eqn)} measured an absmax of {value:.3g} on the calibration "
                                   f"inputs, below {smallest:.3g}, the smallest a static scale of "
                                   f"{np.dtype(operand.aval.dtype).name} values takes; calibrate on representative "
                                   f"inputs, or keep this dot's activations dynamic")
        if 0 in absmax:
            zero_calibrated.append(describe_source(eqn))
        calibrated.append(CalibratedDot(position, *describe_dot(eqn), absmax))
    if zero_calibrated:
        warnings.warn(f"calibrate_activation_dots: the dot_general(s) at {', '.join(zero_calibrated)} met an operand "
                      f"that {zero_measure(percentile, 'was')} on the calibration inputs, so its static scale is 1 "
                      f"(codes step by 1.0: values below 0.5 in magnitude quantize to 0); calibrate on "
                      f"representative inputs", QuantizationWarning, stacklevel=2)
    return ActivationScales(tuple(calibrated), n_dots)


def zero_measure(percentile: float | None, verb: str) -> str:
    """What a calibration that measured 0 met, for its warning: values all zero, or (with a ``percentile``) at least
    that share of them zero (``verb``: "was" or "were", for the subject)."""
    if percentile is None:
        return f"{verb} all zero"
    return f"had a {percentile}th percentile of |x| of 0 (at least {percentile}% of the values zero)"


def _activation_dots(jaxpr, param_inputs: set, config) -> dict:
    """``position in top_level_dots -> equation`` of the top-level dots the options rewrite whose two operands
    both depend on the program inputs that are not parameters."""
    data = dependents(jaxpr, {v for i, v in enumerate(jaxpr.invars) if i not in param_inputs})
    dots = {}
    for position, eqn in enumerate(top_level_dots(jaxpr)):
        operands = eqn.invars[:2]
        between_activations = all(isinstance(v, Var) and v in data for v in operands)
        if between_activations and skip_reason(eqn, config, join_scope("", eqn.source_info.name_stack)) is None:
            dots[position] = eqn
    return dots


def static_scales(plans, smooth, calibration, traced, config, percentile, paths, explanation) -> dict:
    """Calibrated per-tensor activation absmaxes for the planned leaves whose every matmul is a top-level
    ``dot_general``: ``leaf index -> (float32 scalar, group token)``, the largest over the calibration batches and
    the leaf's dots of ``max|x|`` (or its ``percentile``) of the activation each dot quantizes (divided by the
    leaf's smoothing factors, as the rewritten dot divides it). Leaves reading the same activation (with the same
    smoothing) share one value and token, so the program quantizes it once for all of them. Leaves with another
    use keep dynamic scales, said in ``explanation``."""
    reads: dict = {}  # leaf index -> the activations its dots read, in the example program
    measured: dict = {}
    dynamic_leaves: set = set()
    measurers: dict = {}  # id(program) -> (its jitted measuring function, the leaves it measures, why not others)
    for args in calibration:
        closed, call_inputs, dynamic = traced(args)
        if id(closed) not in measurers:
            targets, measurable, nested = {}, set(), {}
            for i in plans:
                uses, _ = plan_uses(closed.jaxpr, closed.jaxpr.invars[call_inputs[i]], config)
                top = [u for u in uses if u.jaxpr is closed.jaxpr and is_plain_dot(u.eqn)]
                if uses and len(top) == len(uses):
                    measurable.add(i)
                    targets.update({id(u.eqn): (i, u.side) for u in top})
                    reads.setdefault(i, frozenset(
                        (u.eqn.invars[1 - u.side], u.eqn.params["dimension_numbers"][0][1 - u.side]) for u in top))
                else:
                    nested[i] = _not_top_level(uses or plans[i], top)
            measurers[id(closed)] = (_activation_statistic(closed, targets, smooth, percentile), measurable, nested)
        measure, measurable, nested = measurers[id(closed)]
        for i in set(plans) - measurable - dynamic_leaves:
            dynamic_leaves.add(i)
            explanation[paths[i]] = f"quantized with dynamic activation scales: {nested[i]}"
        for i, value in measure(closed.consts, jax.tree_util.tree_leaves(dynamic)).items():
            measured[i] = value if i not in measured else jnp.maximum(measured[i], value)
    for i, value in measured.items():
        if not np.isfinite(float(value)):
            raise Int8ifyError(f"quantize_params(activations='static'): the activations met by {paths[i]}'s matmuls "
                               f"hold NaN or Inf on the calibration inputs, so no static scale can be calibrated")
        smallest = smallest_static_absmax(value.dtype)  # measured in the activations' compute dtype
        if 0 < float(value) < smallest:
            raise Int8ifyError(f"quantize_params(activations='static'): the activations met by {paths[i]}'s matmuls "
                               f"measured an absmax of {float(value):.3g} on the calibration inputs, below "
                               f"{smallest:.3g} (2**{int(np.log2(smallest))}), the smallest a static scale of "
                               f"{np.dtype(value.dtype).name} activations takes; calibrate on representative inputs, "
                               f"or keep dynamic activation scales")
    groups: dict = {}
    for i in measured:
        if i not in dynamic_leaves:
            groups.setdefault((reads[i], smooth.get(i, (None, None))[1]), []).append(i)
    token = uuid.uuid4().hex[:12]
    static = {}
    for number, group in enumerate(groups.values()):
        shared = functools.reduce(jnp.maximum, [measured[i] for i in group])
        static.update({i: (shared, f"{token}-static-{number}") for i in group})
    return static


def _not_top_level(uses, top) -> str:
    """Why a leaf with these matmul ``uses`` keeps dynamic scales: the first of them not among its ``top``-level
    ``dot_general`` s (one inside a loop, say), named by its source."""
    nested = next((u for u in uses if u not in top), uses[0])
    return f"its matmul at {describe_source(nested.eqn)} is not a top-level dot_general of the program"


def measure_activations(closed, targets: dict, statistic: Callable) -> Callable:
    """A jitted function of ``(closed.consts, flat_args)`` running the float program ``closed`` and giving, per
    target index, the elementwise maximum of ``statistic`` over the dots it targets (the calibration pass of
    SmoothQuant and of static scales). A quantized argument is materialised inside the compiled program.

    Arguments:
        closed: the float program, traced for one calibration input signature.
        targets: ``id(dot equation) -> (index, side)``: a parameter's index and side, or a dot's own index.
        statistic: ``statistic(eqn, operands, parameter index, side)``, what to measure of one dot.
    """

    def run(consts, args):
        stats: dict = {}

        def step(eqn, invals):
            target = targets.get(id(eqn))
            if target is not None:
                index, side = target
                value = statistic(eqn, invals, index, side)
                stats[index] = value if index not in stats else jnp.maximum(stats[index], value)
            return bind(eqn, invals)

        evaluate(closed.jaxpr, consts, [materialise(x) for x in args], step)
        return stats

    return jax.jit(run)


def _activation_statistic(closed, targets: dict, smooth: dict, percentile: float | None) -> Callable:
    """:func:`measure_activations` of the largest ``max|x|`` (or ``percentile`` of ``|x|``) over the activations
    each parameter's dots quantize (smoothed, for ``smooth``'s ``parameter index -> (factors, group)``)."""

    def statistic(eqn, operands, index, side):
        activation = operands[1 - side]
        if index in smooth:
            (axis,) = eqn.params["dimension_numbers"][0][1 - side]
            activation = smoothed_activation(activation, smoothing_inverse(smooth[index][0]), axis)
        return _magnitude(activation, percentile)

    return measure_activations(closed, targets, statistic)


def _operand_statistic(closed, targets: dict, percentile: float | None) -> Callable:
    """:func:`measure_activations` of ``[statistic of the lhs, statistic of the rhs]`` of each target dot."""

    def statistic(eqn, operands, index, side):
        return jnp.stack([_magnitude(x, percentile) for x in operands[:2]])

    return measure_activations(closed, targets, statistic)


def _magnitude(activation, percentile: float | None):
    """``max|x|`` (or the ``percentile`` of ``|x|``) in the activation's compute dtype (float64 for float64: in float32
    a float64 activation of 1e40 would read as Inf, one of 1e-40 as zero); Inf for an activation holding NaN or
    Inf, whatever the percentile (one below 100 would otherwise pass over them as outliers)."""
    magnitude = nan_safe_magnitude(to_compute(activation))  # XLA's CPU max drops NaN
    if magnitude.size == 0:
        return jnp.zeros((), magnitude.dtype)
    largest = jnp.max(magnitude)
    if percentile is None:
        return largest
    return jnp.where(jnp.isinf(largest), largest, jnp.percentile(magnitude, percentile))
