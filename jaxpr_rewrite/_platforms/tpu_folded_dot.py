"""Attention's ``p . v`` over an int8 KV cache in one Pallas TPU kernel: ``p * s_v`` quantized per row and summed
against the value codes, as the cache is streamed from HBM.

The folded dot (:func:`~jaxpr_rewrite._dots.int8_dot._folded_scales_dot`) multiplies ``p`` by each token's value
scale, quantizes each row of ``p * s_v`` over the tokens and takes the int8 dot with the value codes. XLA:TPU runs
the rows' absmax and their codes as passes of their own between attention's two dots, vector work during which
nothing reads the cache. This kernel does that work per batch index in VMEM, while the next batch index's value
codes stream in: for each key-value head, the head's rows of ``p`` times the tokens' factors, the contract's codes
and scales of each row (the same functions as the program outside, traced into the kernel), and their int8 x int8
-> int32 dot with the head's codes. The epilogue stays outside, the same multiplies as the program's.

:func:`folded_dot` binds it as a primitive lowered to the kernel on TPU and to the same kernel in Pallas's
interpreter everywhere else (``mlir.register_lowering`` per platform), so that a program traced for a TPU runs, and is
tested, on a CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from .._core.layout import is_static
from .._numerics.quantize import quantize_with_factors, to_compute
from .._quantized.array import is_quantized

__all__ = ["folded_dot", "folded_dot_fits", "folded_dot_sums"]

# the most VMEM one batch index's blocks may take (double-buffered by the pipeline)
BLOCK_BYTES = 4 << 20


def folded_dot_fits(values_shape: tuple, codes_shape: tuple) -> bool:
    """Whether :func:`folded_dot_sums` takes ``p`` ``[batch, heads, rows, tokens]`` and value codes
    ``[batch, tokens, heads, head_dim]``: static shapes that agree, 128-multiples of tokens and head_dim, and one
    batch index's blocks within :data:`BLOCK_BYTES`."""
    if not all(is_static(n) for n in (*values_shape, *codes_shape)) or len(values_shape) != 4 or len(codes_shape) != 4:
        return False
    batch, heads, rows, tokens = values_shape
    if codes_shape[:3] != (batch, tokens, heads):
        return False
    head_dim = codes_shape[3]
    block = heads * rows * tokens * 4 + 2 * heads * tokens * 4 + tokens * heads * head_dim + heads * rows * head_dim * 4
    return tokens % 128 == 0 and head_dim % 128 == 0 and block <= BLOCK_BYTES


def folded_dot_sums(values, factor, power, codes, *, interpret: bool = False):
    """The int8 sums of ``quantize(p * factor * power) . codes`` per key-value head, and the rows' epilogue factors.

    Arguments:
        values: ``p`` as float32, ``[batch, heads, rows, tokens]``.
        factor, power: the value cache's epilogue factors per token, ``[batch, heads, tokens]`` (``s_v`` is
            ``factor * power``, multiplied into ``p`` in that order, as the program outside does).
        codes: the value cache's int8 codes, ``[batch, tokens, heads, head_dim]``, read as stored.
        interpret: run the kernel in Pallas's TPU interpreter (tests on a CPU).

    Returns:
        ``(sums, row_factor, row_power)``: int32 ``[batch, heads, rows, head_dim]``, and each row's epilogue factors
        ``[batch, heads, rows, 1]`` (:func:`~jaxpr_rewrite._numerics.quantize.epilogue_factors` of its scale).
    """
    from jax.experimental import pallas as pl

    batch, heads, rows, tokens = values.shape
    head_dim = codes.shape[3]

    def kernel(values_ref, factor_ref, power_ref, codes_ref, sums_ref, row_factor_ref, row_power_ref):
        for head in range(heads):
            folded = lax.mul(lax.mul(values_ref[head], factor_ref[pl.ds(head, 1), :]), power_ref[pl.ds(head, 1), :])
            row_codes, _, _, (row_factor, row_power) = quantize_with_factors(folded, (1,))
            head_codes = codes_ref[:, head, :]
            sums_ref[head] = jnp.dot(row_codes, head_codes, preferred_element_type=jnp.int32)  # noqa: JX101
            row_factor_ref[head] = row_factor[:, None]
            row_power_ref[head] = row_power[:, None]

    per_batch = lambda b: (b, 0, 0, 0)  # noqa: E731
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((batch, heads, rows, head_dim), np.int32),
                   jax.ShapeDtypeStruct((batch, heads, rows, 1), np.float32),
                   jax.ShapeDtypeStruct((batch, heads, rows, 1), np.float32)),
        grid=(batch,),
        in_specs=[pl.BlockSpec((None, heads, rows, tokens), per_batch),
                  pl.BlockSpec((None, heads, tokens), lambda b: (b, 0, 0)),
                  pl.BlockSpec((None, heads, tokens), lambda b: (b, 0, 0)),
                  pl.BlockSpec((None, tokens, heads, head_dim), per_batch)],
        out_specs=(pl.BlockSpec((None, heads, rows, head_dim), per_batch),
                   pl.BlockSpec((None, heads, rows, 1), per_batch),
                   pl.BlockSpec((None, heads, rows, 1), per_batch)),
        interpret=interpret,
    )(values.astype(np.float32), factor, power, codes)


