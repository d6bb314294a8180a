"""The dot rule: whether a float matmul is rewritten (:func:`skip_reason`), and how: one float ``dot_general`` /
``ragged_dot_general`` becomes the configured backend's program (the int8 contract by default), its operands
resolved first (a pre-quantized weight's codes used as they are when its scales fit; an integer operand of a mixed
dot quantized like a float one)."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..._core.backends import Backend
from ..config import RewriteConfig
from ..._core.layout import contraction_size, decided, is_static
from ..._core.errors import Int8ifyError
from ..._dots.ragged_dot import supports_ragged
from ..._core import platforms
from ..._core.jaxprs import matmul_dimension_numbers
from ..._dots.operands import smoothed_activation
from ..._quantized.array import is_quantized, materialise
from ..._core.reasons import KeptFloat, Why
from ..._core.scopes import matching_pattern
from ..._core.source import UNKNOWN, Location, describe_source
from ..._quantized.activations import ScaledActivation
from .registry import register

__all__ = ["is_plain_dot", "is_unsupported_ragged", "may_join_siblings", "resolve_dot_operands", "rewrite_dot",
           "rewrite_sibling_dots", "skip_reason"]


def _label_dot(params) -> list[str]:
    """The diff shows a dot's dimension numbers, and an integer result type."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    parts = [f"dims=(({list(lc)}, {list(rc)}), ({list(lb)}, {list(rb)}))"]
    preferred = params.get("preferred_element_type")
    if preferred is not None and not jnp.issubdtype(preferred, jnp.inexact):
        parts.append(f"preferred={np.dtype(preferred).name}")
    return parts


register("dot_general", label=_label_dot)


def is_plain_dot(eqn) -> bool:
    """Whether ``eqn`` is a ``dot_general`` (not a ragged one)."""
    return eqn.primitive.name == "dot_general"


def is_unsupported_ragged(eqn) -> bool:
    """Whether ``eqn`` is a ``ragged_dot_general`` whose layout the int8 rewrite cannot express."""
    return eqn.primitive.name == "ragged_dot_general" and not supports_ragged(eqn.params)


def skip_reason(eqn, config: RewriteConfig, scope: str) -> KeptFloat | None:
    """Why the float matmul ``eqn`` stays float under ``config``, or ``None`` when it is rewritten.

    Arguments:
        eqn: a float ``dot_general`` (or ``ragged_dot_general``) equation.
        config: the rewrite options.
        scope: the dot's full name scope (enclosing scopes included).
    """
    pattern = matching_pattern(scope, config.skip)
    if pattern is not None:
        return KeptFloat(Why.SKIP_PATTERN, f"name scope {scope!r} matches skip pattern {pattern!r}")
    if config.skip_if is not None and config.skip_if(eqn):
        return KeptFloat(Why.SKIP_IF, "skip_if returned True")
    size = _contraction_length(eqn)
    minimum = config.min_contracting_size
    small = decided(lambda: size < minimum)
    if small is None:
        raise _symbolic_contraction_error(eqn, size, f">= {minimum}",
                                          f"min_contracting_size={minimum} keeps shorter ones float")
    if small:
        return KeptFloat(Why.SMALL_CONTRACTION,
                         f"contraction of {size} < min_contracting_size={minimum}")
    return None


def _contraction_length(eqn):
    """How many products each output of the matmul ``eqn`` sums (symbolic under ``jax.export``'s shapes)."""
    (lc, _), _ = matmul_dimension_numbers(eqn)
    return contraction_size(eqn.invars[0].aval.shape, lc)


def _check_symbolic_contraction(backend: Backend, eqn, where: Location):
    """A contraction of symbolic length (``jax.export``) must be known to fit the backend's bound."""
    bound = backend.max_symbolic_contraction
    size = _contraction_length(eqn)
    if bound is not None and not is_static(size) and not decided(lambda: size <= bound):
        raise _symbolic_contraction_error(
            eqn, size, f"<= {bound}", f"backend {backend.name!r} sums int8 products exactly in int32 for at most "
            "that many, and cuts a longer contraction into chunks only when its length is known when tracing", where)


