"""``QuantizedArray``: a float array held as int8 codes and per-slice scales, and everything it does.

A ``QuantizedArray`` is both what :func:`~jaxpr_rewrite._dots.operands.quantize` returns inside a rewritten dot and what
:func:`~jaxpr_rewrite.quantize_params` puts into a parameter pytree. Its behaviour follows a small wrapped-value
protocol (in the spirit of quax): wherever the rewrite meets one, it either

* uses it as a **dot operand** (:meth:`QuantizedArray.dot_operand`: the codes go straight into the int8 dot when
  its scales fit the dot's contraction), or
* **materialises** it (:meth:`QuantizedArray.materialise`: the float array it stands for), for every other use.

Three cheap structural operations keep codes usable through a program: :meth:`~QuantizedArray.astype` (a cast
before the dot, as ``flax`` does for ``dtype=bfloat16`` layers), :meth:`~QuantizedArray.transpose` (``x @ w.T``)
and leading-axis slicing, which ``lax.scan`` does through the pytree structure (the contracting axes are stored
counted from the end, so they stay valid).

**Its layout.** The array is its named children (:data:`ARRAY_FIELDS`: codes, scales, exponents, optional ones)
and its metadata (:data:`METADATA_FIELDS`: contracting axes, dtype, ...), at :data:`LAYOUT_VERSION`. Everything that
takes one apart or puts one together reads these two tables: the pytree flattening (children keyed by name, so Orbax and
``keystr`` see ``.codes``, ``.scales``), ``jax.export``'s serialization of the metadata (registered here, so an exported
program taking quantized params deserializes in another process once ``jaxpr_rewrite`` is imported), and
:mod:`jaxpr_rewrite._quantized.stored` (checkpoints, SafeTensors). A new optional child is one more entry in
:data:`ARRAY_FIELDS`.

**4-bit weights** (``bits=4``) hold their codes packed two per byte along the last axis
(:mod:`jaxpr_rewrite._numerics.int4`) with scales ``absmax / 7``; a dot unpacks them to int8 codes in ``[-7, 7]``
(:meth:`QuantizedArray.dot_operand`) and runs the same int8 x int8 -> int32 dot.
"""

from __future__ import annotations

import operator
from typing import Mapping, Sequence

import jax
import numpy as np
from jax import lax

from .._core.errors import Int8ifyError
from .._numerics.exact_division import correctly_rounded_divide
from .._numerics.blocks import from_blocks, n_blocks, to_blocks
from .._numerics.int4 import unpack_int4
from .._numerics.quantize import dequantize_by_factors, epilogue_factors, scale_values, smoothing_inverse, to_compute
from .array_layout import (ARRAY_FIELDS, CODE_LIMITS, FIELD_AXES, LAYOUT_VERSION, METADATA_DEFAULTS, METADATA_FIELDS,
                           OPTIONAL_ARRAY_FIELDS, layout_problems, metadata_problems, read_metadata, register_export)
from .._numerics.static_scales import StaticScale

__all__ = [
    "ARRAY_FIELDS",
    "CODE_LIMITS",
    "FIELD_AXES",
    "LAYOUT_VERSION",
    "METADATA_FIELDS",
    "OPTIONAL_ARRAY_FIELDS",
    "QuantizedArray",
    "is_quantized",
    "materialise",
]


# A QuantizedArray's children and its metadata (pytree aux data), in the layout's order
_children_of = operator.attrgetter(*ARRAY_FIELDS)
_metadata_of = operator.attrgetter(*METADATA_FIELDS)


