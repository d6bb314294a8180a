"""The Pallas (Triton) kernel of the ``"int8-fused"`` backend (:mod:`~jaxpr_rewrite._platforms.fused_gpu_dot`): a float
activation times one or more int8 weights, quantizing the activation, multiplying the codes on the int8 tensor cores
and scaling the int32 sums in one launch.

With dynamic scales, a first pass over the rows' ``K`` elements takes their absmax, and each row's scale and its
reciprocal are computed once; the codes are then made block by block inside the GEMM's ``K`` loop; the epilogue
scales the sums. With a calibrated (static) scale there is no first pass. Each column block of the output quantizes
its rows again (``N / BLOCK_N`` times over): that is the price of the missing kernels, and only a GPU can weigh
it. Several weights of one activation share the grid: its columns run through each weight's column blocks in turn.

The numbers are the ``"int8"`` backend's on a GPU, bit for bit. Dynamic: the row's scale is ``fl24(absmax / 127)`` in
float64 (a float32 significand, its exponent unbounded; NaN or Inf make it Inf, a row of zeros takes the smallest normal
float64), as :func:`~jaxpr_rewrite._numerics.float64_scales.quantize_with_float64_scales` takes it as the maximum of its
elements' candidates (rounding is monotone, so that maximum is the absmax's candidate); each code is ``rint(fl32(fl64(x)
* (1 / scale)))`` clipped to +-127, the correctly rounded quotient
(:func:`~jaxpr_rewrite._numerics.exact_division.rounded_quotients_by_float64`); the epilogue is ``fl32(fl64(fl32(acc *
f) * g) * scale)`` with the weight's stored factors ``(f, g)``
(:func:`~jaxpr_rewrite._numerics.float64_scales.scale_product_in_float64`). Static: the codes are ``rint(x *
reciprocal)``, the epilogue ``(((acc * f_w) * f_x) * g_w) * g_x`` with ``f_x`` NaN for a row holding NaN or Inf
(:func:`~jaxpr_rewrite._numerics.static_scales.quantize_static_parts`). Triton's float64 divisions and conversions are
IEEE's, the epilogues are products only (nothing for a compiler to fuse into a multiply-add), and the rounding to even
is done in integers (:func:`_rounded_codes`). Inputs below float32's normal range are read as they are (XLA's own
kernels read them as zero).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pallas_triton

from .._compat import result_struct
from .._numerics.float64_scales import scale_candidates, scale_product_in_float64
from .._numerics.quantize import INT8_MAX, nan_safe_magnitude, scale_product
from .._numerics.static_scales import StaticScale

__all__ = ["BLOCK_N", "KernelForm", "WeightLayout", "contraction_block", "kernel_call", "operands_per_weight"]

BLOCK_N = 128
# the largest row block; a smaller batch takes the power of two above it (16 at least, the tensor cores' tile)
_MAX_BLOCK_M = 64
_MIN_BLOCK = 16
_BLOCK_K = 128
# Triton lowers an int8 dot of a 16-long K block on a Hopper GPU to mma.m16n8k32 fed the same 16 values in both
# halves of K, doubling every sum (read in the PTX of XLA's H200 compile); 32 is the int8 instruction's K.
_MIN_BLOCK_K = 32


def contraction_block(k: int) -> int | None:
    """The contraction's block: the largest power of two up to 128 dividing ``k``, at least 32 (``None``: none)."""
    block = _BLOCK_K
    while block >= _MIN_BLOCK_K and k % block:
        block //= 2
    return block if block >= _MIN_BLOCK_K else None


def _rounded_codes(quotients):
    """int8 codes ``clip(rint(quotients), -127, 127)``, ties to even, NaN (a slice holding NaN or Inf, whose scale
    is infinite) as 0. In integers: clipped first (127 is an integer, so the order does not matter), truncated, and
    the exact remainder ``v - trunc(v)`` moves the code by one beyond a half, and at a half to the even side. A
    float ``rint`` is not in Pallas' Triton lowering, and its usual stand-in, adding and subtracting ``1.5 *
    2**23``, is undone by a compiler that reassociates (XLA:CPU does)."""
    limit = np.float32(INT8_MAX)
    values = jnp.clip(jnp.where(quotients != quotients, np.float32(0), quotients), -limit, limit)
    whole = values.astype(jnp.int32)
    remainder = values - whole.astype(jnp.float32)
    odd = (whole & 1) == 1
    up = (remainder > 0.5) | ((remainder == 0.5) & odd)
    down = (remainder < -0.5) | ((remainder == -0.5) & odd)
    return (whole + up.astype(jnp.int32) - down.astype(jnp.int32)).astype(jnp.int8)


