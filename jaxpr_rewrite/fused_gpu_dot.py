"""One kernel per dot on NVIDIA GPUs: a float activation times a pre-quantized int8 weight as a single Pallas
(Triton) kernel that quantizes the activation, multiplies the codes on the int8 tensor cores and scales the int32
sums, the ``"int8-fused"`` backend's GPU program.

XLA's GPU compiler cannot put a quantization into its GEMM kernel's prologue: the codes of every dynamic activation
are a kernel of their own (and the absmax a second one, unless it joins the previous epilogue), so the int8
program of the 4 x 1024 MLP launches 13 kernels where bfloat16 launches 7 (``benchmarks/accelerators.py``). This
kernel is the dot's whole program. With dynamic scales, a first pass over the rows' ``K`` elements takes their
absmax, and each row's scale and its reciprocal are computed once; the codes are then made block by block inside
the GEMM's ``K`` loop; the epilogue scales the sums. With a calibrated (static) scale there is no first pass. Each
column block of the output quantizes its rows again (``N / BLOCK_N`` times over): that is the price of the missing
kernels, and only a GPU can weigh it (``benchmarks/device_check.py``).

The numbers are the ``"int8"`` backend's on a GPU, bit for bit. Dynamic: the row's scale is ``fl24(absmax / 127)``
in float64 (a float32 significand, its exponent unbounded; NaN or Inf make it Inf, a row of zeros takes the
smallest normal float64), as :func:`~jaxpr_rewrite.float64_scales.quantize_with_float64_scales` takes it as the
maximum of its elements' candidates (rounding is monotone, so that maximum is the absmax's candidate); each code
is ``rint(fl32(fl64(x) * (1 / scale)))`` clipped to +-127, the correctly rounded quotient
(:func:`~jaxpr_rewrite.exact_division.rounded_quotients_by_float64`); the epilogue is ``fl32(fl64(fl32(acc * f) *
g) * scale)`` with the weight's stored factors ``(f, g)``
(:func:`~jaxpr_rewrite.float64_scales.scale_product_in_float64`). Static: the codes are ``rint(x * reciprocal)``,
the epilogue ``(((acc * f_w) * f_x) * g_w) * g_x`` with ``f_x`` NaN for a row holding NaN or Inf
(:func:`~jaxpr_rewrite.static_scales.quantize_static_parts`). Triton's float64 divisions and conversions are IEEE's,
the epilogues are products only (nothing for a compiler to fuse into a multiply-add), and the rounding to even is
done in integers (:func:`_rounded_codes`). Inputs below float32's normal range are read as they are (XLA's own
kernels read them as zero).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.custom_batching
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.experimental.pallas import triton as pallas_triton
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._compat import result_struct
from .float64_scales import FLOOR_SCALE, quantize_with_float64_scales, scale_candidates, scale_product_in_float64
from .quantize import INT8_MAX, MAX_INT32_SAFE_CONTRACTION, nan_safe_magnitude, scale_product
from .quantized import is_quantized
from .static_scales import StaticScale

__all__ = ["BLOCK_N", "fits_fused_kernel", "fused_dot"]

BLOCK_N = 128
# the largest row block; a smaller batch takes the power of two above it (16 at least, the tensor cores' tile)
_MAX_BLOCK_M = 64
_MIN_BLOCK = 16
_BLOCK_K = 128
_FLOATS = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


def _block_k(k: int) -> int | None:
    """The contraction's block: the largest power of two up to 128 dividing ``k``, at least 16 (``None``: none)."""
    block = _BLOCK_K
    while block >= _MIN_BLOCK and k % block:
        block //= 2
    return block if block >= _MIN_BLOCK else None