def _sums_avals(values, factor, power, codes):
    batch, heads, rows, _ = values.shape
    return (jax.core.ShapedArray((batch, heads, rows, codes.shape[3]), np.int32),
            jax.core.ShapedArray((batch, heads, rows, 1), np.float32),
            jax.core.ShapedArray((batch, heads, rows, 1), np.float32))


def _interpreted(values, factor, power, codes):
    return folded_dot_sums(values, factor, power, codes, interpret=True)


# folded_dot_sums: the kernel on TPU, the kernel interpreted elsewhere
folded_sums_p = Primitive("int8ify_folded_dot_sums")
folded_sums_p.multiple_results = True
folded_sums_p.def_impl(_interpreted)
folded_sums_p.def_abstract_eval(_sums_avals)


def _batched(args, dims):
    """The mapped axis folded into the batch axis (an unmapped operand broadcast along it)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    front = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
             for a, d in zip(args, dims)]
    outs = folded_sums_p.bind(*(a.reshape(size * a.shape[1], *a.shape[2:]) for a in front))
    return [o.reshape(size, -1, *o.shape[1:]) for o in outs], [0, 0, 0]


batching.primitive_batchers[folded_sums_p] = _batched
mlir.register_lowering(folded_sums_p, mlir.lower_fun(_interpreted, multiple_results=True))
mlir.register_lowering(folded_sums_p, mlir.lower_fun(folded_dot_sums, multiple_results=True), platform="tpu")


def folded_dot(other, quantized, dimension_numbers, side: int, out_dtype):
    """The folded dot of a float operand ``other`` (``p``) and a KV cache's value codes ``quantized`` by the kernel,
    or ``None`` where it does not fit: the cache ``[batch, tokens, heads, head_dim]`` with one float32 scale per
    token and head, contracted over its tokens and batched over batch and heads; ``p`` contracted over one axis.

    The same numbers as :func:`~jaxpr_rewrite._dots.int8_dot._folded_scales_dot`: the same folded values, codes
    and row scales, the same int32 sums, and its epilogue ``(sums * f) * g`` (the value side's unit scales multiply
    by one).
    """
    (lc, rc), (lb, rb) = dimension_numbers
    q_contracting, q_batch, o_contracting, o_batch = (rc, rb, lc, lb) if side == 1 else (lc, lb, rc, rb)
    if not (is_quantized(quantized) and quantized.bits == 8 and quantized.codes.ndim == 4
            and quantized.contracting == (3,) and tuple(q_contracting) == (1,) and sorted(q_batch) == [0, 2]
            and len(o_contracting) == 1 and np.dtype(quantized.scale_dtype) == np.float32
            and np.dtype(out_dtype) in (np.float32, np.dtype(jnp.bfloat16), np.float16)
            and jnp.issubdtype(other.dtype, jnp.floating) and np.dtype(other.dtype).itemsize <= 4):
        return None
    partner = dict(zip(q_batch, o_batch))  # the cache's batch and heads axes -> p's
    free = [a for a in range(other.ndim) if a not in o_batch and a not in o_contracting]
    values = lax.transpose(to_compute(other), (partner[0], partner[2], *free, o_contracting[0]))
    batch, heads, tokens = values.shape[0], values.shape[1], values.shape[-1]
    free_shape = values.shape[2:-1]
    values = values.reshape(batch, heads, int(np.prod(free_shape, dtype=int)), tokens)
    if not folded_dot_fits(values.shape, quantized.codes.shape):
        return None
    factor, power = (lax.transpose(f, (0, 2, 1)) for f in quantized.epilogue_factors(np.float32))
    sums, row_factor, row_power = folded_sums_p.bind(values, factor, power, quantized.codes)
    # scale_product's ((acc * f_v) * f_p) * g_v) * g_p with the value side's unit factors f_v = g_v = 1
    out = lax.mul(lax.mul(lax.convert_element_type(sums, np.float32), jnp.broadcast_to(row_factor, sums.shape)),
                  jnp.broadcast_to(row_power, sums.shape))
    out = out.reshape(batch, heads, *free_shape, out.shape[-1])
    # the dot's output order: its batch axes (the cache's, in the dimension numbers' order), lhs free, rhs free
    batch_order = [0 if a == 0 else 1 for a in q_batch]
    free_axes = list(range(2, 2 + len(free_shape)))
    head_dim_axis = [out.ndim - 1]
    return lax.transpose(out, (*batch_order, *(free_axes + head_dim_axis if side == 1 else head_dim_axis + free_axes)))