class _Bounds(NamedTuple):
    """Which rows and columns of one output block lie inside the arrays: ``None`` along an axis its blocks tile
    exactly, else a boolean vector. Pallas' Triton lowering neither masks nor clips a block that overhangs its
    array: the rows of a 1-row activation's block of 16, or the columns past a width that is not a multiple of
    ``BLOCK_N``, are read from and written to whatever memory follows (another result of the same kernel, a
    neighbouring buffer), so every load and store of such a block carries these masks."""

    rows: jax.Array | None
    columns: jax.Array | None

    def block(self):
        """The output block's mask (``None``: all of it lies inside)."""
        if self.rows is None and self.columns is None:
            return None
        rows = True if self.rows is None else self.rows[:, None]
        return rows & (True if self.columns is None else self.columns[None, :])


def _inside(size: int, index, extent: int):
    """Which of the ``size`` positions of block ``index`` lie below ``extent`` (``None``: the blocks tile it)."""
    if extent % size == 0:
        return None
    return index * np.int32(size) + lax.broadcasted_iota(jnp.int32, (size,), 0) < np.int32(extent)


def _load(ref, mask, other):
    """``ref[...]``, or where ``mask`` is given its positions inside the array and ``other`` elsewhere."""
    if mask is None:
        return ref[...]
    return pallas_triton.load(ref, mask=jnp.broadcast_to(mask, ref.shape), other=other)


def _store(ref, value, mask):
    """``ref[...] = value``, or where ``mask`` is given only its positions inside the array."""
    if mask is None:
        ref[...] = value
    else:
        pallas_triton.store(ref, value, mask=jnp.broadcast_to(mask, ref.shape))


class _Blocks:
    """The ``K`` blocks of one kernel instance's activation rows and weight columns (loop indices are int32), each
    read within the arrays' bounds (:class:`_Bounds`; what lies beyond reads as 0)."""

    def __init__(self, x_ref, w_ref, block_k: int, weight_rows_contract: bool, bounds: _Bounds):
        self.x_ref, self.w_ref, self.block_k, self.rows_contract = x_ref, w_ref, block_k, weight_rows_contract
        self.bounds = bounds

    def _along_k(self, k):
        return pl.ds(k * np.int32(self.block_k), self.block_k)

    def activation(self, k):
        rows = None if self.bounds.rows is None else self.bounds.rows[:, None]
        return _load(self.x_ref.at[:, self._along_k(k)], rows, 0).astype(jnp.float32)

    def products(self, codes, k):
        """The int32 products of the k-th block of codes with the weight's."""
        columns = self.bounds.columns
        if self.rows_contract:
            weight = _load(self.w_ref.at[self._along_k(k), :], None if columns is None else columns[None, :], 0)
        else:
            weight = _load(self.w_ref.at[:, self._along_k(k)], None if columns is None else columns[:, None], 0).T
        # int8 codes times int8 codes, which the linter cannot see through _rounded_codes
        return jnp.dot(codes, weight, preferred_element_type=jnp.int32)  # noqa: JX101


def _dynamic_kernel(x_ref, w_ref, *column_refs, steps: int, **blocking):
    """One ``(rows, columns)`` block of the output with the rows' dynamic scales: the rows' absmax (a first pass over
    their ``K`` elements, NaN read as Inf) and from it, once per row, the scale and its float64 reciprocal; then the
    codes and their int32 sums block by block along ``K``; then the epilogue, with the weight's stored factors
    ``(f, g)`` or its float64 scale per column (``column_refs``, then the output)."""
    *column_refs, out_ref = column_refs
    blocks = _Blocks(x_ref, w_ref, **blocking)

    def take_absmax(k, amax):
        return jnp.maximum(amax, jnp.max(nan_safe_magnitude(blocks.activation(k)), axis=1))

    def add_products(k, acc):
        quotients = (blocks.activation(k).astype(jnp.float64) * reciprocal[:, None]).astype(jnp.float32)
        return acc + blocks.products(_rounded_codes(quotients), k)

    first, last = np.int32(0), np.int32(steps)
    amax = lax.fori_loop(first, last, take_absmax, jnp.zeros((x_ref.shape[0],), jnp.float32))
    scale = scale_candidates(amax)  # the row's scale; a row of zeros takes FLOOR_SCALE, the smallest normal float64
    reciprocal = np.float64(1) / scale  # correctly rounded: rounded_quotients_by_float64's multiplier
    acc = lax.fori_loop(first, last, add_products, jnp.zeros(out_ref.shape, jnp.int32)).astype(jnp.float32)
    placed = functools.partial(_placed, shape=acc.shape)
    weight = tuple(placed(ref[...], rows=False) for ref in column_refs)
    _store(out_ref, scale_product_in_float64(acc, placed(scale, rows=True), weight if len(weight) == 2 else weight[0]),
           blocks.bounds.block())