def fits_fused_kernel(lhs, rhs, dimension_numbers) -> bool:
    """Whether :func:`fused_dot` computes this dot: a float activation (at least one row) contracted over its last
    axis, no batch axes, a contraction the int8 tensor cores tile (a multiple of 16) whose int32 sums cannot
    overflow, and on the right a 2-D weight (either layout): a per-channel int8 one (with a float32 static
    activation scale, or none), or a float one that the program quantizes."""
    (lc, rc), (lb, rb) = dimension_numbers
    shape = lhs.shape
    if is_quantized(rhs):
        fits_rhs = rhs.codes.dtype == np.int8 and (rhs.activation_scale is None
                                                   or rhs.activation_scale.dtype == np.float32)
    else:
        fits_rhs = np.dtype(rhs.dtype) in _FLOATS
    return (fits_rhs and len(shape) >= 1 and not lb and not rb and tuple(lc) == (len(shape) - 1,) and len(rc) == 1
            and rhs.ndim == 2 and np.dtype(lhs.dtype) in _FLOATS
            and int(np.prod(shape[:-1], dtype=np.int64)) > 0 and rhs.shape[1 - rc[0]] > 0
            and shape[-1] <= MAX_INT32_SAFE_CONTRACTION and _block_k(shape[-1]) is not None)


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


class _Blocks:
    """The ``K`` blocks of one kernel instance's activation rows and weight columns (loop indices are int32)."""

    def __init__(self, x_ref, w_ref, block_k: int, weight_rows_contract: bool):
        self.x_ref, self.w_ref, self.block_k, self.rows_contract = x_ref, w_ref, block_k, weight_rows_contract

    def _along_k(self, k):
        return pl.ds(k * np.int32(self.block_k), self.block_k)

    def activation(self, k):
        return self.x_ref[:, self._along_k(k)].astype(jnp.float32)

    def products(self, codes, k):
        """The int32 products of the k-th block of codes with the weight's."""
        weight = self.w_ref[self._along_k(k), :] if self.rows_contract else self.w_ref[:, self._along_k(k)].T
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
    # the row's scale; a row of zeros takes the smallest normal float64
    scale = jnp.maximum(scale_candidates(amax), FLOOR_SCALE)
    reciprocal = np.float64(1) / scale  # correctly rounded: rounded_quotients_by_float64's multiplier
    acc = lax.fori_loop(first, last, add_products, jnp.zeros(out_ref.shape, jnp.int32)).astype(jnp.float32)
    placed = functools.partial(_placed, shape=acc.shape)
    weight = tuple(placed(ref[...], rows=False) for ref in column_refs)
    out_ref[...] = scale_product_in_float64(acc, placed(scale, rows=True), weight if len(weight) == 2 else weight[0])


def _static_kernel(x_ref, w_ref, factor_ref, power_ref, static_ref, out_ref, *, steps: int, **blocking):
    """One ``(rows, columns)`` block of the output with the calibrated scale ``static_ref`` (a stored
    :class:`~jaxpr_rewrite.static_scales.StaticScale`): codes ``rint(x * reciprocal)`` and their sums block by block
    along ``K``, each row marked where it holds NaN or Inf, then the epilogue
    ``(((acc * f_w) * f_x) * g_w) * g_x``, ``f_x`` NaN for a marked row."""
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
    out_ref[...] = scale_product(acc.astype(jnp.float32), (placed(row_factor, rows=True), placed(power, rows=True)),
                                 (placed(factor_ref[...], rows=False), placed(power_ref[...], rows=False)))


def _placed(values, shape, rows: bool):
    """Per-row (``rows``) or per-column ``values`` (or one scalar) broadcast to the output block's ``shape``, the
    layout the contract's epilogues (:func:`~jaxpr_rewrite.quantize.scale_product`,
    :func:`~jaxpr_rewrite.float64_scales.scale_product_in_float64`) take their factors in."""
    values = jnp.asarray(values)
    if values.ndim:
        values = values[:, None] if rows else values[None, :]
    return jnp.broadcast_to(values, shape)


# the fields of a stored StaticScale the kernel reads: the codes' multiplier and the epilogue factors
_STATIC_FIELDS = tuple(StaticScale._fields.index(name) for name in ("reciprocal", "factor", "power"))


