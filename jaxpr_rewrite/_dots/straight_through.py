"""Straight-through gradients: a quantized matmul whose JVP is the float matmul's, evaluated at the float operands,
compiled once per operand types and shared by every matmul of those types."""

from __future__ import annotations

from typing import Callable

import jax
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.extend import source_info_util

from .. import _compat
from .._core.compile_policy import shared_jit
from .._quantized.array import is_quantized
from .._quantized.activations import ScaledActivation

__all__ = ["straight_through", "straight_through_group"]


def _dot_general_float(lhs, rhs, **params):
    return lax.dot_general_p.bind(lhs, rhs, **params)


def _float_value(operand, like):
    """The float value of an operand for the JVP's float dots: a pre-quantized weight's value inside the dot, a
    statically scaled activation's value."""
    if isinstance(operand, ScaledActivation):
        return operand.value
    if not is_quantized(operand):
        return operand
    value = operand.dot_value()
    return value if value.dtype == like.dtype else lax.convert_element_type(value, like.dtype)


def _has_tangent(primal, tangent) -> bool:
    # Pre-quantized operands are constants of the program: no tangent flows through their codes.
    return not is_quantized(primal) and type(tangent) is not SymbolicZero


def straight_through(impl, float_matmul=_dot_general_float, n_extra: int = 0,
                     early_when: Callable[..., bool] | None = None):
    """Wrap a quantized matmul into a function with a straight-through gradient.

    Arguments:
        impl: ``impl(lhs, rhs, *extra, float_params, out_dtype, option)``, the quantized program for one matmul
            (``option``: a hashable description of the scheme or format).
        float_matmul: ``float_matmul(lhs, rhs, *extra, **params)``, the float matmul whose JVP the rewritten one
            takes (``dot_general`` or ``ragged_dot_general`` with the original params).
        n_extra: non-differentiable array operands after ``lhs, rhs`` (``group_sizes`` of a ragged dot).
        early_when: ``None``, or a predicate of ``impl``'s arguments picking the calls that keep XLA's early
            inlining (:func:`shared_jit`).

    Returns:
        ``fn(lhs, rhs, *extra, float_params, out_dtype, option)``: a ``jax.custom_jvp`` function under
        ``jax.jit`` (see :func:`shared_jit`: on CPU, XLA inlines its calls late where JAX 0.11+ can say so). Its JVP
        is the float matmul's, evaluated at the float operands (pre-quantized operands: at their value inside
        the dot), so ``grad`` sees the float matmul while the forward pass stays quantized. The
        ``jit`` makes each rewritten matmul one ``pjit`` equation (at the user's source line) whose body is traced
        once per operand types and shared by every matmul of those types, so rewriting a deep model costs about
        one trace per distinct layer shape, not one per layer.
    """
    static = tuple(range(2 + n_extra, 5 + n_extra))

    def matmul(*args):
        return impl(*args)

    matmul.__name__ = matmul.__qualname__ = impl.__name__.removesuffix("_impl")
    matmul = jax.custom_jvp(matmul, nondiff_argnums=static)

    def straight_through_jvp(float_params, out_dtype, option, primals, tangents):
        lhs, rhs, *extra = primals
        out = matmul(lhs, rhs, *extra, float_params, out_dtype, option)
        return out, _tangent(float_matmul, out, primals, tangents, float_params)

    matmul.defjvp(straight_through_jvp, symbolic_zeros=True)
    return _shared(matmul, static, early_when)


def straight_through_group(impl, early_when: Callable[..., bool] | None = None):
    """:func:`straight_through` for one program computing several ``dot_general`` s of one left operand (sibling
    dots, such as attention's query, key and value projections).

    Arguments:
        impl: ``impl(lhs, rhss, float_params, out_dtypes, option)`` returning one result per right operand in
            ``rhss`` (``float_params`` and ``out_dtypes``: one per dot).
        early_when: as :func:`straight_through`'s, a predicate of ``impl``'s arguments.

    Returns:
        ``fn(lhs, rhss, float_params, out_dtypes, option)``: each result's JVP that of its own float dot.
    """
    static = (2, 3, 4)

    def matmuls(*args):
        return impl(*args)

    matmuls.__name__ = matmuls.__qualname__ = impl.__name__.removesuffix("_impl")
    matmuls = jax.custom_jvp(matmuls, nondiff_argnums=static)

    def straight_through_jvp(float_params, out_dtypes, option, primals, tangents):
        (lhs, rhss), (lhs_dot, rhs_dots) = primals, tangents
        outs = matmuls(lhs, rhss, float_params, out_dtypes, option)
        return outs, tuple(_tangent(_dot_general_float, out, (lhs, rhs), (lhs_dot, rhs_dot), params)
                           for out, rhs, rhs_dot, params in zip(outs, rhss, rhs_dots, float_params))

    matmuls.defjvp(straight_through_jvp, symbolic_zeros=True)
    return _shared(matmuls, static, early_when)


def _tangent(float_matmul, out, primals, tangents, float_params):
    """The straight-through tangent of one quantized matmul's result ``out``: the float matmul's JVP at the float
    operands, the sum of one float matmul per operand with a tangent (zeros when none has one)."""
    lhs, rhs, *extra = primals
    lhs_dot, rhs_dot = (t.value if isinstance(t, ScaledActivation) else t for t in tangents[:2])
    params = dict(float_params)
    terms = []
    # _has_tangent reads types (a pre-quantized operand, a symbolic zero), which the linter cannot see through
    if _has_tangent(lhs, lhs_dot):  # noqa: JX201
        terms.append(float_matmul(lhs_dot, _float_value(rhs, lhs_dot), *extra, **params))
    if _has_tangent(rhs, rhs_dot):  # noqa: JX201
        terms.append(float_matmul(_float_value(lhs, rhs_dot), rhs_dot, *extra, **params))
    if not terms:
        return lax.full_like(out, 0)  # (lax.zeros_like_array is gone in JAX 0.10)
    tangent = terms[0] if len(terms) == 1 else lax.add(*terms)
    return tangent.astype(out.dtype)


def _shared(matmul, static: tuple, early_when):
    """``matmul`` under :func:`shared_jit`, traced under this library's source location."""

    def shared(*args):
        # The body is traced once and shared by every matmul of the same types, so its equations point at this
        # library (the shared program), not at whichever user line happened to trace it first; the pjit equation
        # itself carries each matmul's own source line and name scope.
        with source_info_util.user_context(_compat.python_traceback(), name_stack=source_info_util.new_name_stack()):
            return matmul(*args)

    shared.__name__ = shared.__qualname__ = matmul.__name__
    return shared_jit(shared, early_when=early_when, static_argnums=static)