def _static_kernel(x_ref, w_ref, factor_ref, power_ref, static_ref, out_ref, *, steps: int, **blocking):
    """One ``(rows, columns)`` block of the output with the calibrated scale ``static_ref`` (a stored
    :class:`~jaxpr_rewrite._numerics.static_scales.StaticScale`): codes ``rint(x * reciprocal)`` and their sums block by
    block along ``K``, each row marked where it holds NaN or Inf, then the epilogue ``(((acc * f_w) * f_x) * g_w) *
    g_x``, ``f_x`` NaN for a marked row."""
    blocks = _Blocks(x_ref, w_ref, **blocking)
    reciprocal, factor, power = (static_ref[field] for field in _STATIC_FIELDS)
    largest = np.float32(np.finfo(np.float32).max)

    def add_products(k, carry):
        acc, nonfinite = carry
        values = blocks.activation(k)
        # 1 where the block of a row holds NaN or Inf (they compare false)
        held = jnp.max(jnp.where(jnp.abs(values) <= largest, np.int32(0), np.int32(1)), axis=1)
        return acc + blocks.products(_rounded_codes(values * reciprocal), k), jnp.maximum(nonfinite, held)

    acc, nonfinite = lax.fori_loop(np.int32(0), np.int32(steps), add_products,
                                   (jnp.zeros(out_ref.shape, jnp.int32), jnp.zeros((x_ref.shape[0],), jnp.int32)))
    row_factor = jnp.where(nonfinite == 1, np.float32(np.nan), factor)
    placed = functools.partial(_placed, shape=out_ref.shape)
    columns = (placed(factor_ref[...], rows=False), placed(power_ref[...], rows=False))
    _store(out_ref, scale_product(acc.astype(jnp.float32), (placed(row_factor, rows=True), placed(power, rows=True)),
                                  columns), blocks.bounds.block())


def _padded(vector, size: int):
    """A per-column ``vector`` with 1 appended up to ``size``."""
    pad = size - vector.shape[0]
    return lax.pad(vector, np.ones((), vector.dtype), [(0, pad, 0)]) if pad else vector


def _placed(values, shape, rows: bool):
    """Per-row (``rows``) or per-column ``values`` (or one scalar) broadcast to the output block's ``shape``, the
    layout the contract's epilogues (:func:`~jaxpr_rewrite._numerics.quantize.scale_product`,
    :func:`~jaxpr_rewrite._numerics.float64_scales.scale_product_in_float64`) take their factors in."""
    values = jnp.asarray(values)
    if values.ndim:
        values = values[:, None] if rows else values[None, :]
    return jnp.broadcast_to(values, shape)


# the fields of a stored StaticScale the kernel reads: the codes' multiplier and the epilogue factors
_STATIC_FIELDS = tuple(StaticScale._fields.index(name) for name in ("reciprocal", "factor", "power"))


class WeightLayout(NamedTuple):
    """What the kernel is given for one weight, beside ``x``: its codes, then its per-column vectors, then its
    stored static activation scale if any (hashable, part of a static argument).

    Attributes:
        rows_contract: the codes are ``(K, N)`` (else ``(N, K)``).
        float64_weight_scale: the weight's scale per column in float64 (a weight quantized in the program), else its
            stored epilogue factors ``(f, g)``.
        static: a stored static activation scale follows.
    """

    rows_contract: bool
    float64_weight_scale: bool
    static: bool

    @property
    def columns(self) -> int:
        """How many per-column vectors follow the codes."""
        return 1 if self.float64_weight_scale else 2

    @property
    def operands(self) -> int:
        """How many operands the weight takes."""
        return 1 + self.columns + int(self.static)


class KernelForm(NamedTuple):
    """The kernel's static argument: its weights' layouts, and whether it runs in Pallas' interpreter."""

    weights: tuple
    interpret: bool