def fused_dot(x, weight, weight_contracting: int, interpret: bool = False):
    """``x @ weight`` under the int8 contract as one kernel (see the module docstring).

    Under ``jit`` with sharded operands the kernel runs on each device's rows of ``x`` and columns of the weight
    (a sharded contraction is gathered first: a row's absmax needs all of it), and the result keeps that sharding;
    XLA would otherwise gather the whole activation onto every device and replicate the result.

    Arguments:
        x: the float activation, contracted over its last axis (any leading shape).
        weight: a 2-D per-channel int8 :class:`~jaxpr_rewrite.quantized.QuantizedArray` (as
            :meth:`~jaxpr_rewrite.quantized.QuantizedArray.dot_operand` gives it); with an ``activation_scale``, the
            activation takes that calibrated scale, else the contract's dynamic one per row. Or a 2-D float array,
            quantized here as the ``"int8"`` backend quantizes it on a GPU, its float64 scale per column read by the
            epilogue (:func:`~jaxpr_rewrite.float64_scales.quantize_with_float64_scales`).
        weight_contracting: the weight's contracting axis, 0 (``x @ w``) or 1 (``x @ w.T``).
        interpret: run the kernel with Pallas' interpreter (any platform; for tests).

    Returns:
        float32, ``x.shape[:-1] + (N,)``.
    """
    k = x.shape[-1]
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    if is_quantized(weight):
        codes, columns = weight.codes, weight.epilogue_factors(np.float32)
        static = () if weight.activation_scale is None else (
            lax.convert_element_type(weight.activation_scale, np.float32),)
    else:  # its float64 scale per column, read by the epilogue as the int8 backend's GPU program reads it
        codes, _, _, weight_scale = quantize_with_float64_scales(weight, (weight_contracting,))
        columns, static = (weight_scale,), ()
    form = _Form(weight_contracting == 0, len(columns) == 1, bool(static), interpret)
    out = _batchable_kernel(form)(x.reshape(rows, k), codes, *columns, *static)
    return out.reshape(*x.shape[:-1], out.shape[-1])


class _Form(NamedTuple):
    """What the kernel is given, beside ``x`` and the weight's codes (a static argument, hashable).

    Attributes:
        rows_contract: the codes are ``(K, N)`` (else ``(N, K)``).
        float64_weight_scale: the weight's scale per column in float64 (a weight quantized in the program), else its
            stored epilogue factors ``(f, g)``.
        static: a stored static activation scale follows.
        interpret: run in Pallas' interpreter.
    """

    rows_contract: bool
    float64_weight_scale: bool
    static: bool
    interpret: bool

    @property
    def columns(self) -> int:
        """How many per-column vectors follow the codes."""
        return 1 if self.float64_weight_scale else 2


