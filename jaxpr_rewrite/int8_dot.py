"""The rewrite of one float matmul: quantize, int8 x int8 -> int32 dot, float32 scale epilogue.

This is the seed contract generalised to any dimension numbers: each operand gets one scale per index of its
non-contracting dims (batch + free), taken over all of its contracting dims; the codes go through one
``dot_general`` with the *same* dimension numbers and ``preferred_element_type=int32``; the int32 sums are scaled
by the outer product of the two scale arrays, formed by broadcasting into the output layout (never a matmul of
scales, never a B x D_in x D_out product). ``ragged_dot_general`` (grouped matmuls of mixture-of-experts layers)
follows the same contract with one weight scale per group and column.

Gradients use the straight-through estimator: the rewritten dot's JVP is the float dot's, evaluated at the float
operands.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.extend import source_info_util

from . import _compat
from .backends import register_backend
from .config import RewriteConfig, contraction_size
from .errors import Int8ifyError
from .quantize import MAX_INT32_SAFE_CONTRACTION, scale_product
from .quantized import is_quantized, quantize, quantize_operand

__all__ = [
    "PER_CHANNEL",
    "Scheme",
    "int8_backend",
    "int8_dot_general",
    "int8_ragged_dot_general",
    "scale_to_output",
    "scaled_int8_dot",
    "shared_jit",
    "straight_through",
    "supports_ragged",
]


class Scheme(NamedTuple):
    """How scales are laid out (hashable: it is a static argument of the rewritten dot).

    Attributes:
        granularity: ``"per-channel"`` (the contract: one scale per index of the non-contracting dims) or
            ``"per-tensor"`` (one scale per operand).
        block_size: if set, per-channel scales are refined to one per block of this many elements along the
            (flattened) contraction; int32 partial sums are scaled per block and summed in float32.
    """

    granularity: str = "per-channel"
    block_size: int | None = None

    @classmethod
    def of(cls, config: RewriteConfig) -> "Scheme":
        return cls(config.granularity, None if config.block_size is None else int(config.block_size))


PER_CHANNEL = Scheme()


def free_axes(ndim: int, contracting: Sequence[int], batch: Sequence[int]) -> tuple[int, ...]:
    return tuple(a for a in range(ndim) if a not in contracting and a not in batch)


def scale_to_output(scales, kept_axes: Sequence[int], ndim: int, dimension_numbers, side: int, out_shape):
    """Broadcast one operand's per-slice values (scales, exponents) into the ``dot_general`` output layout.

    ``dot_general``'s output is ``(batch dims in dimension-number order, lhs free dims, rhs free dims)``.

    Arguments:
        scales: values over the operand axes ``kept_axes``, in that (ascending) order.
        kept_axes: operand axes the values run over; none of them contracting (``()`` for one value).
        ndim: the operand's rank.
        dimension_numbers: the dot's ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.
        side: 0 for the lhs, 1 for the rhs.
        out_shape: the dot's output shape.

    Returns:
        ``scales`` broadcast to ``out_shape``.
    """
    contract, batch = dimension_numbers[0][side], dimension_numbers[1][side]
    free = free_axes(ndim, contract, batch)
    offset = len(batch) if side == 0 else len(out_shape) - len(free)
    out_positions = {a: offset + i for i, a in enumerate(free)}
    out_positions.update({a: i for i, a in enumerate(batch)})
    # broadcast_in_dim needs increasing target positions: reorder the axes first when the batch dims are not
    # listed in ascending order.
    order = sorted(range(len(kept_axes)), key=lambda i: out_positions[kept_axes[i]])
    if order != list(range(len(kept_axes))):
        scales = lax.transpose(scales, order)
    targets = tuple(sorted(out_positions[a] for a in kept_axes))
    return lax.broadcast_in_dim(scales, tuple(out_shape), targets)


def _scaled(acc, operands, placements):
    """``acc * scale_lhs * scale_rhs`` (see :func:`~jaxpr_rewrite.quantize.scale_product`), each operand's
    epilogue factors placed into ``acc``'s layout by ``placements[side](values)``."""
    lhs, rhs = ([place(factor) for factor in q.epilogue_factors(acc.dtype)] for q, place in zip(operands, placements))
    return scale_product(acc, lhs, rhs)


