"""An int8 KV cache, quantized once: :func:`quantize_cache`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._dots.operands import quantize
from .._quantized.array import is_quantized

__all__ = ["quantize_cache"]


def quantize_cache(cache, axis: int = -1):
    """A KV cache held as int8 codes with one float32 scale per slice over ``axis``: per token and head over its
    ``head_dim`` for the usual ``[batch, tokens, heads, head_dim]`` layout.

    Pass the result to an ``int8ify``'d decode step in place of the float cache, and take it back from the step as
    it returns it. Inside the step, float keys and values written into it (``lax.dynamic_update_slice``,
    ``cache.at[:, pos].set(k)``, in ``fori_loop``/``scan`` decode loops too) are quantized once, each slice with its
    own scale (the contract's ``absmax / 127``, codes and scales bit for bit those of :func:`~jaxpr_rewrite.quantize`),
    and the rest of the cache is untouched. Attention's dots read the codes in int8 x int8 -> int32 dots:
    ``q . k`` contracts the keys over the axes their scales cover, the contract's per-slice scales; ``p . v``
    contracts the values over the tokens their scales run along, so each value scale is folded into ``p`` before
    ``p`` is quantized (``sum_s p[s] v[s] = sum_s (p[s] * s_v[s]) v_q[s]``). The cache comes back from the step
    quantized, in its layout. Any other use of it (an elementwise op, a write of part of a slice) reads its float
    value, ``codes * scales``.

    A zero array quantizes to codes 0 and scales 1: a position never written reads as zero. The bytes are about half
    of a bfloat16 cache's: one byte per value, and per slice a float32 scale and an int32 exponent (the scale is held
    as ``scales * 2**exponents``, exact over float32's whole range).

    Arguments:
        cache: a pytree (a dict of per-layer ``{"k": ..., "v": ...}``, an ``nnx.State``); its floating arrays are
            quantized, every other leaf (positions, integer arrays, already quantized arrays) kept.
        axis: the axis one scale covers (``head_dim``); negative ones count from the end.

    Returns:
        The same pytree with each floating array a :class:`~jaxpr_rewrite.QuantizedArray`.
    """

    def quantized(leaf):
        if is_quantized(leaf) or not (isinstance(leaf, jax.Array) or hasattr(leaf, "__array__")):
            return leaf
        leaf = jnp.asarray(leaf)
        return quantize(leaf, axis).replace(cache=True) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf

    return jax.tree_util.tree_map(quantized, cache, is_leaf=is_quantized)
