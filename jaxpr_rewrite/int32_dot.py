"""The int8 x int8 -> int32 dot with exact sums: a contraction that could overflow int32 is chunked, and the XLA
paths that give wrong sums (GPU contraction lengths not a multiple of 4) or run slowly (CPU one-row lhs) are
worked around."""

from __future__ import annotations

import functools

import numpy as np
from jax import lax

from .layout import (blocked, blocked_dimension_numbers, contraction_size, decided, free_axes, is_static,
                     one_or_more)
from .quantize import MAX_INT32_SAFE_CONTRACTION

__all__ = ["INT8_PRECISION", "int32_dot", "with_a_zero_row"]

# XLA's GPU int8 GEMM (the Triton emitter, JAX 0.11) returns doubled sums when the contraction length is not a
# multiple of 4 and the lhs has more than one row; zero padding to a multiple of 4 keeps the sums exact there.
_CONTRACTION_MULTIPLE = 4


def _contraction_padding(lhs_shape, lc):
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


def _padded_contraction(lhs_codes, rhs_codes, dimension_numbers, pad):
    """Both operands with ``pad`` zeros added to their last contracting dim."""
    (lc, rc), _ = dimension_numbers

    def padded(codes, axis):
        return lax.pad(codes, np.int8(0), [(0, pad if a == axis else 0, 0) for a in range(codes.ndim)])

    return padded(lhs_codes, lc[-1]), padded(rhs_codes, rc[-1])


def _gpu_safe_dot(lhs_codes, rhs_codes, dimension_numbers):
    """:func:`_matrix_vector_safe_dot`, its contraction zero-padded to a multiple of 4 in a GPU's program only. On
    CPU and TPU the padding bought nothing and cost a copy of each pre-quantized weight's codes on every call (a
    Dense layer with 390 inputs, XLA:CPU: one kernel more per layer with dynamic scales; with static ones the codes
    were computed twice, for the dot and for the check for NaN, 21 kernels instead of 13 for three layers)."""
    pad = _contraction_padding(lhs_codes.shape, dimension_numbers[0][0])
    if is_static(pad) and pad == 0:
        return _matrix_vector_safe_dot(lhs_codes, rhs_codes, dimension_numbers)

    def on_gpu(lhs, rhs):
        return _matrix_vector_safe_dot(*_padded_contraction(lhs, rhs, dimension_numbers, pad), dimension_numbers)

    return lax.platform_dependent(lhs_codes, rhs_codes, cuda=on_gpu, rocm=on_gpu,
                                  default=functools.partial(_matrix_vector_safe_dot,
                                                            dimension_numbers=dimension_numbers))


def _matrix_vector_safe_dot(lhs_codes, rhs_codes, dimension_numbers):
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


def with_a_zero_row(codes, row_axis: int):
    """``codes`` with a row of zeros added along ``row_axis``: a one-row lhs as its int8 dot reads it. Another reader
    of the codes that reads this same array instead (static scales' check for NaN and Inf) lets XLA compute them
    once, padded."""
    return lax.pad(codes, np.int8(0), [(0, 1 if a == row_axis else 0, 0) for a in range(codes.ndim)])


def int32_dot(lhs_codes, rhs_codes, dimension_numbers, dtype):
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
        return lax.convert_element_type(_gpu_safe_dot(lhs_codes, rhs_codes, dimension_numbers), dtype)
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