def operands_per_weight(weights, operands) -> list:
    """The operands after ``x`` (or their shapes), one list per weight."""
    starts = np.cumsum([0, *(w.operands for w in weights)])
    return [list(operands[a:b]) for a, b in zip(starts[:-1], starts[1:])]


def kernel_call(form: KernelForm, x, *operands):
    """The kernel on whole (or one device's) operands: ``x`` ``(rows, K)``, then per weight its codes ``(K, N)`` (or
    ``(N, K)``), ``columns`` vectors ``(N,)`` and a stored static scale if it has one. The grid's columns run
    through each weight's column blocks in turn; a weight's blocks map into its own operands and result, clamped
    outside its range (where it is neither read nor written)."""
    rows, k = x.shape
    block_k = contraction_block(k)
    block_m = min(_MAX_BLOCK_M, max(_MIN_BLOCK, pl.next_power_of_2(rows)))
    per_weight = operands_per_weight(form.weights, operands)
    widths = [codes.shape[1 if w.rows_contract else 0] for w, (codes, *_) in zip(form.weights, per_weight)]
    counts = [pl.cdiv(n, BLOCK_N) for n in widths]
    starts = tuple(int(s) for s in np.cumsum([0, *counts]))
    # the per-column vectors padded to whole blocks (with 1), so that their loads stay inside them
    with jax.enable_x64(True):  # a float64 weight scale keeps its dtype
        operands = [operand for w, (codes, *rest), count in zip(form.weights, per_weight, counts)
                    for operand in (codes, *(_padded(c, count * BLOCK_N) for c in rest[:w.columns]),
                                    *rest[w.columns:])]
    in_specs, out_specs = [pl.BlockSpec((block_m, k), lambda i, j: (i, 0))], []
    for weight, start, count in zip(form.weights, starts, counts):
        def block(j, start=start, count=count):
            return j if len(counts) == 1 else jnp.clip(j - start, 0, count - 1)

        in_specs += [
            pl.BlockSpec((k, BLOCK_N), lambda i, j, b=block: (0, b(j))) if weight.rows_contract
            else pl.BlockSpec((BLOCK_N, k), lambda i, j, b=block: (b(j), 0)),
            *(pl.BlockSpec((BLOCK_N,), lambda i, j, b=block: (b(j),)) for _ in range(weight.columns)),
            *([pl.BlockSpec((len(StaticScale._fields),), lambda i, j: (0,))] if weight.static else []),
        ]
        out_specs.append(pl.BlockSpec((block_m, BLOCK_N), lambda i, j, b=block: (i, b(j))))
    kernel = functools.partial(_kernel, weights=form.weights, starts=starts, steps=k // block_k, block_k=block_k,
                               rows=rows, widths=tuple(int(n) for n in widths))
    with jax.enable_x64(True):  # the dynamic kernel's scales are float64, whatever the program's own setting
        return pl.pallas_call(
            kernel,
            out_shape=tuple(result_struct((rows, n), np.float32, (x, *operands)) for n in widths),
            grid=(pl.cdiv(rows, block_m), starts[-1]),
            in_specs=in_specs,
            out_specs=tuple(out_specs),
            compiler_params=pallas_triton.CompilerParams(num_warps=4, num_stages=2),
            interpret=form.interpret,
            name="int8_fused_dot",
        )(x, *operands)


def _kernel(x_ref, *refs, weights, starts, steps: int, block_k: int, rows: int, widths: tuple):
    """One ``(rows, columns)`` block: the column block's weight's :func:`_dynamic_kernel` or
    :func:`_static_kernel` (with several weights, the one whose range of column blocks holds it), its loads and
    stores masked to the arrays' bounds where the block overhangs them (:class:`_Bounds`)."""
    inputs, out_refs = refs[:-len(weights)], refs[-len(weights):]
    column = pl.program_id(1)
    inside_rows = _inside(x_ref.shape[0], pl.program_id(0), rows)
    for weight, refs_of_weight, out_ref, start, end, width in zip(
            weights, operands_per_weight(weights, inputs), out_refs, starts, starts[1:], widths):
        bounds = _Bounds(inside_rows, _inside(BLOCK_N, column - np.int32(start), width))
        block = functools.partial(_static_kernel if weight.static else _dynamic_kernel, x_ref, *refs_of_weight,
                                  out_ref, steps=steps, block_k=block_k, weight_rows_contract=weight.rows_contract,
                                  bounds=bounds)
        if len(weights) == 1:
            block()
        else:
            pl.when((column >= start) & (column < end))(block)
