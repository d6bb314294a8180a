"""``QuantizedArray``: a float array held as int8 codes and per-slice scales, and everything it does.

A ``QuantizedArray`` is both what :func:`quantize` returns inside a rewritten dot and what
:func:`~jaxpr_rewrite.quantize_params` puts into a parameter pytree. Its behaviour follows a small wrapped-value
protocol (in the spirit of quax): wherever the rewrite meets one, it either

* uses it as a **dot operand** (:meth:`QuantizedArray.dot_operand`: the codes go straight into the int8 dot when
  its scales fit the dot's contraction), or
* **materialises** it (:meth:`QuantizedArray.materialise`: the float array it stands for), for every other use.

Three cheap structural operations keep codes usable through a program: :meth:`~QuantizedArray.astype` (a cast
before the dot, as ``flax`` does for ``dtype=bfloat16`` layers), :meth:`~QuantizedArray.transpose` (``x @ w.T``)
and leading-axis slicing, which ``lax.scan`` does through the pytree structure (the contracting axes are stored
counted from the end, so they stay valid).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .errors import Int8ifyError
from .quantize import (dequantize_codes, epilogue_factors, quantize_parts, quantize_static_parts, scale_values,
                       to_compute)

__all__ = ["QuantizedArray", "is_quantized", "materialise", "quantize", "quantize_operand", "smoothed_activation"]


@jax.tree_util.register_pytree_node_class
class QuantizedArray:
    """A float array stored as int8 codes and per-slice scales.

    Attributes:
        codes: int8, the array's shape.
        scales: float32 (float64 for float64 arrays), one per index of the axes not in ``contracting``, in order;
            with ``exponents`` the scale of a slice is ``scales * 2**exponents``.
        exponents: int32, shaped like ``scales``: the power of two of each slice's absmax, so ``scales`` is its
            mantissa / 127 (see :func:`jaxpr_rewrite.quantize.scales_from_absmax`).
        contracting: the axes one scale covers (the contracting dims of the dot it feeds). They are stored counted
            from the end, so slicing leading axes (``lax.scan`` over stacked layers) keeps them right.
        dtype: the float dtype of the array it stands for, which the traced program sees.
        smooth: ``None``, or float32 SmoothQuant factors over the (single) contracting axis: the codes then stand
            for ``smooth * w`` and a dot divides its other operand by ``smooth``.
        smooth_group: a token shared by weights holding the same ``smooth`` factors (one per activation, unique
            per :func:`~jaxpr_rewrite.quantize_params` call), so the activation is divided once for all of them.
        activation_scale: ``None`` (dynamic activation scales), or the static scale calibrated on the activations
            this weight's dots meet (a :class:`~jaxpr_rewrite.quantize.StaticScale`, from
            ``quantize_params(activations="static")``): a dot taking this weight quantizes its other operand with
            that one scale (see :func:`jaxpr_rewrite.quantize.quantize_static_parts`) instead of measuring it.
        activation_group: a token shared by weights whose static scale was calibrated on the same activation (one
            per activation, unique per :func:`~jaxpr_rewrite.quantize_params` call): the program quantizes that
            activation once for all of them (``x @ wq``, ``x @ wk``, ``x @ wv``).
        factors: ``None``, or the scales' epilogue factors ``(f, g)`` (see
            :func:`jaxpr_rewrite.quantize.epilogue_factors`), shaped like ``scales``, computed once by
            :func:`~jaxpr_rewrite.quantize_params`: the program then multiplies the int32 sums by them as they are,
            which XLA fuses into its GPU GEMM kernel (a factor computed in the program is not).
    """

    def __init__(self, codes, scales, exponents, contracting: Sequence[int], dtype, smooth=None, smooth_group=None,
                 activation_scale=None, activation_group=None, factors=None):
        self.codes = codes
        self.scales = scales
        self.exponents = exponents
        self.from_end = _from_end(contracting, len(codes.shape))
        self.dtype = np.dtype(dtype)
        self.smooth = smooth
        self.smooth_group = smooth_group
        self.activation_scale = activation_scale
        self.activation_group = activation_group
        self.factors = factors

    # -- array-like ------------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def contracting(self) -> tuple[int, ...]:
        """The axes one scale covers."""
        return tuple(a + self.ndim for a in self.from_end)

    @property
    def kept_axes(self) -> tuple[int, ...]:
        """The axes the scales run over."""
        contracting = set(self.contracting)
        return tuple(a for a in range(self.ndim) if a not in contracting)

    @property
    def nbytes(self) -> int:
        leaves = jax.tree_util.tree_leaves(self)
        return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in leaves)

    def check(self, where: str = "a QuantizedArray") -> None:
        """Raise :class:`~jaxpr_rewrite.errors.Int8ifyError` unless codes, scales and exponents fit together."""
        kept_shape = tuple(self.shape[a] for a in self.kept_axes)
        problems = []
        if np.dtype(self.codes.dtype) != np.int8:
            problems.append(f"codes are {np.dtype(self.codes.dtype).name}, not int8")
        if tuple(self.scales.shape) != kept_shape:
            problems.append(f"scales have shape {tuple(self.scales.shape)}, expected {kept_shape} (the codes "
                            f"{self.shape} without contracting axes {self.contracting})")
        if tuple(getattr(self.exponents, "shape", ())) != tuple(self.scales.shape):
            problems.append(f"exponents have shape {tuple(getattr(self.exponents, 'shape', ()))}, expected "
                            f"{tuple(self.scales.shape)}")
        for factor in self.factors or ():
            if tuple(getattr(factor, "shape", ())) != tuple(self.scales.shape):
                problems.append(f"epilogue factors have shape {tuple(getattr(factor, 'shape', ()))}, expected "
                                f"{tuple(self.scales.shape)}")
        floats = (("scales", self.scales), ("smooth factors", self.smooth),
                  *(("epilogue factors", f) for f in self.factors or ()),
                  *(("static activation scale", v) for v in (self.activation_scale or ())[:1]))
        cast = [f"{name} are {np.dtype(value.dtype).name}, not float32/float64" for name, value in floats
                if value is not None and np.dtype(value.dtype).name not in ("float32", "float64")]
        if cast:
            # the usual mixed-precision tree_map(lambda a: a.astype(bfloat16), params) reaches into the scales
            problems.append(
                f"{'; '.join(cast)} (a tree_map cast reached into it: cast whole QuantizedArrays instead, with "
                "jax.tree_util.tree_map(fn, params, is_leaf=jaxpr_rewrite.quantized.is_quantized) and "
                "QuantizedArray.astype, which keeps codes and scales)")
        if problems:
            raise Int8ifyError(f"{where} is malformed: {'; '.join(problems)}")

    def epilogue_factors(self, dtype):
        """The scales' factors for the dot's epilogue in ``dtype`` (see
        :func:`jaxpr_rewrite.quantize.epilogue_factors`): the stored ones when :attr:`factors` is set."""
        if self.factors is None:
            return epilogue_factors(to_compute(self.scales, dtype), self.exponents)
        return tuple(to_compute(f, dtype) for f in self.factors)

    # -- the protocol ----------------------------------------------------------------------------------------
    def materialise(self):
        """The float array this stands for: ``codes * scales`` (divided by ``smooth``), in ``dtype``."""
        value = self.dot_value()
        if self.smooth is not None:
            smooth = lax.broadcast_in_dim(to_compute(self.smooth, value.dtype), self.shape, self.contracting)
            value = lax.div(value, smooth)
        return value if value.dtype == self.dtype else lax.convert_element_type(value, self.dtype)

    def scale_values(self):
        """The scales as plain float values, ``scales * 2**exponents`` (see
        :func:`jaxpr_rewrite.quantize.scale_values`)."""
        return scale_values(self.scales, self.exponents)

    def dot_value(self):
        """The float value this operand has inside a dot: ``codes * scales`` (for a smoothed weight that is
        ``smooth * w``, matching the other operand, which the dot divides by ``smooth``)."""
        return dequantize_codes(self.codes, self.scales, self.exponents, self.kept_axes)

    def dot_operand(self, contracting: Sequence[int]) -> "QuantizedArray | None":
        """This array as the operand of a per-channel int8 dot contracting ``contracting``, or ``None`` when its
        scales do not fit (another contraction): then the dot must use :meth:`materialise`."""
        return self if _from_end(contracting, self.ndim) == self.from_end else None

    def astype(self, dtype) -> "QuantizedArray":
        """The same codes standing for the array cast to the float ``dtype``."""
        return QuantizedArray(self.codes, self.scales, self.exponents, self.from_end, dtype, self.smooth,
                              self.smooth_group, self.activation_scale, self.activation_group, self.factors)

    def transpose(self, permutation: Sequence[int]) -> "QuantizedArray":
        """The same codes and scales, laid out as ``lax.transpose(array, permutation)``."""
        permutation = tuple(int(p) for p in permutation)
        contracting = set(self.contracting)
        new_contracting = tuple(i for i, p in enumerate(permutation) if p in contracting)
        old_kept = self.kept_axes
        new_kept_sources = [p for p in permutation if p not in contracting]  # old axes, in the new order
        order = tuple(old_kept.index(p) for p in new_kept_sources)
        scales, exponents, factors = self.scales, self.exponents, self.factors
        if order != tuple(range(len(order))):
            scales, exponents = lax.transpose(scales, order), lax.transpose(exponents, order)
            factors = None if factors is None else tuple(lax.transpose(f, order) for f in factors)
        return QuantizedArray(lax.transpose(self.codes, permutation), scales, exponents, new_contracting, self.dtype,
                              self.smooth, self.smooth_group, self.activation_scale, self.activation_group, factors)

    # -- pytree ----------------------------------------------------------------------------------------------
    def tree_flatten(self):
        children = (self.codes, self.scales, self.exponents, self.smooth, self.activation_scale, self.factors)
        return children, (self.from_end, self.dtype, self.smooth_group, self.activation_group)

    @classmethod
    def tree_unflatten(cls, aux, children):
        codes, scales, exponents, smooth, activation_scale, factors = children
        from_end, dtype, smooth_group, activation_group = aux
        array = object.__new__(cls)  # no validation: the leaves may be anything a tree_map made of them
        array.codes, array.scales, array.exponents, array.smooth = codes, scales, exponents, smooth
        array.activation_scale, array.activation_group = activation_scale, activation_group
        array.factors = factors
        array.from_end, array.dtype, array.smooth_group = from_end, dtype, smooth_group
        return array

    def __repr__(self):
        shape = getattr(self.codes, "shape", None)
        if shape is None:  # a tree_map made the leaves into something else (their shapes, say)
            return f"QuantizedArray(codes={self.codes!r}, contracting={self.from_end} (from the end))"
        smooth = ", smoothed" if self.smooth is not None else ""
        static = ", static activation scale" if self.activation_scale is not None else ""
        return (f"QuantizedArray(i8{list(shape)}, contracting={self.contracting}, dtype={self.dtype.name}"
                f"{smooth}{static})")


def _from_end(axes: Sequence[int], ndim: int) -> tuple[int, ...]:
    return tuple(sorted((int(a) % ndim) - ndim for a in axes)) if ndim else ()


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedArray)


def materialise(x):
    """``x`` as a plain array: a :class:`QuantizedArray` materialised, anything else as it is."""
    return x.materialise() if is_quantized(x) else x


def quantize(x, reduce_axes: Sequence[int]) -> QuantizedArray:
    """Quantize ``x`` to int8 with one symmetric scale per slice over ``reduce_axes`` (the contract's rule).

    Arguments:
        x: a floating array (bfloat16 and float16 are upcast to float32 first).
        reduce_axes: the axes one scale covers (for a dot operand: its contracting dims).

    Returns:
        A :class:`QuantizedArray` (``.codes``, ``.scales``, ``.exponents``) standing for ``x``.
    """
    x = x if hasattr(x, "ndim") and hasattr(x, "dtype") else jnp.asarray(x)
    ndim = max(x.ndim, 1)
    reduce_axes = tuple(sorted(a % ndim for a in reduce_axes))
    codes, scales, exponents = quantize_parts(x, reduce_axes)
    return QuantizedArray(codes, scales, exponents, reduce_axes, x.dtype)


def quantize_operand(x, reduce_axes: Sequence[int], partner) -> QuantizedArray:
    """One operand of an int8 dot, quantized: as it is when it already is a :class:`QuantizedArray`; with the
    static scale its ``partner`` (the dot's other operand) was calibrated with, when that is a pre-quantized weight
    holding one; else with the contract's dynamic per-slice scales (:func:`quantize`)."""
    if is_quantized(x):
        return x
    static = partner.activation_scale if is_quantized(partner) else None
    if static is None:
        return quantize(x, reduce_axes)
    x = x if hasattr(x, "ndim") and hasattr(x, "dtype") else jnp.asarray(x)
    reduce_axes = tuple(sorted(a % max(x.ndim, 1) for a in reduce_axes))
    codes, scales, exponents, factors = quantize_static_parts(x, static, reduce_axes)
    return QuantizedArray(codes, scales, exponents, reduce_axes, x.dtype, factors=factors)


def smoothed_activation(activation, smooth, axis: int):
    """``activation / smooth`` along ``axis``, as a smoothed weight's dot computes it: the reciprocal is taken once on
    the small factor vector (in float32, then cast to the activation's dtype), and each element costs one multiply."""
    inverse = lax.div(np.float32(1), to_compute(smooth, np.float32))
    inverse = lax.convert_element_type(inverse, activation.dtype)
    return lax.mul(activation, lax.broadcast_in_dim(inverse, activation.shape, (axis,)))
