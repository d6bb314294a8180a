"""One token's scales written into an int8 KV cache's per-slice arrays in place on XLA:TPU: a Pallas kernel.

A cache of ``[batch, tokens, heads, head_dim]`` holds its per-slice scales and exponents as ``[batch, tokens, heads]``
arrays, which XLA:TPU lays out with the tokens minor (a handful of heads would otherwise be padded to 128 lanes).
Written one decode token at a time with ``lax.dynamic_update_slice``, such an array is small enough that XLA:TPU
writes the token with a kernel that passes over the whole array in VMEM, four arrays a layer on every step.
:func:`write_token` writes the token with a kernel that touches one 128-token window: it copies the window that
holds the token into VMEM, sets the token's lane and copies the window back, the array aliased to the result. (XLA
may still hold the array in VMEM around it, for the attention epilogue that reads it.)

:func:`token_written` binds it as a primitive lowered to that kernel on TPU and to ``lax.dynamic_update_slice``
everywhere else (``mlir.register_lowering`` per platform), so that a program traced for a TPU also runs on a CPU,
and one exported for several platforms (``jax.export``) carries each platform's write; under ``jax.vmap`` and
``jax.jvp`` it is a ``dynamic_update_slice``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .._core.layout import is_static
from .tpu_layout import TPU_LANES  # a window of tokens: one lane tile of a 32-bit array

__all__ = ["token_written", "write_token", "writes_in_place"]

# the most VMEM one window may take (all the leading axes' slices of the window at once)
WINDOW_BYTES = 4 << 20


def _token_axis(array_shape: tuple, update_shape: tuple) -> int | None:
    """The one axis along which ``update`` is a single token of ``array``, every other axis whole; else None."""
    partial = [a for a, (n, m) in enumerate(zip(array_shape, update_shape)) if m != n]
    return partial[0] if len(partial) == 1 and update_shape[partial[0]] == 1 else None


def writes_in_place(array_shape: tuple, update_shape: tuple, dtype) -> bool:
    """Whether :func:`write_token` writes ``update`` into ``array``: a 32-bit array of rank 2 or more, the update one
    token along its last axis, or along its second-to-last where the last holds fewer than 128 (XLA:TPU then lays
    the tokens minor), the tokens a whole number of windows, and one window's slices within :data:`WINDOW_BYTES`."""
    if not all(is_static(n) for n in (*array_shape, *update_shape)):
        return False  # jax.export's symbolic shapes
    axis = _token_axis(array_shape, update_shape)
    rank = len(array_shape)
    if axis is None or rank < 2 or np.dtype(dtype).itemsize != 4:
        return False
    if axis != rank - 1 and not (axis == rank - 2 and array_shape[-1] < TPU_LANES):
        return False
    others = int(np.prod([n for a, n in enumerate(array_shape) if a != axis]))
    return array_shape[axis] % TPU_LANES == 0 and others * TPU_LANES * 4 <= WINDOW_BYTES


def write_token(array, update, *starts, interpret: bool = False):
    """``lax.dynamic_update_slice(array, update, starts)`` for an update :func:`writes_in_place` takes, in place.

    Arguments:
        array: the per-slice array, donated by the caller's ``jit`` for the write to be in place (otherwise XLA
            copies it first, as for any aliased operand).
        update: the token's values, ``array``'s dtype and shape with 1 along the token axis.
        starts: the update's start on each axis (0 on every axis but the token's); a token start past the end is
            clamped, as ``dynamic_update_slice`` clamps it.
        interpret: run the kernel in Pallas's TPU interpreter (tests on a CPU).

    Returns:
        ``array`` with ``update`` written.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    axis = _token_axis(array.shape, update.shape)
    last = array.ndim - 1
    if axis != last:  # the tokens minor, as XLA:TPU lays the array out: the swap is a relabelling, not a copy
        return jnp.swapaxes(write_token(jnp.swapaxes(array, axis, last), jnp.swapaxes(update, axis, last),
                                        *_swapped(starts, axis, last), interpret=interpret), axis, last)
    tokens = array.shape[-1]
    position = lax.clamp(np.int32(0), lax.convert_element_type(starts[-1], np.int32), np.int32(tokens - 1))

    def kernel(position_ref, update_ref, array_hbm, out_hbm, window, semaphore):
        del array_hbm  # aliased to out_hbm
        # the window's start, a multiple of TPU_LANES (positions are never negative: lax.div's truncation is a floor)
        start = pl.multiple_of(lax.mul(lax.div(position_ref[0], np.int32(TPU_LANES)), np.int32(TPU_LANES)), TPU_LANES)
        tokens_window = out_hbm.at[..., pl.ds(start, TPU_LANES)]
        copy = pltpu.make_async_copy(tokens_window, window, semaphore)
        copy.start()
        copy.wait()
        lane = lax.broadcasted_iota(np.int32, window.shape, window.ndim - 1)
        window[...] = jnp.where(lane == position_ref[0] - start, update_ref[...], window[...])
        copy = pltpu.make_async_copy(window, tokens_window, semaphore)
        copy.start()
        copy.wait()

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(array.shape, array.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(),
            in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pltpu.HBM)],
            out_specs=pl.BlockSpec(memory_space=pltpu.HBM),
            scratch_shapes=[pltpu.VMEM((*array.shape[:-1], TPU_LANES), array.dtype), pltpu.SemaphoreType.DMA]),
        input_output_aliases={2: 0},
        interpret=interpret,
    )(jnp.reshape(position, (1,)), update, array)


def _swapped(starts: tuple, a: int, b: int) -> tuple:
    starts = list(starts)
    starts[a], starts[b] = starts[b], starts[a]
    return tuple(starts)


def _updated(array, update, *starts):
    return lax.dynamic_update_slice_p.bind(array, update, *starts)  # the primitive: its starts clamped, never wrapped


# ``lax.dynamic_update_slice(array, update, starts)`` of an update :func:`writes_in_place` takes: the in-place kernel
# on TPU, the plain write elsewhere
token_write_p = Primitive("int8ify_token_write")
token_write_p.def_impl(_updated)
token_write_p.def_abstract_eval(lambda array, update, *starts: array)


def _batched(args, dims):
    return jax.vmap(_updated, in_axes=tuple(dims))(*args), 0


def _jvp(primals, tangents):
    array, update, *starts = primals
    array_dot, update_dot = (ad.instantiate_zeros(t) for t in tangents[:2])
    return token_write_p.bind(*primals), _updated(array_dot, update_dot, *starts)


batching.primitive_batchers[token_write_p] = _batched
ad.primitive_jvps[token_write_p] = _jvp
mlir.register_lowering(token_write_p, mlir.lower_fun(_updated, multiple_results=False))
mlir.register_lowering(token_write_p, mlir.lower_fun(write_token, multiple_results=False), platform="tpu")


def token_written(array, update, *starts):
    """``lax.dynamic_update_slice(array, update, starts)``, by :func:`write_token` where the program runs on a TPU;
    ``update`` must be one :func:`writes_in_place` takes."""
    return token_write_p.bind(array, lax.convert_element_type(update, array.dtype),
                              *(lax.convert_element_type(start, np.int32) for start in starts))
