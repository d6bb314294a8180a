"""The int8 x int8 -> int32 dot with exact sums: a contraction that could overflow int32 is chunked, and the XLA
paths that give wrong sums (GPU contraction lengths not a multiple of 4) or run slowly (CPU one-row lhs) are
worked around."""

from __future__ import annotations

import functools

import numpy as np
from jax import lax

from .._core import platforms
from .._core.layout import (blocked, blocked_dimension_numbers, contraction_size, decided, free_axes, is_static,
                            one_or_more, with_a_zero_row)
from .quantize import MAX_INT32_SAFE_CONTRACTION, holds_nonfinite

__all__ = ["INT8_PRECISION", "contraction_padding", "holds_nonfinite_as_dot_reads", "int32_dot",
           "matrix_vector_safe_dot", "padded_contraction"]

# XLA's GPU int8 GEMM (the Triton emitter, JAX 0.11) returns doubled sums when the contraction length is not a
# multiple of 4 and the lhs has more than one row; zero padding to a multiple of 4 keeps the sums exact there.
_CONTRACTION_MULTIPLE = 4


def contraction_padding(lhs_shape, lc):
    """How many zeros the lhs' last contracting dim (and the rhs') takes to make the contraction length a multiple of
    4: an int (0 where it is one already), or a symbolic amount where the length is known only when the program
    runs (jax.export's symbolic shapes), 0 there where it already is one."""
    if not lc:
        return 0
    others = contraction_size(lhs_shape, lc[:-1])
    last = lhs_shape[lc[-1]]
    if not is_static(others * last):
        return -last % _CONTRACTION_MULTIPLE
    if others * last == 0:
        return 0
    pad = 0
    while (others * (last + pad)) % _CONTRACTION_MULTIPLE:
        pad += 1
    return pad


def padded_contraction(lhs_codes, rhs_codes, dimension_numbers, pad):
    """Both operands with ``pad`` zeros added to their last contracting dim."""
    (lc, rc), _ = dimension_numbers

    def padded(codes, axis):
        return lax.pad(codes, np.int8(0), [(0, pad if a == axis else 0, 0) for a in range(codes.ndim)])

    return padded(lhs_codes, lc[-1]), padded(rhs_codes, rc[-1])


