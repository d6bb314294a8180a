"""Shape primitives: a quantized array keeps its codes through the layout operations that move whole slices (a KV
cache's heads repeated for grouped-query attention, an axis added or dropped, a slice of positions), and how the
command line's diff shows them.

Each rule applies the operation to the codes and the same operation, restricted to the axes the scales run over,
to the scales (and the other per-slice arrays). An operation that would cut or spread a slice (the axes one scale
covers resized, reshaped or sliced) returns ``None``: the array is then materialised and the operation is the float
program's.
"""

from __future__ import annotations

from jax import lax

from ..._quantized.array import QuantizedArray, is_quantized
from .registry import RuleContext, register

__all__ = []

_PER_SLICE = ("scales", "exponents", "epilogue_factor", "epilogue_power")


def _movable(array) -> QuantizedArray | None:
    """``array`` with int8 codes when its slices can move whole (no blocks, no smoothing factors), else ``None``."""
    if not is_quantized(array) or array.block_size is not None or array.smooth is not None:
        return None
    return array.unpacked()


def _moved(array: QuantizedArray, per_element, per_slice, contracting) -> QuantizedArray:
    """``array`` with its codes (and its kept float value) moved by ``per_element``, each present per-slice array by
    ``per_slice``, and its contracting axes now ``contracting`` (axes of the moved codes)."""
    changes = {name: per_slice(getattr(array, name)) for name in _PER_SLICE if getattr(array, name) is not None}
    codes = per_element(array.codes)
    ndim = len(codes.shape)
    from_end = tuple(sorted(a - ndim for a in contracting))
    value = None if array.value is None else per_element(array.value)
    return array.replace(codes=codes, value=value, from_end=from_end, **changes)


def _broadcast_quantized(context: RuleContext, eqn, invals):
    """Broadcast along the kept axes and new ones (``jnp.repeat`` of a cache's key-value heads): the scales
    broadcast likewise; a contracting axis must keep its size."""
    array = _movable(invals[0])
    if array is None or len(invals) > 1:  # (a dynamic shape's operands)
        return None
    shape, dims = tuple(eqn.params["shape"]), tuple(eqn.params["broadcast_dimensions"])
    contracting = tuple(dims[a] for a in array.contracting)
    if any(shape[dims[a]] != array.shape[a] for a in array.contracting):
        return None
    out_kept = [d for d in range(len(shape)) if d not in contracting]
    kept_dims = tuple(out_kept.index(dims[a]) for a in array.kept_axes)
    kept_shape = tuple(shape[d] for d in out_kept)
    return [_moved(array, lambda v: lax.broadcast_in_dim(v, shape, dims),
                   lambda v: lax.broadcast_in_dim(v, kept_shape, kept_dims), contracting)]


def _reshape_quantized(context: RuleContext, eqn, invals):
    """A reshape of the kept axes in front of trailing contracting axes that it leaves as they are (a cache's heads
    and groups merged): the scales reshaped to the new leading shape."""
    array = _movable(invals[0])
    if array is None or len(invals) > 1 or eqn.params.get("dimensions") is not None:
        return None
    sizes = tuple(eqn.params["new_sizes"])
    n = len(array.contracting)
    trailing = tuple(range(array.ndim - n, array.ndim))
    if array.contracting != trailing or n > len(sizes) or sizes[len(sizes) - n:] != array.shape[array.ndim - n:]:
        return None
    contracting = tuple(range(len(sizes) - n, len(sizes)))
    return [_moved(array, lambda v: lax.reshape(v, sizes), lambda v: lax.reshape(v, sizes[:len(sizes) - n]),
                   contracting)]


def _squeeze_quantized(context: RuleContext, eqn, invals):
    """Size-1 kept axes dropped: the scales drop them too."""
    array = _movable(invals[0])
    if array is None:
        return None
    dropped = tuple(int(d) % array.ndim for d in eqn.params["dimensions"])
    if any(d in array.contracting for d in dropped):
        return None
    contracting = tuple(a - sum(d < a for d in dropped) for a in array.contracting)
    kept_dropped = tuple(array.kept_axes.index(d) for d in dropped)
    return [_moved(array, lambda v: lax.squeeze(v, dropped), lambda v: lax.squeeze(v, kept_dropped), contracting)]


def _slice_quantized(context: RuleContext, eqn, invals):
    """A slice of the kept axes, the contracting axes whole: the scales sliced likewise."""
    array = _movable(invals[0])
    if array is None:
        return None
    p = eqn.params
    starts, limits = tuple(p["start_indices"]), tuple(p["limit_indices"])
    strides = tuple(p["strides"]) if p["strides"] is not None else (1,) * array.ndim
    if any((starts[a], limits[a], strides[a]) != (0, array.shape[a], 1) for a in array.contracting):
        return None
    kept = array.kept_axes

    def per_slice(value):
        return lax.slice(value, [starts[a] for a in kept], [limits[a] for a in kept], [strides[a] for a in kept])

    return [_moved(array, lambda v: lax.slice(v, starts, limits, strides), per_slice, array.contracting)]


def _dynamic_slice_quantized(context: RuleContext, eqn, invals):
    """A dynamic slice of the kept axes, the contracting axes whole: the scales sliced at the same starts (the
    primitive's: a negative one clamped to 0, not counted from the end again)."""
    array, *starts = invals
    array = _movable(array)
    sizes = tuple(eqn.params["slice_sizes"])
    if array is None or len(starts) != array.ndim or any(sizes[a] != array.shape[a] for a in array.contracting):
        return None
    kept = array.kept_axes

    def per_slice(value):
        return lax.dynamic_slice_p.bind(value, *[starts[a] for a in kept], slice_sizes=tuple(sizes[a] for a in kept))

    return [_moved(array, lambda v: lax.dynamic_slice_p.bind(v, *starts, slice_sizes=sizes), per_slice,
                   array.contracting)]


def _label_broadcast(params) -> list[str]:
    return [f"broadcast_dimensions={tuple(params['broadcast_dimensions'])}"]


register("broadcast_in_dim", quantized=_broadcast_quantized, label=_label_broadcast)
register("reshape", quantized=_reshape_quantized)
register("squeeze", quantized=_squeeze_quantized)
register("slice", quantized=_slice_quantized)
register("dynamic_slice", quantized=_dynamic_slice_quantized)
