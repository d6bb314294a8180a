"""Block-scaled fp8/fp4 backends: each float ``dot_general`` becomes one ``jax.nn.scaled_matmul`` call.

Backends registered into :data:`jaxpr_rewrite._core.backends.BACKENDS` at import:

* ``"mxfp8"``: float8_e4m3fn values, float8_e8m0fnu (power-of-two) scales, one per block of 32 along K.
* ``"nvfp4"``: float4_e2m1fn values, float8_e4m3fn scales, one per block of 16 along K, and a second-level
  float32 scale per operand tensor, applied in the epilogue.
* ``"auto"``: ``"mxfp8"`` on an NVIDIA Blackwell GPU (compute capability >= 10, where cuDNN runs it),
  ``"int8"`` everywhere else; resolved when the program is rewritten.

The rewrite of one dot (any dimension numbers): each operand is moved to ``(B, M, K)`` / ``(B, N, K)`` (B the
product of the batch dims, M/N of the free dims, K of the contracting dims, zero-padded to a multiple of the
block), quantized per block, multiplied by ``jax.nn.scaled_matmul`` into float32 ``(B, M, N)``, and reshaped to
the dot's layout ``(batch..., lhs free..., rhs free...)`` and dtype.

Scales are the smallest representable scale that makes the block fit the value format, so no value is
clipped by more than rounding (for mxfp8 blocks whose absmax lies above ``1.75 * 2**127``, one step of the format:
their codes stop at 240, as the next, 256, times their scale ``2**120`` would be beyond float32):

* mxfp8: ``scale = 2**ceil(log2(amax / 448))`` (what ``jax.nn.scaled_dot_general`` does), computed exactly
  from the float32 bits of ``amax`` and kept within float32's normal range (``2**-126 .. 2**127``).
* nvfp4: ``g = amax(tensor) / (6 * 448)`` (so block scales fit float8_e4m3fn), block scale = the smallest
  float8_e4m3fn value ``>= amax(block / g) / 6``; the value codes are ``block / g / scale`` rounded to
  float4_e2m1fn.

An all-zero block gets scale 1 and zero codes, so it contributes exact zeros. A block holding NaN or Inf gets
a NaN scale (both scale formats have NaN; float4_e2m1fn has none), so every output that depends on it comes
out NaN; nvfp4's tensor scale is taken over the finite values only, so other outputs are unaffected.

``jax.nn.scaled_matmul`` lowers only on CUDA (cuDNN) and ROCm, and cuDNN runs it on Blackwell GPUs only (compute
capability 10 and up). When an fp8/fp4 backend is first used, :func:`enable_emulation` gives its primitive a
lowering that computes the documented math (:func:`emulated_scaled_matmul`) on platforms where JAX has none (CPU),
and the rewrite picks the emulation on a GPU older than Blackwell (a Hopper H100/H200 has no block-scaled fp8), so
the very same rewritten program runs everywhere; it also generalises JAX's batching rule for it, so ``jax.vmap``
works with unbatched operands. Importing the package changes nothing in JAX. Gradients are straight-through, as
for int8.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _compat
from .._core.backends import register_backend, register_backend_alias
from .._interpret.config import RewriteConfig
from .._core.errors import Int8ifyError
from .._core.jaxprs import cuda_capability_major, default_device
from .._core.layout import blocked, contraction_size, free_axes
from .._dots.straight_through import straight_through
from .._numerics.float_formats import pow2
from .._numerics.quantize import absmax, epilogue_factors, scale_product


class BlockFormat(NamedTuple):
    """A block-scaled format of ``jax.nn.scaled_matmul`` (hashable: a static argument of the rewritten dot).

    Attributes:
        name: ``"mxfp8"`` or ``"nvfp4"``.
        value_dtype: dtype of the quantized values.
        scale_dtype: dtype of the per-block scales.
        block_size: elements of K per scale.
        value_max: the largest finite value of ``value_dtype``.
        tensor_scale: whether a second-level float32 per-tensor scale is used (nvfp4).
    """

    name: str
    value_dtype: object
    scale_dtype: object
    block_size: int
    value_max: float
    tensor_scale: bool


MXFP8 = BlockFormat("mxfp8", jnp.float8_e4m3fn, jnp.float8_e8m0fnu, 32, 448.0, False)
NVFP4 = BlockFormat("nvfp4", jnp.float4_e2m1fn, jnp.float8_e4m3fn, 16, 6.0, True)
FORMATS = {f.name: f for f in (MXFP8, NVFP4)}

_E4M3_MAX = 448.0
_F32_MIN_NORMAL = np.float32(2.0**-126)


class BlockQuantized(NamedTuple):
    """One operand quantized for ``scaled_matmul``.

    Attributes:
        codes: ``(B, M, K)`` values in the format's value dtype (K a multiple of the block size).
        scales: ``(B, M, K // block_size)`` in the format's scale dtype.
        tensor_scale: float32 scalar multiplying the whole operand (nvfp4), or ``None`` (mxfp8).
    """

    codes: jnp.ndarray
    scales: jnp.ndarray
    tensor_scale: jnp.ndarray | None


# -- layout ---------------------------------------------------------------------------------------------
def to_bmk(x, contract, batch, block_size: int):
    """Move ``x`` to the ``(B, M, K)`` layout of ``scaled_matmul`` in float32, K zero-padded to a multiple of
    ``block_size``.

    Arguments:
        x: a dot operand.
        contract, batch: its contracting and batch dims (in the dot's pairing order).
        block_size: the format's block size.

    Returns:
        A float32 array ``(prod(batch), prod(free), n_blocks * block_size)``.
    """
    x = x if x.dtype == np.float32 else lax.convert_element_type(x, np.float32)
    free = free_axes(x.ndim, contract, batch)
    b = contraction_size(x.shape, batch)
    m = contraction_size(x.shape, free)
    n_blocks = -(-contraction_size(x.shape, contract) // block_size)
    blocks = blocked(x, tuple(contract), tuple(batch), n_blocks, block_size)
    return lax.reshape(blocks, (b, m, n_blocks * block_size))


# -- quantization ---------------------------------------------------------------------------------------
def _split_blocks(x3, block_size: int):
    b, m, k = x3.shape
    return lax.reshape(x3, (b, m, k // block_size, block_size))


def _per_block(scales, blocks_shape):
    return lax.broadcast_in_dim(scales, blocks_shape, (0, 1, 2))


def _nan_where_not_finite(amax, scale):
    return lax.select(lax.is_finite(amax), scale, lax.full_like(scale, np.nan))


def mx_scale(amax):
    """``2**ceil(log2(amax / 448))`` in float32, exactly, clamped to ``[2**-126, 2**127]``; 1 where
    ``amax == 0``, NaN where it is not finite.

    With ``amax = m * 2**e`` (``1 <= m < 2``), ``ceil(log2(amax / 448)) = e - 8 + (m > 1.75)``, and
    ``m > 1.75`` is a comparison of the mantissa bits.
    """
    bits = lax.bitcast_convert_type(amax, np.int32)
    biased = lax.bitwise_and(lax.shift_right_logical(bits, np.int32(23)), np.int32(0xFF))
    mantissa = lax.bitwise_and(bits, np.int32(0x7FFFFF))
    exponent = lax.sub(biased, np.int32(127 + 8))
    exponent = lax.add(exponent, lax.convert_element_type(lax.gt(mantissa, np.int32(0x600000)), np.int32))
    exponent = lax.clamp(np.int32(-126), exponent, np.int32(127))
    scale = pow2(exponent)
    scale = lax.select(lax.eq(amax, np.float32(0)), lax.full_like(scale, 1.0), scale)
    return _nan_where_not_finite(amax, scale)


def round_up_e4m3(s):
    """The smallest float8_e4m3fn value ``>= s``, for ``0 <= s <= 448`` (NaN stays NaN)."""
    # a barrier between the two conversions: XLA's GPU compiler removes a float32 -> float8 -> float32 round trip
    # (xla_allow_excess_precision), which made ``below`` always false
    q = lax.optimization_barrier(lax.convert_element_type(s, jnp.float8_e4m3fn))
    below = lax.lt(lax.convert_element_type(q, np.float32), s)
    up = lax.bitcast_convert_type(
        lax.add(lax.bitcast_convert_type(q, np.uint8), np.uint8(1)), jnp.float8_e4m3fn
    )
    return lax.select(below, up, q)


# the largest mxfp8 scale float32 needs (``2**ceil(log2(max float32 / 448))``) and the largest float8_e4m3fn code
# whose value stays finite at it (``240 * 2**120``; the next code, 256, is ``2**128``)
_TOP_MX_SCALE, _TOP_MX_CODE = 2.0**120, 240.0


def quantize_mxfp8(x3) -> BlockQuantized:
    """mxfp8 quantization of a float32 ``(B, M, K)`` operand (K a multiple of 32)."""
    blocks = _split_blocks(x3, MXFP8.block_size)
    amax = absmax(blocks, (3,))
    scale = mx_scale(amax)
    scaled = lax.div(blocks, _per_block(scale, blocks.shape))
    # at the top scale a value rounded up to the code 256 would stand for 2**128, beyond float32: codes stop at 240
    top = lax.eq(scale, np.float32(_TOP_MX_SCALE))
    limit = _per_block(lax.select(top, lax.full_like(scale, _TOP_MX_CODE), lax.full_like(scale, MXFP8.value_max)),
                       blocks.shape)
    clipped = lax.clamp(lax.neg(limit), scaled, limit)
    codes = lax.reshape(lax.convert_element_type(clipped, MXFP8.value_dtype), x3.shape)
    return BlockQuantized(codes, lax.convert_element_type(scale, MXFP8.scale_dtype), None)


def nvfp4_tensor_scale(x3):
    """nvfp4's second-level scale: ``amax / (6 * 448)`` over the finite values of the operand (at least the
    smallest normal float32), 1 for an all-zero operand."""
    finite_abs = lax.select(lax.is_finite(x3), lax.abs(x3), lax.full_like(x3, 0.0))
    amax = lax.reduce_max(finite_abs, tuple(range(x3.ndim)))
    g = lax.max(lax.div(amax, np.float32(NVFP4.value_max * _E4M3_MAX)), _F32_MIN_NORMAL)
    return lax.select(lax.eq(amax, np.float32(0)), np.float32(1), g)


def quantize_nvfp4(x3) -> BlockQuantized:
    """nvfp4 quantization of a float32 ``(B, M, K)`` operand (K a multiple of 16)."""
    g = nvfp4_tensor_scale(x3)
    blocks = lax.div(_split_blocks(x3, NVFP4.block_size), g)
    amax = absmax(blocks, (3,))
    wanted = lax.min(lax.div(amax, np.float32(NVFP4.value_max)), np.float32(_E4M3_MAX))
    scale = round_up_e4m3(wanted)
    scale = lax.select(lax.eq(amax, np.float32(0)), lax.full_like(scale, 1.0), scale)
    scale = lax.select(lax.is_finite(amax), scale, lax.full_like(scale, np.nan))
    scaled = lax.div(blocks, _per_block(lax.convert_element_type(scale, np.float32), blocks.shape))
    clipped = lax.clamp(np.float32(-NVFP4.value_max), scaled, np.float32(NVFP4.value_max))
    codes = lax.reshape(lax.convert_element_type(clipped, NVFP4.value_dtype), x3.shape)
    return BlockQuantized(codes, scale, g)


def quantize_blocks(x3, fmt: BlockFormat) -> BlockQuantized:
    """Quantize a float32 ``(B, M, K)`` operand (K a multiple of ``fmt.block_size``) to ``fmt``."""
    return quantize_nvfp4(x3) if fmt.tensor_scale else quantize_mxfp8(x3)


# -- the rewritten dot ----------------------------------------------------------------------------------
def scaled_dot_general_impl(lhs, rhs, dimension_numbers, out_dtype, fmt: BlockFormat):
    """The block-scaled program for one ``dot_general`` (no gradient rule; see :data:`scaled_dot_general`)."""
    (lc, rc), (lb, rb) = dimension_numbers
    out_shape = (
        *(lhs.shape[a] for a in lb),
        *(lhs.shape[a] for a in free_axes(lhs.ndim, lc, lb)),
        *(rhs.shape[a] for a in free_axes(rhs.ndim, rc, rb)),
    )
    if contraction_size(lhs.shape, lc) == 0 or 0 in out_shape:
        return lax.full(out_shape, 0, out_dtype)
    lhs_q = quantize_blocks(to_bmk(lhs, lc, lb, fmt.block_size), fmt)
    rhs_q = quantize_blocks(to_bmk(rhs, rc, rb, fmt.block_size), fmt)
    if _needs_inline_emulation():
        # a GPU older than Blackwell: cuDNN has no block-scaled matmul there, so the math is emitted inline
        (out,) = emulated_scaled_matmul(lhs_q.codes, rhs_q.codes, lhs_q.scales, rhs_q.scales,
                                        preferred_element_type=jnp.float32)
    else:
        out = jax.nn.scaled_matmul(lhs_q.codes, rhs_q.codes, lhs_q.scales, rhs_q.scales,
                                   preferred_element_type=jnp.float32)
    if fmt.tensor_scale:
        out = tensor_scale_product(out, lhs_q.tensor_scale, rhs_q.tensor_scale)
    out = lax.reshape(out, out_shape)
    return out if out.dtype == out_dtype else lax.convert_element_type(out, out_dtype)


def tensor_scale_product(out, g_lhs, g_rhs):
    """``out * g_lhs * g_rhs`` for nvfp4's two float32 tensor scales, with no intermediate overflow or underflow
    unless the result itself overflows or underflows.

    Neither order of the two plain multiplies is safe: a tensor scale runs from ``2**-126`` to about ``2**117``
    and ``out`` up to ``K * 2688**2``, so ``out * g`` overflows for a huge operand whose partner is tiny (x ~ 1e37,
    w ~ 1e-37: Inf for a result of 16), and underflows to zero for a tiny one whose partner is huge; and the
    product ``g_lhs * g_rhs`` first underflows for two small operands (x ~ 1e-18, w ~ 1e-15: ~1e-40) where the
    result is an ordinary float32. So each scale is split as :func:`~jaxpr_rewrite._numerics.quantize.epilogue_factors`
    splits an int8 scale, into a factor within ``2**+-60`` and a power of two, and
    :func:`~jaxpr_rewrite._numerics.quantize.scale_product` applies them (see there why that is range-safe; a nonzero
    ``|out|`` lies in ``[2**-20, K * 2**23]``, its terms multiples of ``(0.5 * 2**-9)**2``, so ``out`` times a factor
    is a normal float for any contraction below ``2**44``). Where both scales lie within ``2**+-60`` (every ordinary
    operand) the powers are 1 and this is ``(out * g_lhs) * g_rhs`` bit for bit; elsewhere it is that same number
    wherever those intermediates are normal floats.
    """
    # scale_product multiplies by its rhs' factor first: the lhs goes there, so the powers of 1 leave the plain
    # (out * g_lhs) * g_rhs
    return scale_product(out, _tensor_scale_factors(g_rhs), _tensor_scale_factors(g_lhs))


def _tensor_scale_factors(g):
    """:func:`~jaxpr_rewrite._numerics.quantize.epilogue_factors` of a positive normal float32 scalar ``g`` (a tensor
    scale of :func:`nvfp4_tensor_scale`), held as its mantissa in ``[1, 2)`` times ``2**exponent``; both read off its
    bits exactly."""
    bits = lax.bitcast_convert_type(g, np.int32)
    exponent = lax.sub(lax.shift_right_logical(bits, np.int32(23)), np.int32(127))
    mantissa = lax.bitcast_convert_type(lax.bitwise_or(lax.bitwise_and(bits, np.int32(0x7FFFFF)),
                                                       np.int32(127 << 23)), np.float32)
    return epilogue_factors(mantissa, exponent)


def _scaled_impl(lhs, rhs, float_params, out_dtype, fmt: BlockFormat):
    return scaled_dot_general_impl(lhs, rhs, dict(float_params)["dimension_numbers"], out_dtype, fmt)


_scaled_impl.__name__ = "scaled_dot_general_impl"
scaled_dot_general = straight_through(_scaled_impl)
"""``scaled_dot_general(lhs, rhs, float_params, out_dtype, fmt)``: one float dot through
``jax.nn.scaled_matmul`` in ``fmt``, with a straight-through gradient."""


# -- emulation for platforms without a scaled_matmul lowering -------------------------------------------
def emulated_scaled_matmul(a, b, a_scales, b_scales, *, preferred_element_type):
    """The documented math of ``jax.nn.scaled_matmul`` in float32: ``a * repeat(a_scales, block)``,
    ``b * repeat(b_scales, block)``, ``einsum('BMK,BNK->BMN')``. Returns a one-element list (the
    primitive has multiple results)."""

    # the operands cross a barrier in their own dtypes: XLA's GPU compiler removes a float32 -> float8/float4 ->
    # float32 round trip (xla_allow_excess_precision), which left the inline emulation's codes and scales unrounded
    a, b, a_scales, b_scales = lax.optimization_barrier((a, b, a_scales, b_scales))

    def dequantize(x, scales):
        k = x.shape[-1]
        block = k // scales.shape[-1]
        s = jnp.repeat(scales.astype(jnp.float32), block, axis=-1, total_repeat_length=k)
        return x.astype(jnp.float32) * s

    out = lax.dot_general(
        dequantize(a, a_scales), dequantize(b, b_scales), (((2,), (2,)), ((0,), (0,))),
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    )
    return [out.astype(preferred_element_type)]


def enable_emulation() -> tuple[str, ...]:
    """Register :func:`emulated_scaled_matmul` as the ``scaled_matmul`` lowering on the platforms where JAX has
    none, and generalise its batching rule; called when an fp8/fp4 backend is first used (idempotent).

    Returns:
        The platforms that run the emulation.
    """
    _compat.register_emulated_lowering(emulated_scaled_matmul)
    _compat.generalize_batchers()
    return _compat.emulated_platforms()


# -- backends -------------------------------------------------------------------------------------------
def _device_is_blackwell(device) -> bool:
    if device.platform != "gpu":
        return False
    if getattr(device, "compute_capability", None):
        return (cuda_capability_major(device) or 0) >= 10  # ROCm's gfx name: not Blackwell
    kind = str(getattr(device, "device_kind", "")).upper()
    return any(tag in kind for tag in ("B100", "B200", "B300", "GB200", "GB300", "BLACKWELL"))


def is_blackwell() -> bool:
    """Whether the default device (:func:`~jaxpr_rewrite._core.jaxprs.default_device`) is an NVIDIA Blackwell GPU
    (compute capability >= 10)."""
    return _device_is_blackwell(default_device())


def _needs_inline_emulation() -> bool:
    device = default_device()
    return device.platform == "gpu" and not _device_is_blackwell(device)


def _check_options(config: RewriteConfig, fmt: BlockFormat):
    if config.block_size is not None or config.granularity != "per-channel":
        raise Int8ifyError(
            f"backend {fmt.name!r} has a fixed layout (one {np.dtype(fmt.scale_dtype).name} scale per block of "
            f"{fmt.block_size} along the contraction); granularity/block_size apply to the int8 backend only"
        )


def _format_backend(fmt: BlockFormat):
    def backend(lhs, rhs, float_params, out_dtype, config: RewriteConfig):
        _check_options(config, fmt)
        enable_emulation()
        return scaled_dot_general(lhs, rhs, float_params, out_dtype, fmt)

    backend.__name__ = f"{fmt.name}_backend"
    return register_backend(fmt.name)(backend)


mxfp8_backend = _format_backend(MXFP8)
nvfp4_backend = _format_backend(NVFP4)


@register_backend_alias("auto")
def auto_backend() -> str:
    """``"mxfp8"`` on an NVIDIA Blackwell GPU, where cuDNN runs it; ``"int8"`` everywhere else (a Hopper GPU's
    int8 tensor cores beat its emulated fp8)."""
    return "mxfp8" if is_blackwell() else "int8"