class QuantizedArray:
    """A float array stored as int8 (or packed int4) codes and per-slice scales.

    Attributes:
        codes: int8, the array's shape; for ``bits=4``, uint8 bytes holding two codes each along the last axis
            (:func:`jaxpr_rewrite._numerics.int4.pack_int4`).
        scales: float32 (float64 for float64 arrays), one per index of the axes not in ``contracting``, in order;
            with ``exponents`` the scale of a slice is ``scales * 2**exponents``.
        exponents: int32, shaped like ``scales``: the power of two of each slice's absmax, so ``scales`` is its
            mantissa / 127 (see "How a scale is held" in :mod:`jaxpr_rewrite._numerics.quantize`).
        contracting: the axes one scale covers (the contracting dims of the dot it feeds). They are stored counted
            from the end, so slicing leading axes (``lax.scan`` over stacked layers) keeps them right.
        dtype: the float dtype of the array it stands for, which the traced program sees.
        smooth: ``None``, or SmoothQuant factors (float32; float64 for float64 arrays) over the (single) contracting
            axis: the codes then stand for ``smooth * w`` and a dot divides its other operand by ``smooth``.
        smooth_inverse: ``None``, or ``1 / smooth`` correctly rounded, computed once by
            :func:`~jaxpr_rewrite.quantize_params`: the dot multiplies its other operand by it as it is (a reciprocal
            computed in the program is, off CPU, integer arithmetic, a GPU kernel per weight; see
            :meth:`smoothing_multiplier`).
        smooth_group: a token shared by weights holding the same ``smooth`` factors (one per activation, unique
            per :func:`~jaxpr_rewrite.quantize_params` call), so the activation is divided once for all of them.
        bits: 8, or 4 for codes in ``[-7, 7]`` packed two per byte (scales ``absmax / 7``).
        length: for ``bits=4``, the length of the array's last axis (the packed one; ``None`` for 8 bits).
        block_size: ``None`` (one scale per slice), or the block length of a block-scaled weight: one scale per
            index of the kept axes and block of the flattened contraction, ``scales`` shaped
            ``(*kept shape, n_blocks)`` (:mod:`jaxpr_rewrite._numerics.blocks`); it feeds the dots of
            ``int8ify(..., block_size=block_size)``.
        epilogue_factor, epilogue_power: ``None``, or the scales' epilogue factors (see
            :func:`jaxpr_rewrite._numerics.quantize.epilogue_factors`), shaped like ``scales``, computed once by
            :func:`~jaxpr_rewrite.quantize_params`: the program then multiplies the int32 sums by them as they are,
            which XLA fuses into its GPU GEMM kernel (a factor computed in the program is not).
        activation_scale: ``None`` (dynamic activation scales), or the static scale calibrated on the activations
            this weight's dots meet (``quantize_params(activations="static")``; a
            :class:`~jaxpr_rewrite._numerics.static_scales.StaticScale` stored as one float32 vector): a dot taking this
            weight quantizes its other operand with that one scale instead of measuring it
            (:func:`jaxpr_rewrite._numerics.static_scales.quantize_static_parts`).
        activation_group: a token shared by weights whose static scale was calibrated on the same activation (one
            per activation, unique per :func:`~jaxpr_rewrite.quantize_params` call): the compiled program quantizes that
            activation once for all of them (``x @ wq``, ``x @ wk``, ``x @ wv``).
        value: ``None``, or the float array itself, kept beside its codes for the reads that are no matmul: a tied
            embedding, whose lookup (a gather) reads its float rows and whose LM head (``x @ embed.T``) its codes
            (:func:`~jaxpr_rewrite.quantize_params`). :meth:`materialise` returns it as it is.
        cache: whether it is a KV cache (:func:`~jaxpr_rewrite.quantize_cache`): a dot contracting it along the axes
            its scales run over (attention's ``p . v`` over the tokens) folds its scales into the other operand
            (:meth:`folds_into_partner`); a weight there is materialised, as the contract has it.
    """

    def __init__(self, codes, scales, exponents, contracting: Sequence[int] | None = None, dtype=None, smooth=None,
                 smooth_group=None, bits: int = 8, length: int | None = None, block_size: int | None = None,
                 epilogue_factor=None, epilogue_power=None, activation_scale=None, activation_group=None,
                 smooth_inverse=None, value=None, cache: bool = False, *, from_end: Sequence[int] | None = None):
        if (contracting is None) == (from_end is None) or dtype is None:
            raise Int8ifyError("QuantizedArray needs its dtype and either contracting (axes) or from_end (axes "
                               f"counted from the end); got contracting={contracting!r}, from_end={from_end!r}, "
                               f"dtype={dtype!r}")
        self.codes = codes
        self.scales = scales
        self.exponents = exponents
        # from_end is what the pytree unflattening passes (with every child and metadata field by name, the leaves
        # possibly not arrays at all), so it is stored as it is
        self.from_end = _from_end(contracting, len(codes.shape)) if from_end is None else from_end
        self.dtype = np.dtype(dtype)
        self.smooth = smooth
        self.smooth_inverse = smooth_inverse
        self.smooth_group = smooth_group
        self.bits = bits
        self.length = length
        self.block_size = block_size
        self.epilogue_factor = epilogue_factor
        self.epilogue_power = epilogue_power
        self.activation_scale = activation_scale
        self.activation_group = activation_group
        self.value = value
        self.cache = cache

    # -- array-like ------------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self.codes.shape)
        return shape if self.bits == 8 else (*shape[:-1], self.length)

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
    def scale_axes(self) -> tuple:
        """The array's axes the scales' axes run over: the kept axes, then (block-scaled) ``None`` for the block
        index."""
        return self.kept_axes if self.block_size is None else (*self.kept_axes, None)

    @property
    def scales_shape(self) -> tuple[int, ...]:
        """The shape ``scales`` and ``exponents`` have."""
        kept_shape = tuple(self.shape[a] for a in self.kept_axes)
        if self.block_size is None:
            return kept_shape
        return (*kept_shape, n_blocks(int(np.prod([self.shape[a] for a in self.contracting])), self.block_size))

    @property
    def nbytes(self) -> int:
        leaves = jax.tree_util.tree_leaves(self)
        return sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize for leaf in leaves)

    def check(self, where: str = "a QuantizedArray") -> None:
        """Raise :class:`~jaxpr_rewrite._core.errors.Int8ifyError` unless codes, scales and exponents fit together
        (:func:`~jaxpr_rewrite._quantized.array_layout.layout_problems` names what does not)."""
        problems = layout_problems(self)
        if problems:
            raise Int8ifyError(f"{where} is malformed: {'; '.join(problems)}")

    @property
    def static_scale(self) -> "StaticScale | None":
        """The calibrated static activation scale (:attr:`activation_scale` read as a
        :class:`~jaxpr_rewrite._numerics.static_scales.StaticScale`), or ``None``."""
        return None if self.activation_scale is None else StaticScale.stored_in(self.activation_scale)

    def smoothing_multiplier(self):
        """What a dot multiplies its other operand by (in the factors' dtype, over the contracting axis): the stored
        :attr:`smooth_inverse`, or ``1 / smooth`` correctly rounded in the program."""
        if self.smooth_inverse is not None:
            return to_compute(self.smooth_inverse)
        return smoothing_inverse(self.smooth)

    @property
    def scale_dtype(self) -> np.dtype:  # the scales' dtype, their epilogue factors' too
        return np.dtype((self.scales if self.scales is not None else self.epilogue_factor).dtype)

    def epilogue_factors(self, dtype):
        """The scales' factors for the dot's epilogue in ``dtype`` (see
        :func:`jaxpr_rewrite._numerics.quantize.epilogue_factors`): the stored ones when there are."""
        if self.epilogue_factor is None:
            return epilogue_factors(to_compute(self.scales, dtype), self.exponents)
        return to_compute(self.epilogue_factor, dtype), to_compute(self.epilogue_power, dtype)

    # -- the protocol ----------------------------------------------------------------------------------------
    def unpacked(self) -> "QuantizedArray":
        """The same array with its codes as one int8 per element (a 4-bit array unpacked; an 8-bit one as is)."""
        if self.bits == 8:
            return self
        return self.replace(codes=unpack_int4(self.codes, self.shape[-1]), bits=8, length=None)

    def materialise(self):
        """The float array this stands for: its kept :attr:`value`, else ``codes * scales`` (divided by ``smooth``),
        in ``dtype``."""
        if self.value is not None:
            return self.value if self.value.dtype == self.dtype else lax.convert_element_type(self.value, self.dtype)
        value = self.dot_value()
        if self.smooth is not None:
            stacked = tuple(range(self.smooth.ndim - 1))  # the leading axes of stacked weights' factors
            smooth = lax.broadcast_in_dim(to_compute(self.smooth, value.dtype), self.shape,
                                          (*stacked, *self.contracting))
            value = correctly_rounded_divide(value, smooth)  # not XLA's 1/smooth multiply, nor a GPU's division
        return value if value.dtype == self.dtype else lax.convert_element_type(value, self.dtype)

    def scale_values(self):
        """The scales as plain float values, ``scales * 2**exponents``
        (:func:`jaxpr_rewrite._numerics.quantize.scale_values`)."""
        return scale_values(self.scales, self.exponents)

    def dot_value(self):
        """The float value this operand has inside a dot: ``codes * scales`` (for a smoothed weight that is
        ``smooth * w``, matching the other operand, which the dot divides by ``smooth``)."""
        codes, factors = self.unpacked().codes, self.epilogue_factors(self.scale_dtype)
        if self.block_size is None:
            return dequantize_by_factors(codes, *factors, self.kept_axes)
        blocked = to_blocks(codes, self.kept_axes, self.contracting, self.block_size)
        values = dequantize_by_factors(blocked, *factors, tuple(range(blocked.ndim - 1)))
        return from_blocks(values, self.shape, self.kept_axes, self.contracting)

    def dot_operand(self, contracting: Sequence[int]) -> "QuantizedArray | None":
        """This array as the operand of a per-channel int8 dot contracting ``contracting`` (with int8 codes: a
        4-bit array is unpacked), or ``None`` when its scales do not fit (another contraction, or block scales) or
        it holds stacked weights' smooth factors (the other operand cannot be divided by all of them): then the
        dot must use :meth:`materialise`. Stacked weights' static scales are dropped: the dot meets them all at
        once (``int8ify(vmap(f))``), so it measures its activation's scales instead."""
        fits = _from_end(contracting, self.ndim) == self.from_end and self.block_size is None
        if not fits or (self.smooth is not None and self.smooth.ndim > 1):
            return None
        if self.activation_scale is not None and self.activation_scale.ndim > 1:
            return self.unpacked().replace(activation_scale=None, activation_group=None)
        return self.unpacked()

    def folds_into_partner(self, contracting: Sequence[int], batch: Sequence[int]) -> bool:
        """Whether a dot contracting this array over ``contracting`` (its batch axes ``batch``), axes its scales run
        along rather than cover, can take its scales into the other operand before that one is quantized: a KV
        cache's values contracted over its tokens, ``sum_s p[s] v[s] = sum_s (p[s] * s_v[s]) v_q[s]``
        (:func:`~jaxpr_rewrite._dots.int8_dot.int8_dot_general_impl`). Its scales must be per slice (no blocks,
        smoothing or static activation scale), cover no contracting axis, and run along no free axis of the dot
        (each scale then multiplies one product of the other operand, whatever the output); and it must be a KV
        cache (:attr:`cache`): a weight in another contraction is materialised, as the contract has it."""
        contracting = {int(a) % self.ndim for a in contracting}
        along = contracting | {int(a) % self.ndim for a in batch}
        return (self.cache and self.block_size is None and self.smooth is None and self.activation_scale is None
                and not contracting & set(self.contracting) and set(self.kept_axes) <= along)

    def block_operand(self, contracting: Sequence[int], batch: Sequence[int], block: int) -> "QuantizedArray | None":
        """This block-scaled array as the operand of a block-scaled dot, in the layout that dot cuts a float
        operand into (:func:`jaxpr_rewrite._dots.int8_dot.blocked`: batch axes, free axes, blocks, block elements), or
        ``None`` when it was not quantized for this contraction and block length.

        Arguments:
            contracting: the dot's contracting axes of this operand, in its dimension numbers' order.
            batch: the dot's batch axes of this operand.
            block: the dot's block length.

        Returns:
            A per-channel :class:`QuantizedArray` over the last axis of the blocked layout, int8 codes.
        """
        contracting = tuple(int(a) % self.ndim for a in contracting)
        if self.block_size != block or contracting != self.contracting:  # blocks follow the axes' own order
            return None
        lead = (*batch, *(a for a in self.kept_axes if a not in batch))
        codes = to_blocks(self.unpacked().codes, lead, contracting, block)
        order = (*(self.kept_axes.index(a) for a in lead), len(lead))
        scales, exponents = self.scales, self.exponents
        if order != tuple(range(len(order))):
            scales, exponents = lax.transpose(scales, order), lax.transpose(exponents, order)
        return QuantizedArray(codes, scales, exponents, (codes.ndim - 1,), self.dtype)

    def astype(self, dtype) -> "QuantizedArray":
        """The same codes standing for the array cast to the float ``dtype``."""
        dtype = np.dtype(dtype)
        if not jax.dtypes.issubdtype(dtype, np.floating):
            raise Int8ifyError(f"QuantizedArray.astype({dtype.name}): its codes stand for a float array; cast to a "
                               f"float dtype, or cast materialise()'s value")
        return self.replace(dtype=dtype)

    def transpose(self, permutation: Sequence[int]) -> "QuantizedArray":
        """The same codes and scales, laid out as ``lax.transpose(array, permutation)`` (4-bit codes are unpacked
        first: their packing follows the last axis)."""
        if self.bits != 8:
            return self.unpacked().transpose(permutation)
        permutation = tuple(int(p) for p in permutation)
        contracting = set(self.contracting)
        new_contracting = tuple(i for i, p in enumerate(permutation) if p in contracting)
        old_kept = self.kept_axes
        new_kept_sources = [p for p in permutation if p not in contracting]  # old axes, in the new order
        order = tuple(old_kept.index(p) for p in new_kept_sources)
        if self.block_size is not None:
            if tuple(p for p in permutation if p in contracting) != self.contracting:
                return None  # the blocks run over the contracting axes in their own order
            order = (*order, len(order))  # the block index stays last
        per_slice = {name: getattr(self, name) for name in ("scales", "exponents", "epilogue_factor", "epilogue_power")
                     if getattr(self, name) is not None}
        if order != tuple(range(len(order))):
            per_slice = {name: lax.transpose(value, order) for name, value in per_slice.items()}
        value = None if self.value is None else lax.transpose(self.value, permutation)
        return self.replace(codes=lax.transpose(self.codes, permutation), value=value,
                            from_end=_from_end(new_contracting, self.ndim), **per_slice)

    # -- pytree and serialization (all from ARRAY_FIELDS and METADATA_FIELDS) ---------------------------------
    # The pytree registration (below the class) is a dataclass one: jax.jit flattens every QuantizedArray argument
    # on every call, and JAX reads a dataclass node's fields in C++ (about 0.6 us less per array and call than a
    # Python flatten function), keyed by name (GetAttrKey), so Orbax and keystr see .codes, .scales.
    def tree_flatten(self):
        """The children (:data:`ARRAY_FIELDS`, in order) and the metadata (:data:`METADATA_FIELDS`)."""
        return _children_of(self), _metadata_of(self)

    def replace(self, **changes) -> "QuantizedArray":
        """A copy with some children or metadata replaced (every other field, present or future, carried over).

        Arguments:
            **changes: ``field name -> new value``, names from :data:`ARRAY_FIELDS` and :data:`METADATA_FIELDS`.
        """
        unknown = set(changes) - set(ARRAY_FIELDS) - set(METADATA_FIELDS)
        if unknown:
            hint = " (the contracting axes are from_end, counted from the end)" if "contracting" in unknown else ""
            raise Int8ifyError(f"QuantizedArray has no fields {sorted(unknown)}{hint}")
        if "dtype" in changes:  # as the constructor does: a dtype's name or scalar type reads as its np.dtype
            try:
                changes["dtype"] = np.dtype(changes["dtype"])
            except TypeError as e:
                raise Int8ifyError(f"QuantizedArray.replace: dtype {changes['dtype']!r} is not a dtype ({e})") from None
        children = [changes.get(name, getattr(self, name)) for name in ARRAY_FIELDS]
        return QuantizedArray.tree_unflatten(tuple(changes.get(name, getattr(self, name)) for name in METADATA_FIELDS),
                                             children)

    @classmethod
    def tree_unflatten(cls, aux, children):
        array = object.__new__(cls)  # no validation: the leaves may be anything a tree_map made of them
        children = list(children)  # an older layout's children lack the last ones (as the constructor's defaults)
        for name, value in zip(ARRAY_FIELDS, children + [None] * (len(ARRAY_FIELDS) - len(children))):
            setattr(array, name, value)
        for name, value in zip(METADATA_FIELDS, aux):
            setattr(array, name, value)
        for name in list(METADATA_FIELDS)[len(aux):]:  # an older layout's aux data lacks the last ones
            setattr(array, name, METADATA_DEFAULTS[name])
        return array

    def metadata(self) -> dict:
        """The metadata as JSON values, with the layout version (what :meth:`from_parts` reads back)."""
        written = {name: write(getattr(self, name)) for name, (write, _) in METADATA_FIELDS.items()}
        return {"layout_version": LAYOUT_VERSION, **written}

    def arrays(self) -> dict:
        """The children that are present, by name."""
        return {name: getattr(self, name) for name in ARRAY_FIELDS if getattr(self, name) is not None}

    @classmethod
    def from_parts(cls, arrays: Mapping, metadata: Mapping, where: str = "a QuantizedArray") -> "QuantizedArray":
        """The array from its children by name and its :meth:`metadata`, checked.

        Arguments:
            arrays: ``name -> array`` for the present children (:data:`ARRAY_FIELDS`); optional ones may be absent.
            metadata: what :meth:`metadata` wrote.
            where: what the error messages call it (a checkpoint leaf's path).

        Returns:
            The :class:`QuantizedArray`.

        Raises:
            Int8ifyError: another layout version, a missing or unknown part, or parts that do not fit together.
        """
        missing = [name for name in ARRAY_FIELDS if name not in OPTIONAL_ARRAY_FIELDS and name not in arrays]
        unknown = [name for name in arrays if name not in ARRAY_FIELDS]
        if missing or unknown:
            raise Int8ifyError(f"{where} is malformed: arrays missing {missing}, unknown {unknown} (layout "
                               f"version {LAYOUT_VERSION} has {list(ARRAY_FIELDS)})")
        array = cls.tree_unflatten(read_metadata(metadata, where), [arrays.get(name) for name in ARRAY_FIELDS])
        array.check(where)
        return array

    def __repr__(self):
        shape = getattr(self.codes, "shape", None)
        if shape is None:  # a tree_map made the leaves into something else (their shapes, say)
            return f"QuantizedArray(codes={self.codes!r}, contracting={self.from_end} (from the end))"
        if metadata_problems(self):  # a hand-built array: the shape and axes derived from its metadata may not be
            return f"QuantizedArray(codes={np.dtype(self.codes.dtype).name}{list(shape)}, from_end={self.from_end!r})"
        smooth = ", smoothed" if self.smooth is not None else ""
        blocks = f", block_size={self.block_size}" if self.block_size is not None else ""
        static = ", static activation scale" if self.activation_scale is not None else ""
        static += ", KV cache" if self.cache else ""
        return (f"QuantizedArray(i{self.bits}{list(self.shape)}, contracting={self.contracting}, "
                f"dtype={self.dtype.name}{blocks}{smooth}{static})")


jax.tree_util.register_dataclass(QuantizedArray, data_fields=list(ARRAY_FIELDS), meta_fields=list(METADATA_FIELDS))
register_export(QuantizedArray)


def _from_end(axes: Sequence[int], ndim: int) -> tuple[int, ...]:
    return tuple(sorted((int(a) % ndim) - ndim for a in axes)) if ndim else ()


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedArray)


def materialise(x):
    """``x`` as a plain array: a :class:`QuantizedArray` materialised, anything else as it is."""
    return x.materialise() if is_quantized(x) else x
