"""Calibration for :func:`~jaxpr_rewrite.quantize_params`: measuring the activations a weight's dots meet
(:func:`measure_activations`, for SmoothQuant and static scales), and static activation scales: one per-tensor
scale per weight, calibrated on the activations its top-level dots quantize."""

from __future__ import annotations

import functools
import uuid
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .errors import Int8ifyError
from .evaluate import bind, evaluate
from .operands import smoothed_activation
from .rules.dots import is_plain_dot
from .source import describe_source
from .weight_uses import plan_uses

__all__ = ["measure_activations", "static_scales"]


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
    measurers: dict = {}  # id(program) -> (its jitted measuring function, the leaves it measures)
    for args in calibration:
        closed, call_inputs, dynamic = traced(args)
        if id(closed) not in measurers:
            targets, measurable = {}, set()
            for i in plans:
                uses, _ = plan_uses(closed.jaxpr, closed.jaxpr.invars[call_inputs[i]], config)
                top = [u for u in uses if u.jaxpr is closed.jaxpr and is_plain_dot(u.eqn)]
                if uses and len(top) == len(uses):
                    measurable.add(i)
                    targets.update({id(u.eqn): (i, u.side) for u in top})
                    reads.setdefault(i, frozenset(
                        (u.eqn.invars[1 - u.side], u.eqn.params["dimension_numbers"][0][1 - u.side]) for u in top))
            measurers[id(closed)] = (_activation_statistic(closed, targets, smooth, percentile), measurable)
        measure, measurable = measurers[id(closed)]
        for i in set(plans) - measurable - dynamic_leaves:
            dynamic_leaves.add(i)
            explanation[paths[i]] = f"quantized with dynamic activation scales: {_not_top_level(plans[i])}"
        for i, value in measure(closed.consts, jax.tree_util.tree_leaves(dynamic)).items():
            measured[i] = value if i not in measured else jnp.maximum(measured[i], value)
    for i, value in measured.items():
        if not np.isfinite(float(value)):
            raise Int8ifyError(f"quantize_params(activations='static'): the activations met by {paths[i]}'s matmuls "
                               f"hold NaN or Inf on the calibration inputs, so no static scale can be calibrated")
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


def _not_top_level(uses) -> str:
    return f"its matmul at {describe_source(uses[0].eqn)} is not a top-level dot_general of the program"


def measure_activations(closed, targets: dict, statistic: Callable) -> Callable:
    """A jitted function of ``(closed.consts, flat_args)`` running the float program ``closed`` and giving, per
    parameter, the elementwise maximum of ``statistic(eqn, activation, index)`` over the activations its target
    dots meet (the calibration pass of SmoothQuant and of static scales).

    Arguments:
        closed: the float program, traced for one calibration input signature.
        targets: ``id(dot equation) -> (parameter index, side of the parameter)``.
        statistic: what to measure of one dot's other operand.
    """

    def run(consts, args):
        stats: dict = {}

        def step(eqn, invals):
            target = targets.get(id(eqn))
            if target is not None:
                index, side = target
                value = statistic(eqn, invals[1 - side], index, side)
                stats[index] = value if index not in stats else jnp.maximum(stats[index], value)
            return bind(eqn, invals)

        evaluate(closed.jaxpr, consts, args, step)
        return stats

    return jax.jit(run)


def _activation_statistic(closed, targets: dict, smooth: dict, percentile: float | None) -> Callable:
    """:func:`measure_activations` of the largest ``max|x|`` (or ``percentile`` of ``|x|``) over the activations
    each parameter's dots quantize (smoothed, for ``smooth``'s ``parameter index -> (factors, group)``)."""

    def statistic(eqn, activation, index, side):
        if index in smooth:
            (axis,) = eqn.params["dimension_numbers"][0][1 - side]
            activation = smoothed_activation(activation, smooth[index][0], axis)
        magnitude = jnp.abs(activation.astype(jnp.float32))
        magnitude = jnp.where(jnp.isnan(magnitude), jnp.inf, magnitude)  # XLA's CPU max drops NaN
        if magnitude.size == 0:
            return jnp.float32(0)
        return jnp.max(magnitude) if percentile is None else jnp.percentile(magnitude, percentile)

    return measure_activations(closed, targets, statistic)