def _check_float64_off_tpu(backend: Backend, eqn, where: Location):
    """The int8 contract's backends (those that take its pre-quantized weights) take a float64 operand's scale and
    codes from its float64 bits, which a TPU does not have: XLA:TPU holds a float64 as two float32s, and its
    compiler rejects the program ("Binary op shift-right-logical with different element types"). Refused when the
    program is traced for a TPU (:func:`~jaxpr_rewrite._core.platforms.targeted`: the default device's platform,
    unless ``jax.default_device`` or the ``platforms`` option says otherwise), with what to do instead."""
    if not (backend.takes_prequantized and "tpu" in platforms.targeted()):
        return
    if any(v.aval.dtype == np.float64 for v in eqn.invars[:2]):
        raise Int8ifyError(
            f"{eqn.primitive.name} at {describe_source(eqn, where)} has float64 operands ({_operand_types(eqn)}) "
            "on a TPU, which has no IEEE float64 for the int8 contract's float64 scales: cast the operands to float32 "
            "(a float64 result, preferred_element_type=float64, still works), or run the program on CPU or a GPU")


def _symbolic_contraction_error(eqn, size, bound: str, why: str, where: Location = UNKNOWN) -> Int8ifyError:
    """The error for a dot whose symbolic contraction length leaves a decision open (``jax.export``)."""
    return Int8ifyError(
        f"{eqn.primitive.name} at {describe_source(eqn, where)} ({_operand_types(eqn)}) contracts over {size} "
        f"products, a symbolic length that must be known to be {bound}: {why}. State the bound when exporting, e.g. "
        f'jax.export.symbolic_shape(..., constraints=("{size} {bound}",)), or keep the dot float with skip/skip_if'
    )


def resolve_dot_operands(invals: Sequence, dimension_numbers, direct: bool, shared: dict | None,
                         block_size: int | None = None) -> list:
    """The operands a dot's program gets, from its operand values (how a pre-quantized weight enters a dot).

    A :class:`QuantizedArray` whose scales fit the dot (per-channel int8, ``direct``, same contraction) goes on as its
    :meth:`~QuantizedArray.dot_operand` (int8 codes, 4-bit ones unpacked): its codes feed the int8 dot. One contracted
    along its scales whose scales fold into a float other operand (a KV cache's values,
    :meth:`~QuantizedArray.folds_into_partner`) goes on as it is. Any other is materialised. A usable smoothed weight
    stands for ``smooth * w``, so the other operand is multiplied by ``1 / smooth`` first. Every usable weight of one
    static-scale ``activation_group`` goes on with the group's first weight's activation scale (the same arrays), so
    each of their dots quantizes the activation identically in its own program and XLA's common-subexpression
    elimination keeps one quantization. Quantizing it here, outside the dots, instead put the check of its codes for NaN
    before the first dot in XLA:CPU's order of kernels, and its runtime then ran both on one thread: the Flax MLP with
    static scales took 10-12% longer (these dots' programs are inlined early,
    :func:`~jaxpr_rewrite._core.compile_policy.shared_jit`).

    Arguments:
        invals: the dot's two operand values.
        dimension_numbers: the dot's ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``.
        direct: whether the rewrite uses the per-channel int8 contract (pre-quantized codes fit only that).
        shared: a per-program cache ``(id(activation), axes, group) -> (activation, its rescaling or its static
            scale)`` shared by the weights of one smoothing or static-scale group, or ``None``.
        block_size: the block length of the dot (``int8ify(..., block_size=...)`` with int8), or ``None``: a
            block-scaled weight goes on as itself (the dot reads its :meth:`~QuantizedArray.block_operand`) when the
            dot contracts its axes in their order; a block-scaled weight here is of that length
            (:func:`_check_weights_fit` let it through).
    """
    contractions, batches = dimension_numbers
    folds = [direct and is_quantized(x) and not is_quantized(other) and x.dot_operand(contract) is None
             and x.folds_into_partner(contract, batch)
             for x, other, contract, batch in zip(invals, invals[::-1], contractions, batches)]
    usable = [
        # a block-scaled weight fits a dot contracting its axes in their own order, which its blocks run over
        is_quantized(x) and (tuple(int(a) % x.ndim for a in contract) == x.contracting if x.block_size is not None
                             else (direct and x.dot_operand(contract) is not None) or fold)
        for x, contract, fold in zip(invals, contractions, folds)
    ]
    for side, x in enumerate(invals):
        if usable[side] and x.smooth is not None and is_quantized(invals[1 - side]):
            usable[side] = False  # two weights: the smoothing cannot move into the other one
    operands = [
        (x if x.block_size is not None else x.unpacked() if fold else x.dot_operand(contract)) if use
        else materialise(x)
        for x, use, contract, fold in zip(invals, usable, contractions, folds)
    ]
    for side in (0, 1):
        weight = invals[side]
        if not usable[side] or weight.smooth is None:
            continue
        (other_axis,) = contractions[1 - side]
        other = operands[1 - side]
        key = (id(other), other_axis, weight.smooth_group)
        shareable = weight.smooth_group is not None and shared is not None
        if shareable and key in shared:
            operands[1 - side] = shared[key][1]
            continue
        operands[1 - side] = smoothed_activation(other, weight.smoothing_multiplier(), other_axis)
        if shareable:
            shared[key] = (other, operands[1 - side])  # holds `other`, so no other value reuses its id
    for side in (0, 1):
        weight, other = operands[side], operands[1 - side]
        if not usable[side] or weight.activation_group is None or shared is None or is_quantized(other):
            continue
        key = (id(other), tuple(contractions[1 - side]), weight.activation_group)
        if key not in shared:
            shared[key] = (other, weight.activation_scale)  # holds `other`, so no other value reuses its id
        operands[side] = weight.replace(activation_scale=shared[key][1])
    return operands