def _kernel_call(form: _Form, x, codes, *rest):
    """The kernel on whole (or one device's) operands: ``x`` ``(rows, K)``, ``codes`` ``(K, N)`` (or ``(N, K)``),
    then ``form.columns`` vectors ``(N,)`` and a stored static scale if ``form.static``."""
    rows, k = x.shape
    n = codes.shape[1 if form.rows_contract else 0]
    block_k = _block_k(k)
    block_m = min(_MAX_BLOCK_M, max(_MIN_BLOCK, pl.next_power_of_2(rows)))
    blocking = dict(steps=k // block_k, block_k=block_k, weight_rows_contract=form.rows_contract)
    kernel = functools.partial(_static_kernel if form.static else _dynamic_kernel, **blocking)
    in_specs = [
        pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
        pl.BlockSpec((k, BLOCK_N), lambda i, j: (0, j)) if form.rows_contract else pl.BlockSpec((BLOCK_N, k),
                                                                                                lambda i, j: (j, 0)),
        *(pl.BlockSpec((BLOCK_N,), lambda i, j: (j,)) for _ in range(form.columns)),
        *([pl.BlockSpec((len(StaticScale._fields),), lambda i, j: (0,))] if form.static else []),
    ]
    with jax.enable_x64(True):  # the dynamic kernel's scales are float64, whatever the program's own setting
        return pl.pallas_call(
            kernel,
            out_shape=result_struct((rows, n), np.float32, (x, codes, *rest)),
            grid=(pl.cdiv(rows, block_m), pl.cdiv(n, BLOCK_N)),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((block_m, BLOCK_N), lambda i, j: (i, j)),
            compiler_params=pallas_triton.CompilerParams(num_warps=4, num_stages=2),
            interpret=form.interpret,
            name="int8_fused_dot",
        )(x, codes, *rest)


# -- sharding: rows of x and columns of the weight stay where they are, the contraction is gathered -------------
def _mesh_axes(sharding, dim: int) -> tuple:
    """The mesh axes dimension ``dim`` of an operand is sharded over (none for a dimension past its spec)."""
    spec = tuple(sharding.spec)
    entry = spec[dim] if dim < len(spec) else None
    return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


def _shardings(form: _Form, mesh, arg_shapes):
    """The operands' and the result's shardings: ``x``'s rows and the weight's columns as they are (a columns'
    axis that the rows use too is dropped: the result holds each axis once), everything else whole."""
    rows = _mesh_axes(arg_shapes[0].sharding, 0)
    columns = _mesh_axes(arg_shapes[1].sharding, 1 if form.rows_contract else 0)
    if set(rows) & set(columns):
        columns = ()
    rows, columns = rows or None, columns or None
    named = functools.partial(NamedSharding, mesh)
    args = [named(P(rows, None)), named(P(None, columns) if form.rows_contract else P(columns, None)),
            *(named(P(columns)) for _ in range(form.columns)), *([named(P())] if form.static else [])]
    return args, named(P(rows, columns))


def _infer_sharding(form, mesh, arg_shapes, result_shape):
    return _shardings(form, mesh, arg_shapes)[1]


def _partition(form, mesh, arg_shapes, result_shape):
    args, result = _shardings(form, mesh, arg_shapes)
    return mesh, functools.partial(_kernel_call, form), result, tuple(args)


def _sharding_rule(form, mesh, arg_shapes, result_shape):
    """Shardy's rule: rows ``m`` and columns ``n`` pass through, the contraction ``k`` (and a static scale's
    fields ``s``) must be whole on each device."""
    operands = [ArrayMapping("m", "k"), ArrayMapping("k", "n") if form.rows_contract else ArrayMapping("n", "k"),
                *(ArrayMapping("n") for _ in range(form.columns)), *([ArrayMapping("s")] if form.static else [])]
    return SdyShardingRule(tuple(operands), (ArrayMapping("m", "n"),),
                           need_replication_factors=("k", "s") if form.static else ("k",))


@functools.partial(custom_partitioning, static_argnums=(0,))
def _partitioned_kernel(form, *operands):
    return _kernel_call(form, *operands)


_partitioned_kernel.def_partition(partition=_partition, infer_sharding_from_operands=_infer_sharding,
                                  sharding_rule=_sharding_rule)


# -- vmap: custom_partitioning has no batching rule ---------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _batchable_kernel(form: _Form):
    """The partitioned kernel for ``form``, under ``vmap`` too: a batch of activations is more rows (one call, the
    partitioning kept); a batch of weights, a batched Pallas call (its own rule adds a grid axis)."""

    @jax.custom_batching.custom_vmap
    def kernel(*operands):
        return _partitioned_kernel(form, *operands)

    @kernel.def_vmap
    def _batched(axis_size, in_batched, *operands):
        x, *weight_operands = operands
        if not any(in_batched[1:]):
            out = kernel(x.reshape(-1, x.shape[-1]), *weight_operands)
            return out.reshape(axis_size, x.shape[1], out.shape[-1]), True
        operands = [v if batched else jnp.broadcast_to(v, (axis_size, *v.shape))
                    for v, batched in zip(operands, in_batched)]
        return jax.vmap(functools.partial(_kernel_call, form))(*operands), True

    return kernel
