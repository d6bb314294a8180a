"""The layout XLA:TPU reads an int8 dot's codes in, asked of the float operand they are computed from.

XLA:TPU writes an operand's int8 codes in the layout of the float array they are computed from, and copies them into
the layout its dot reads when the two differ. Both are tiled (8 or 32 rows by 128 lanes) and an int8 relayout
repacks four codes per word, so the copy is dear: in a ViT-style transformer block at 197 tokens (d 384, batch 128,
weights quantized once) four such copies took 2.4 of its 4.8 ms on a TPU v5e chip, and the float program has none
(benchmarks/results/tpu-v5-lite.md). XLA relayouts the float array instead, where it is cheap, when the float
operand itself is constrained to the layout the dot reads: the same block took 2.6 ms.

The layouts are those XLA:TPU chose for the dots' codes in that block (a v5e, libtpu of JAX 0.10); a dot whose
operands fill XLA's tiles (at 128 tokens) has no copy, and its program is left as it is:

* a batched dot's operand with dynamic scales (attention's ``q . k`` and ``p . v``): the batch axes major, the
  other axes ordered by size, the largest minor, where that axis is not a multiple of 128 and not the minor one
  already (XLA's copy of codes that keeps their minor axis is cheaper than the float relayout that would replace
  it: at 50 tokens, where the head's 64 features are the largest axis, the block took 1.10x its time with such
  operands laid out);
* an unbatched dot of an activation with more than two axes (a Dense layer over ``(batch, tokens, features)``): the
  free axes that are not a multiple of 128 major, the contraction minor, where some free axis is not one.

The constraint is an identity everywhere else: on CPU and GPU, in a program ``jax.export`` serializes (XLA's layout
constraint is no custom call with a compatibility guarantee, so an exported program keeps XLA's layouts), and under
``jax.vmap``, ``jax.jvp`` and ``jax.grad`` it goes along with its operand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .. import _compat
from .._core.layout import is_static
from .._quantized.activations import ScaledActivation

__all__ = ["dot_operand_layout", "laid_out_for_tpu"]

# The lanes of a TPU vreg: an axis of this many elements (or a multiple) fills the minor dimension of XLA's tiles.
TPU_LANES = 128

# A float operand in the layout ``major_to_minor`` on TPU; the operand itself elsewhere.
tpu_layout_p = Primitive("int8ify_tpu_layout")
tpu_layout_p.def_impl(lambda x, *, major_to_minor: x)
tpu_layout_p.def_abstract_eval(lambda x, *, major_to_minor: x)
ad.deflinear2(tpu_layout_p, lambda ct, _, *, major_to_minor: [tpu_layout_p.bind(ct, major_to_minor=major_to_minor)])


def _batched(args, dims, *, major_to_minor):
    (x,), (axis,) = args, dims  # (JAX calls a batching rule only with a mapped operand: its one is)
    # the mapped axis goes in front, the most major; the operand's axes keep their order after it
    x = jnp.moveaxis(x, axis, 0)
    return tpu_layout_p.bind(x, major_to_minor=(0, *(a + 1 for a in major_to_minor))), 0


batching.primitive_batchers[tpu_layout_p] = _batched


def _lowering(ctx, x, *, major_to_minor):
    return [x]


def _tpu_lowering(ctx, x, *, major_to_minor):
    if _compat.lowering_for_export(ctx):
        return [x]
    constrained = mlir.lower_fun(lambda v: with_layout_constraint(v, Layout(major_to_minor=major_to_minor)),
                                 multiple_results=False)
    return constrained(ctx, x)


mlir.register_lowering(tpu_layout_p, _lowering)
mlir.register_lowering(tpu_layout_p, _tpu_lowering, platform="tpu")


def dot_operand_layout(shape, batch_axes, contracting_axes) -> tuple[int, ...] | None:
    """The layout (major to minor) a dot operand of ``shape`` takes on TPU, or ``None`` to leave it to XLA.

    Arguments:
        shape: the operand's shape.
        batch_axes, contracting_axes: its axes in the dot's dimension numbers.

    Returns:
        A permutation of the axes, or ``None`` for an operand of two axes or fewer, one the module's rules leave to
        XLA, one with a symbolic dim (``jax.export``), and one already in that layout.
    """
    if len(shape) < 3 or not all(is_static(size) for size in shape):
        return None
    others = [axis for axis in range(len(shape)) if axis not in batch_axes]
    if batch_axes:
        order = (*batch_axes, *sorted(others, key=lambda axis: shape[axis]))
        left_to_xla = shape[order[-1]] % TPU_LANES == 0 or order[-1] == len(shape) - 1
    else:
        free = [axis for axis in others if axis not in contracting_axes]
        order = (*sorted(free, key=lambda axis: shape[axis] % TPU_LANES == 0), *contracting_axes)
        left_to_xla = all(shape[axis] % TPU_LANES == 0 for axis in free)
    return None if left_to_xla or order == tuple(range(len(shape))) else order


def laid_out_for_tpu(operand, batch_axes, contracting_axes):
    """``operand``, a float array, constrained on TPU to :func:`dot_operand_layout`; a pre-quantized operand, a
    :class:`ScaledActivation` (attention's operands with calibrated static scales), or one left to XLA, as it is.
    (An activation quantized with its weight's static scale is a float array here, and is laid out: the block at
    d 384 with static scales took 0.855x its time so, its attention operands left to XLA.)

    A :class:`ScaledActivation` is quantized by one multiply, a round and a clip, which read its float values once:
    laid out, its float values were relayouted where XLA had relayouted its codes, and the transformer block at d 768
    (batch 128 x 197 tokens, static scales, attention's too) took 1.19x its time on the chip, where the dynamic
    program, whose absmax pass reads them too, took 0.95x."""
    if isinstance(operand, ScaledActivation) or not (
            isinstance(operand, jax.Array) and jnp.issubdtype(operand.dtype, jnp.floating)):
        return operand
    order = dot_operand_layout(operand.shape, tuple(batch_axes), tuple(contracting_axes))
    return operand if order is None else tpu_layout_p.bind(operand, major_to_minor=order)