def blocked(x, contract, batch, n_blocks: int, block: int):
    """Move ``x`` to ``(batch..., free..., K)`` and cut the flattened contraction ``K`` into ``(n_blocks, block)``,
    zero-padded at the end."""
    free = free_axes(x.ndim, contract, batch)
    moved = lax.transpose(x, (*batch, *free, *contract))
    lead = moved.shape[: len(batch) + len(free)]
    flat = lax.reshape(moved, (*lead, contraction_size(moved.shape, range(len(lead), moved.ndim))))
    pad = n_blocks * block - flat.shape[-1]
    if pad:
        flat = lax.pad(flat, lax.full((), 0, x.dtype), [(0, 0, 0)] * len(lead) + [(0, pad, 0)])
    return lax.reshape(flat, (*lead, n_blocks, block))


def blocked_dimension_numbers(dimension_numbers, lhs_ndim: int, rhs_ndim: int):
    """Dimension numbers of the dot between two :func:`blocked` operands: the block index joins the batch
    dims, the block's elements are contracted."""
    (lc, rc), (lb, rb) = dimension_numbers
    n_batch = len(lb)
    lhs_block_axis = n_batch + len(free_axes(lhs_ndim, lc, lb))
    rhs_block_axis = n_batch + len(free_axes(rhs_ndim, rc, rb))
    return (
        ((lhs_block_axis + 1,), (rhs_block_axis + 1,)),
        ((*range(n_batch), lhs_block_axis), (*range(n_batch), rhs_block_axis)),
    )


# XLA's GPU int8 GEMM (the Triton emitter, JAX 0.11) returns doubled sums when the contraction length is not a
# multiple of 4 and the lhs has more than one row; zero padding to a multiple of 4 keeps the sums exact there.
_CONTRACTION_MULTIPLE = 4


def _pad_contraction(lhs_codes, rhs_codes, dimension_numbers):
    """Zero-pad the last contracting dim of both operands so the contraction length is a multiple of 4."""
    (lc, rc), _ = dimension_numbers
    if not lc:
        return lhs_codes, rhs_codes
    others = contraction_size(lhs_codes.shape, lc[:-1])
    last = lhs_codes.shape[lc[-1]]
    pad = 0
    while (others * (last + pad)) % _CONTRACTION_MULTIPLE:
        pad += 1
    if pad == 0 or others * last == 0:
        return lhs_codes, rhs_codes

    def padded(codes, axis):
        return lax.pad(codes, np.int8(0), [(0, pad if a == axis else 0, 0) for a in range(codes.ndim)])

    return padded(lhs_codes, lc[-1]), padded(rhs_codes, rc[-1])