def matrix_vector_safe_dot(lhs_codes, rhs_codes, dimension_numbers):
    """The int8 x int8 -> int32 dot, with a one-row lhs padded to two rows.

    XLA's CPU backend runs an s8 x s8 -> s32 dot with a single lhs row (batch-1 inference) on a slow
    matrix-vector path, about 3x slower than the same dot with two rows (benchmarks/speed.py). Padding the row
    with zeros and slicing it off again keeps one int8 dot and exact sums. A program exported for any batch size
    makes that choice when it runs (benchmarks/deploy.py: without it, 5x the traced program's time at batch 1).
    From jaxlib 0.12.1 XLA keeps a one-row int8 dot fast and the padding costs 4-6% of an MLP's time at batch 1,
    but it stays there: that XLA:CPU fails to compile a one-row s8 dot whose other operand's codes are transposed in
    the program (``x @ w.T`` of a pre-quantized weight: "Failed to translate module to LLVM IR", an i32 added to an
    i8 in the fusion it emits for the transpose and the vector-matrix dot), and a program exported there may run on
    an older XLA.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lhs_free = free_axes(lhs_codes.ndim, lc, lb)
    rhs_free = free_axes(rhs_codes.ndim, rc, rb)
    # (a symbolic column count, from jax.export, may be more than one: the padded row is sliced off either way)
    if not lhs_free or decided(lambda: contraction_size(rhs_codes.shape, rhs_free) <= 1):
        return _int32_sums(lhs_codes, rhs_codes, dimension_numbers)
    # a symbolic row count (jax.export): one row or more is decided when the program runs
    return one_or_more([lhs_codes.shape[a] for a in lhs_free],
                       functools.partial(_int32_sums_of_two_rows, dimension_numbers=dimension_numbers,
                                         row_axis=lhs_free[0]),
                       functools.partial(_int32_sums, dimension_numbers=dimension_numbers), lhs_codes, rhs_codes)


# The precision every int8 dot asks for (the ragged dot's too): without an explicit one, a user's
# jax_default_matmul_precision="float32" asks XLA for an fp32 contraction of int8 codes. The sums are exact either
# way; XLA:CPU, XLA:GPU (deviceless H200) and XLA:TPU (a v5e: the same convolution, the same time) compile such a
# dot_general alike, but XLA:TPU's ragged dot kernel (Mosaic) refuses one ("Bad lhs type").
INT8_PRECISION = lax.Precision.DEFAULT


def _int32_sums(lhs_codes, rhs_codes, dimension_numbers):
    # int8 codes, which the linter cannot tell from the arguments' names
    return lax.dot_general(lhs_codes, rhs_codes, dimension_numbers, precision=INT8_PRECISION,  # noqa: JX101
                           preferred_element_type=np.int32)


def _int32_sums_of_two_rows(lhs_codes, rhs_codes, dimension_numbers, row_axis: int):
    """The sums of a one-row lhs (``row_axis`` of size 1 when it runs) computed with a zero row added."""
    acc = _int32_sums(with_a_zero_row(lhs_codes, row_axis), rhs_codes, dimension_numbers)
    return lax.slice_in_dim(acc, 0, lhs_codes.shape[row_axis], axis=len(dimension_numbers[1][0]))


def holds_nonfinite_as_dot_reads(codes, reduce_axes: tuple):
    """:func:`~jaxpr_rewrite._numerics.quantize.holds_nonfinite` per slice of ``codes``; for a matrix of one row
    (batch-1 inference), over the codes as the int8 dot reads them, padded to two rows
    (:func:`matrix_vector_safe_dot`): XLA:CPU then computes the codes once, with the previous layer's epilogue in the
    same kernel, instead of once more for the check (an MLP layer: 3 kernels instead of 5)."""
    if codes.ndim == 2 and reduce_axes == (1,) and is_static(codes.shape[0]) and codes.shape[0] == 1:
        return lax.slice(holds_nonfinite(with_a_zero_row(codes, 0), reduce_axes), (0,), (1,))
    return holds_nonfinite(codes, reduce_axes)


def int32_dot(lhs_codes, rhs_codes, dimension_numbers, dtype):
    """``dot_general`` of int8 codes into int32, split along the contraction when it could overflow; the sums as the
    platform the program is traced for takes them (:meth:`~jaxpr_rewrite._core.platforms.Platform.int8_sums`).

    A contraction longer than ``MAX_INT32_SAFE_CONTRACTION`` is flattened, zero-padded and cut into chunks that
    become one extra batch dim of the same single int8 dot; each chunk sums exactly in int32 and the chunk sums
    are added in float32.

    Returns:
        the sums in the dot's output layout, as ``dtype`` (the compute dtype).
    """
    (lc, rc), (lb, rb) = dimension_numbers
    contraction = contraction_size(lhs_codes.shape, lc)
    if contraction <= MAX_INT32_SAFE_CONTRACTION:
        sums = platforms.current().int8_sums(lhs_codes, rhs_codes, dimension_numbers=dimension_numbers)
        return lax.convert_element_type(sums, dtype)
    n_chunks = -(-contraction // MAX_INT32_SAFE_CONTRACTION)
    chunk = -(-contraction // n_chunks)
    chunk += -chunk % _CONTRACTION_MULTIPLE
    lhs3 = blocked(lhs_codes, lc, lb, n_chunks, chunk)
    rhs3 = blocked(rhs_codes, rc, rb, n_chunks, chunk)
    acc = lax.dot_general(
        lhs3, rhs3, blocked_dimension_numbers(dimension_numbers, lhs_codes.ndim, rhs_codes.ndim),
        precision=INT8_PRECISION, preferred_element_type=np.int32,
    )
    # acc is (batch..., chunk, lhs free..., rhs free...): sum the chunks in the compute dtype.
    return lax.reduce_sum(lax.convert_element_type(acc, dtype), (len(lb),))