def rewrite_dot(config: RewriteConfig, backend: Backend, eqn, invals, where: Location = UNKNOWN,
                smoothed: dict | None = None, static_scales=None):
    """The rewritten program for one float ``dot_general`` / ``ragged_dot_general`` equation.

    Arguments:
        config: the rewrite options.
        backend: what the dot becomes.
        eqn: the equation.
        invals: its operand values; a :class:`~jaxpr_rewrite.quantized.QuantizedArray` is a pre-quantized
            weight, used directly when its scales fit the contraction.
        where: the user's source, for errors about equations JAX recorded none for.
        smoothed: a per-program cache of activations rescaled by a smoothing group's factors, so weights of
            one group reading the same activation share that rescaling (and XLA then its quantization).
        static_scales: ``None``, or the stored static scales of the two operands (a calibrated dot of two
            activations, :class:`~jaxpr_rewrite._quantized.activations.ActivationScales`): each operand goes on as a
            :class:`~jaxpr_rewrite._quantized.activations.ScaledActivation`.

    Returns:
        The dot's result.

    Raises:
        Int8ifyError: complex operands, a ragged dot the backend or the layout rules out, or a contraction of
            symbolic length not known to fit the backend.
    """
    for v in eqn.invars[:2]:
        if jnp.issubdtype(v.aval.dtype, jnp.complexfloating):
            raise Int8ifyError(
                f"{eqn.primitive.name} at {describe_source(eqn, where)} has complex operands "
                f"({_operand_types(eqn)}); the int8 contract is defined for real floating matmuls only"
            )
    _check_symbolic_contraction(backend, eqn, where)
    _check_float64_off_tpu(backend, eqn, where)
    float_params = tuple(sorted(eqn.params.items()))
    out_dtype = eqn.outvars[0].aval.dtype
    ragged = not is_plain_dot(eqn)
    if ragged:
        _check_ragged(backend, eqn, where)
    lhs, rhs = _resolved_operands(config, eqn, invals, where, smoothed)
    # an integer operand of a mixed dot is quantized like a float one
    lhs, rhs = (
        x if is_quantized(x) or jnp.issubdtype(v.aval.dtype, jnp.floating) else lax.convert_element_type(x, np.float32)
        for x, v in zip((lhs, rhs), eqn.invars)
    )
    if ragged:
        return backend.ragged_dot(lhs, rhs, invals[2], float_params, out_dtype, config)
    if static_scales is not None and not (is_quantized(lhs) or is_quantized(rhs)):
        lhs, rhs = (ScaledActivation(x, scale) for x, scale in zip((lhs, rhs), static_scales))

    def program(lhs, rhs):
        return backend.dot(lhs, rhs, float_params, out_dtype, config)

    out_sharding = _explicit_sharding(eqn)
    if out_sharding is not None:
        # Under explicit sharding every intermediate would need its sharding spelled out; the int8 program
        # runs with the mesh axes automatic inside and delivers the float dot's output sharding.
        program = jax.sharding.auto_axes(program, axes=out_sharding.mesh.explicit_axes, out_sharding=out_sharding)
    return program(lhs, rhs)


def may_join_siblings(eqn) -> bool:
    """Whether the float matmul ``eqn`` may share one program with sibling dots of its left operand (a backend's
    :class:`~jaxpr_rewrite._core.backends.SiblingDots`): a ``dot_general`` whose operands live on no mesh with explicit
    axes (such a dot's program runs under its own ``auto_axes``)."""
    return is_plain_dot(eqn) and _explicit_sharding(eqn) is None