def _matrix_vector_safe_dot(lhs_codes, rhs_codes, dimension_numbers):
    """The int8 x int8 -> int32 dot, with a one-row lhs padded to two rows.

    XLA's CPU backend runs an s8 x s8 -> s32 dot with a single lhs row (batch-1 inference) on a slow
    matrix-vector path, about 3x slower than the same dot with two rows (benchmarks/speed.py). Padding the row
    with zeros and slicing it off again keeps one int8 dot and exact sums.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lhs_codes, rhs_codes = _pad_contraction(lhs_codes, rhs_codes, dimension_numbers)
    lhs_free = free_axes(lhs_codes.ndim, lc, lb)
    rhs_free = free_axes(rhs_codes.ndim, rc, rb)
    one_row = lhs_free and all(lhs_codes.shape[a] == 1 for a in lhs_free)
    if not one_row or contraction_size(rhs_codes.shape, rhs_free) <= 1:
        return lax.dot_general(lhs_codes, rhs_codes, dimension_numbers, preferred_element_type=np.int32)
    padding = [(0, 1 if a == lhs_free[0] else 0, 0) for a in range(lhs_codes.ndim)]
    padded = lax.pad(lhs_codes, np.int8(0), padding)
    acc = lax.dot_general(padded, rhs_codes, dimension_numbers, preferred_element_type=np.int32)
    return lax.slice_in_dim(acc, 0, 1, axis=len(lb))


def _int32_dot(lhs_codes, rhs_codes, dimension_numbers, dtype):
    """``dot_general`` of int8 codes into int32, split along the contraction when it could overflow.

    A contraction longer than ``MAX_INT32_SAFE_CONTRACTION`` is flattened, zero-padded and cut into chunks that
    become one extra batch dim of the same single int8 dot; each chunk sums exactly in int32 and the chunk sums
    are added in float32.

    Returns:
        the sums in the dot's output layout, as ``dtype`` (the compute dtype).
    """
    (lc, rc), (lb, rb) = dimension_numbers
    contraction = contraction_size(lhs_codes.shape, lc)
    if contraction <= MAX_INT32_SAFE_CONTRACTION:
        return lax.convert_element_type(_matrix_vector_safe_dot(lhs_codes, rhs_codes, dimension_numbers), dtype)
    n_chunks = -(-contraction // MAX_INT32_SAFE_CONTRACTION)
    chunk = -(-contraction // n_chunks)
    chunk += -chunk % _CONTRACTION_MULTIPLE
    lhs3 = blocked(lhs_codes, lc, lb, n_chunks, chunk)
    rhs3 = blocked(rhs_codes, rc, rb, n_chunks, chunk)
    acc = lax.dot_general(
        lhs3, rhs3, blocked_dimension_numbers(dimension_numbers, lhs_codes.ndim, rhs_codes.ndim),
        preferred_element_type=np.int32,
    )
    # acc is (batch..., chunk, lhs free..., rhs free...): sum the chunks in the compute dtype.
    return lax.reduce_sum(lax.convert_element_type(acc, dtype), (len(lb),))


def _common_dtype(lhs_q, rhs_q, out_dtype=np.float32):
    """The epilogue's dtype: float64 when either operand's scales or the output are float64 (float32 operands
    with ``preferred_element_type=float64`` would overflow or flush in a float32 epilogue), float32 otherwise."""
    return np.promote_types(np.promote_types(lhs_q.scales.dtype, rhs_q.scales.dtype), out_dtype)


def scaled_int8_dot(lhs, rhs, dimension_numbers, lhs_reduce: Sequence[int], rhs_reduce: Sequence[int],
                    out_dtype=np.float32):
    """Quantize both operands (one scale per slice over ``*_reduce``), take their int8 dot into int32, and scale
    it back: ``acc * lhs_scale * rhs_scale`` in float32 (float64 for float64 operands or output).

    Arguments:
        lhs, rhs: floating operands, or :class:`QuantizedArray` ones whose scales run over the axes not in
            ``*_reduce``.
        dimension_numbers: the dot's dimension numbers.
        lhs_reduce, rhs_reduce: the axes each scale covers (the contracting dims, or every axis).
        out_dtype: the dot's output dtype; a float64 one makes the epilogue float64.

    Returns:
        ``(lhs_q, rhs_q, out)``: both operands quantized, and the result in the epilogue's dtype.
    """
    lhs_q = quantize_operand(lhs, lhs_reduce, rhs)
    rhs_q = quantize_operand(rhs, rhs_reduce, lhs)
    acc = _int32_dot(lhs_q.codes, rhs_q.codes, dimension_numbers, _common_dtype(lhs_q, rhs_q, out_dtype))

    def placement(q, side):
        return lambda values: scale_to_output(values, q.kept_axes, q.ndim, dimension_numbers, side, acc.shape)

    out = _scaled(acc, (lhs_q, rhs_q), (placement(lhs_q, 0), placement(rhs_q, 1)))
    return lhs_q, rhs_q, out


def _block_scaled_dot(lhs, rhs, dimension_numbers, block_size: int, out_dtype):
    """Sub-channel scaling: one scale per operand channel and block of ``block_size`` along the contraction."""
    (lc, rc), (lb, rb) = dimension_numbers
    n_blocks = -(-contraction_size(lhs.shape, lc) // block_size)
    lhs3 = blocked(lhs, lc, lb, n_blocks, block_size)
    rhs3 = blocked(rhs, rc, rb, n_blocks, block_size)
    dims3 = blocked_dimension_numbers(dimension_numbers, lhs.ndim, rhs.ndim)
    _, _, partial_sums = scaled_int8_dot(lhs3, rhs3, dims3, (lhs3.ndim - 1,), (rhs3.ndim - 1,), out_dtype)
    # partial_sums is (batch..., block, lhs free..., rhs free...): add the scaled blocks.
    return lax.reduce_sum(partial_sums, (len(lb),))


def int8_dot_general_impl(lhs, rhs, dimension_numbers, out_dtype, scheme: Scheme = PER_CHANNEL):
    """The int8 program for one ``dot_general`` (no gradient rule; see :data:`int8_dot_general`).

    An operand may come already quantized (a :class:`QuantizedArray` with per-channel scales over its
    non-contracting axes, as :func:`jaxpr_rewrite.quantize_params` makes for weights); it is used as is.
    """
    (lc, rc), _ = dimension_numbers
    if scheme.block_size is not None:
        out = _block_scaled_dot(lhs, rhs, dimension_numbers, scheme.block_size, out_dtype)
    else:
        per_tensor = scheme.granularity == "per-tensor"
        lhs_reduce = tuple(range(lhs.ndim)) if per_tensor else lc
        rhs_reduce = tuple(range(rhs.ndim)) if per_tensor else rc
        _, _, out = scaled_int8_dot(lhs, rhs, dimension_numbers, lhs_reduce, rhs_reduce, out_dtype)
    return out if out.dtype == out_dtype else lax.convert_element_type(out, out_dtype)


# -- ragged_dot_general ------------------------------------------------------------------------------------
def _ragged_layout(ragged):
    """The supported ragged layout (one ragged lhs non-contracting dim, one rhs group dim), or an error."""
    (lc, rc), (lb, rb) = ragged.dot_dimension_numbers
    if len(ragged.lhs_ragged_dimensions) != 1 or len(ragged.rhs_group_dimensions) != 1:
        return None
    (ragged_axis,), (group_axis,) = ragged.lhs_ragged_dimensions, ragged.rhs_group_dimensions
    if ragged_axis in lc or ragged_axis in lb or group_axis in rc or group_axis in rb:
        return None
    return ragged_axis, group_axis


def _group_of_each_row(group_sizes, n_rows: int):
    """For each index along the ragged dim, the group it belongs to (``G`` past the last group's end)."""
    ends = jnp.cumsum(group_sizes)
    rows = lax.iota(group_sizes.dtype, n_rows)
    return jnp.sum((rows[:, None] >= ends[None, :]).astype(np.int32), axis=1)


def _ragged_dot_float(lhs, rhs, group_sizes, **params):
    """The float ``ragged_dot_general`` with the equation's params (those this JAX version's API takes)."""
    accepted = inspect.signature(lax.ragged_dot_general).parameters
    return lax.ragged_dot_general(lhs, rhs, group_sizes, **{k: v for k, v in params.items() if k in accepted})


def _dot_general_float(lhs, rhs, **params):
    return lax.dot_general_p.bind(lhs, rhs, **params)


def int8_ragged_dot_general_impl(lhs, rhs, group_sizes, float_params, out_dtype, scheme: Scheme = PER_CHANNEL):
    """The int8 program for one ``ragged_dot_general`` whose lhs is ragged along a non-contracting dim (the
    grouped matmul of a mixture-of-experts layer): per-row lhs scales, per-group per-column rhs scales, one int8
    ``ragged_dot_general`` into int32, and each row scaled by its own group's column scales."""
    params = dict(float_params)
    ragged = params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = ragged.dot_dimension_numbers
    ragged_axis, group_axis = _ragged_layout(ragged)
    if scheme != PER_CHANNEL:
        raise Int8ifyError("ragged_dot_general is rewritten with per-channel scales only (no granularity or "
                           "block_size); skip it with skip_if to keep it float")
    lhs_q = lhs if is_quantized(lhs) else quantize(lhs, lc)
    rhs_q = rhs if is_quantized(rhs) else quantize(rhs, rc)
    int_params = {**params, "preferred_element_type": np.int32, "precision": None}
    sums = _ragged_dot_float(lhs_q.codes, rhs_q.codes, group_sizes, **int_params)
    acc = lax.convert_element_type(sums, _common_dtype(lhs_q, rhs_q, out_dtype))
    lhs_dims = ragged.dot_dimension_numbers
    out_shape = acc.shape
    # rhs (with the group dim) maps to the output as a dot without its group dim: batch, lhs free, rhs free.
    rhs_free = free_axes(rhs_q.ndim, rc, (*rb, group_axis))
    lhs_free = free_axes(lhs_q.ndim, lc, lb)
    ragged_out = len(lb) + lhs_free.index(ragged_axis)
    rhs_out = {a: i for a, i in zip(rb, range(len(lb)))}
    rhs_out.update({a: len(out_shape) - len(rhs_free) + i for i, a in enumerate(rhs_free)})
    groups = _group_of_each_row(group_sizes, lhs_q.shape[ragged_axis])  # (R,), group sizes are 1-D here

    def place_lhs(values):
        return scale_to_output(values, lhs_q.kept_axes, lhs_q.ndim, lhs_dims, 0, out_shape)

    def place_rhs(values):
        # values over rhs kept axes (group dim included); pick each ragged row's group, then broadcast.
        kept = list(rhs_q.kept_axes)
        moved = lax.transpose(values, [kept.index(group_axis)] + [i for i, a in enumerate(kept) if a != group_axis])
        n_groups = moved.shape[0]
        rows = lax.clamp(np.int32(0), groups, np.int32(n_groups - 1))
        picked = jnp.take(moved, rows, axis=0, mode="clip")  # (R, rest...)
        rest = [a for a in kept if a != group_axis]
        targets = [ragged_out] + [rhs_out[a] for a in rest]
        order = sorted(range(len(targets)), key=lambda i: targets[i])
        if order != list(range(len(targets))):
            picked = lax.transpose(picked, order)
        return lax.broadcast_in_dim(picked, out_shape, tuple(sorted(targets)))

    out = _scaled(acc, (lhs_q, rhs_q), (place_lhs, place_rhs))
    return out if out.dtype == out_dtype else lax.convert_element_type(out, out_dtype)


def supports_ragged(params) -> bool:
    """Whether a ``ragged_dot_general`` with these params has the layout the int8 rewrite handles."""
    return _ragged_layout(params["ragged_dot_dimension_numbers"]) is not None


# -- straight-through gradients ----------------------------------------------------------------------------
def _float_value(operand, like):
    """The float value of an operand for the JVP's float dots: a pre-quantized weight's value inside the dot."""
    if not is_quantized(operand):
        return operand
    value = operand.dot_value()
    return value if value.dtype == like.dtype else lax.convert_element_type(value, like.dtype)


def _has_tangent(primal, tangent) -> bool:
    # Pre-quantized operands are constants of the program: no tangent flows through their codes.
    return not is_quantized(primal) and type(tangent) is not SymbolicZero


def straight_through(impl, float_matmul=_dot_general_float, n_extra: int = 0):
    """Wrap a quantized matmul into a function with a straight-through gradient.

    Arguments:
        impl: ``impl(lhs, rhs, *extra, float_params, out_dtype, option)``, the quantized program for one matmul
            (``option``: a hashable description of the scheme or format).
        float_matmul: ``float_matmul(lhs, rhs, *extra, **params)``, the float matmul whose JVP the rewritten one
            takes (``dot_general`` or ``ragged_dot_general`` with the original params).
        n_extra: non-differentiable array operands after ``lhs, rhs`` (``group_sizes`` of a ragged dot).

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
        lhs_dot, rhs_dot = tangents[:2]
        out = matmul(lhs, rhs, *extra, float_params, out_dtype, option)
        params = dict(float_params)
        terms = []
        if _has_tangent(lhs, lhs_dot):
            terms.append(float_matmul(lhs_dot, _float_value(rhs, lhs_dot), *extra, **params))
        if _has_tangent(rhs, rhs_dot):
            terms.append(float_matmul(_float_value(lhs, rhs_dot), rhs_dot, *extra, **params))
        if not terms:
            return out, lax.full_like(out, 0)  # (lax.zeros_like_array is gone in JAX 0.10)
        tangent = terms[0] if len(terms) == 1 else lax.add(*terms)
        return out, tangent.astype(out.dtype)

    matmul.defjvp(straight_through_jvp, symbolic_zeros=True)

    def shared(*args):
        # The body is traced once and shared by every matmul of the same types, so its equations point at this
        # library (the shared program), not at whichever user line happened to trace it first; the pjit equation
        # itself carries each matmul's own source line and name scope.
        with source_info_util.user_context(_compat.python_traceback(), name_stack=source_info_util.new_name_stack()):
            return matmul(*args)

    shared.__name__ = shared.__qualname__ = matmul.__name__
    return shared_jit(shared, static_argnums=static)


def shared_jit(fn, **jit_kwargs):
    """``jax.jit(fn)`` for a program that many call sites share (one per layer of a model).

    On CPU, where JAX 0.11+ can say so (``jax.Inline.XLA_LATE``), XLA inlines its calls late instead of first,
    optimizing each call's body as a small computation of its own: about half the compile time of a deep model's
    first call, and as fast or faster to run (``benchmarks/overhead.py``, ``benchmarks/speed.py``). Other backends
    keep XLA's default early inlining, which lets the epilogue fuse with what follows; the late form has not been
    measured on a GPU.
    """
    early = jax.jit(fn, **jit_kwargs)
    late = _compat.jit_inlined_late(fn, **jit_kwargs)
    if late is None:
        return early

    def call(*args):
        return (late if jax.default_backend() == "cpu" else early)(*args)

    call.__name__ = call.__qualname__ = fn.__name__
    return call


def _dot_impl(lhs, rhs, float_params, out_dtype, scheme):
    return int8_dot_general_impl(lhs, rhs, dict(float_params)["dimension_numbers"], out_dtype, scheme)


_dot_impl.__name__ = "int8_dot_general_impl"
int8_dot_general = straight_through(_dot_impl)
"""``int8_dot_general(lhs, rhs, float_params, out_dtype, scheme)``: one float ``dot_general`` computed in int8
under :class:`Scheme` ``scheme``, as ``int32_sum * lhs_scale * rhs_scale`` in ``out_dtype``, with a
straight-through gradient. ``lhs``/``rhs`` may be :class:`QuantizedArray` (pre-quantized weights, no gradient)."""

int8_ragged_dot_general = straight_through(int8_ragged_dot_general_impl, _ragged_dot_float, n_extra=1)
"""``int8_ragged_dot_general(lhs, rhs, group_sizes, float_params, out_dtype, scheme)``: one float
``ragged_dot_general`` in int8, with a straight-through gradient."""


def _int8_ragged_backend(lhs, rhs, group_sizes, float_params, out_dtype, config: RewriteConfig):
    return int8_ragged_dot_general(lhs, rhs, group_sizes, float_params, out_dtype, Scheme.of(config))


@register_backend("int8", ragged_dot=_int8_ragged_backend, takes_prequantized=True)
def int8_backend(lhs, rhs, float_params, out_dtype, config: RewriteConfig):
    """The int8 contract (the default backend)."""
    return int8_dot_general(lhs, rhs, float_params, out_dtype, Scheme.of(config))