def rewrite_sibling_dots(config: RewriteConfig, backend: Backend, eqns, invals, where: Location = UNKNOWN,
                         smoothed: dict | None = None) -> dict:
    """One program for the sibling dots among ``eqns`` that the backend's
    :class:`~jaxpr_rewrite._core.backends.SiblingDots` rule fits: float ``dot_general`` s of one left operand (after its
    resolution: a smoothing group's dots share one rescaled activation), computed at the first equation.

    Arguments:
        config: the rewrite options.
        backend: what the dots become (its ``sibling_dots`` set).
        eqns: the equations, in program order, each one :func:`may_join_siblings` lets join.
        invals: each equation's operand values.
        where: the user's source of the enclosing equation, for errors about equations JAX recorded none for.
        smoothed: as :func:`rewrite_dot`'s.

    Returns:
        ``id(equation) -> its result`` for the dots computed together (two or more per activation); the others
        are rewritten one by one.
    """
    by_activation: dict = {}
    for eqn, values in zip(eqns, invals):
        _check_float64_off_tpu(backend, eqn, where)
        lhs, rhs = _resolved_operands(config, eqn, values, where, smoothed)
        dot = (eqn, rhs, tuple(sorted(eqn.params.items())), eqn.outvars[0].aval.dtype)
        if backend.sibling_dots.fits(lhs, rhs, *dot[2:], config):  # (one program contracts lhs one way)
            lhs_contracting = tuple(matmul_dimension_numbers(eqn)[0][0])
            by_activation.setdefault((id(lhs), lhs_contracting), (lhs, []))[1].append(dot)
    results = {}
    for lhs, dots in by_activation.values():
        if len(dots) > 1:
            joined, rhss, params, out_dtypes = zip(*dots)
            outs = backend.sibling_dots.program(lhs, rhss, params, out_dtypes, config)
            results.update((id(eqn), out) for eqn, out in zip(joined, outs))
    return results


def _resolved_operands(config: RewriteConfig, eqn, invals, where: Location, smoothed: dict | None) -> list:
    """The two operands the dot ``eqn``'s program gets (:func:`resolve_dot_operands`), once its pre-quantized
    weights are checked to fit its options."""
    _check_weights_fit(invals[:2], config, eqn, where)
    return resolve_dot_operands(invals[:2], matmul_dimension_numbers(eqn), config.uses_per_channel_int8,
                                smoothed, config.int8_block_size)


def _check_weights_fit(invals: Sequence, config: RewriteConfig, eqn, where: Location):
    """A pre-quantized weight fits only the dots its options make: a block-scaled one those of its block length, a
    per-channel int8 one those of that contract (re-quantizing its dequantized values under other options would be
    neither its contract nor what those options give the float weight)."""
    block_size = config.int8_block_size
    for x in invals:
        if is_quantized(x) and x.block_size is not None and x.block_size != block_size:
            dot = f"block_size={block_size}" if block_size is not None else "no block_size"
            raise Int8ifyError(f"a weight quantized with block_size={x.block_size} ({x!r}) meets a dot with {dot}; "
                               f"quantize it with the same int8ify options the program runs with "
                               f"(quantize_params(int8ify(fn, block_size=...), ...))")
        if is_quantized(x) and x.block_size is None and not config.uses_per_channel_int8:
            instead = ("quantize it with the same options, quantize_params(int8ify(fn, block_size=...), ...)"
                       if block_size is not None else "pass the float weight, which they quantize")
            raise Int8ifyError(
                f"{eqn.primitive.name} at {describe_source(eqn, where)} gets a weight quantized per channel in int8 "
                f"({x!r}), but the options quantize its dots otherwise ({config.describe_quantization()}); "
                f"{instead}")


def _check_ragged(backend: Backend, eqn, where: Location):
    if not supports_ragged(eqn.params) or backend.ragged_dot is None:
        what = (f"backend {backend.name!r} has no ragged_dot_general rule" if supports_ragged(eqn.params)
                else "only a ragged non-contracting lhs dim with a group dim in the rhs is supported")
        raise Int8ifyError(
            f"ragged_dot_general at {describe_source(eqn, where)} ({_operand_types(eqn)}) cannot be rewritten: "
            f"{what}. Keep it float with skip/skip_if."
        )


def _explicit_sharding(eqn):
    """The output sharding of a matmul whose operands or result live on a mesh with explicit axes, else None."""
    for v in (*eqn.invars[:2], *eqn.outvars):
        mesh = getattr(getattr(v.aval, "sharding", None), "mesh", None)
        if getattr(mesh, "explicit_axes", ()):
            return eqn.outvars[0].aval.sharding
    return None


def _operand_types(eqn) -> str:
    return ", ".join(v.aval.str_short() for v in eqn.invars[:2])
