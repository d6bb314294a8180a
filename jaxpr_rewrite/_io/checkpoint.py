"""Quantized checkpoints with Orbax: :func:`save_quantized` and :func:`load_quantized`.

A pytree holding :class:`~jaxpr_rewrite.quantized.QuantizedArray` leaves is an ordinary pytree, so Orbax's
``StandardCheckpointer`` saves it and restores it onto an abstract target as it is (each child keyed by name:
``w1.codes``, ``w1.scales``, ...). What a plain Orbax checkpoint cannot do is come back *without* that target:
Orbax then returns dicts, and the contracting axes, dtype and bit width of each weight are gone. These two functions
store the pytree in :mod:`jaxpr_rewrite._quantized.stored`'s layout instead, as one Orbax composite checkpoint of two
items, ``tensors`` (the named tensors, Orbax's standard pytree format) and ``layout`` (the JSON layout document), so a
checkpoint restores in another process from the directory alone, or onto a (sharded) target.

Needs the ``deploy`` extra (``pip install 'int8ify[deploy]'``), which brings ``orbax-checkpoint``.
"""

from __future__ import annotations

import os
import re

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from .._core.errors import Int8ifyError
from .._quantized.array import ARRAY_FIELDS, FIELD_AXES, is_quantized
from .._quantized.stored import abstract_tensors, check_layout, leaf_of_tensor, rebuild, to_stored

__all__ = ["load_quantized", "save_quantized", "sharded_like"]


def save_quantized(directory, tree, *, force: bool = False) -> None:
    """Save a pytree of arrays and ``QuantizedArray`` leaves as an Orbax checkpoint.

    Arguments:
        directory: the checkpoint directory (created; it must not exist unless ``force``).
        tree: the pytree (``quantize_params``'s output, say); sharded arrays are saved shard by shard.
        force: overwrite an existing checkpoint.
    """
    tensors, layout = to_stored(tree)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(os.path.abspath(directory), ocp.args.Composite(
            tensors=ocp.args.StandardSave(tensors), layout=ocp.args.JsonSave(layout)), force=force)


def load_quantized(directory, target=None):
    """Load a checkpoint written by :func:`save_quantized`.

    Arguments:
        directory: the checkpoint directory.
        target: ``None``, or a pytree like the saved one whose leaves are arrays, ``jax.ShapeDtypeStruct`` or
            ``QuantizedArray`` ones of those (``jax.eval_shape`` of ``quantize_params``, say): the result then has
            its structure and each array its sharding. Without one, the result is nested dicts and lists on the
            default device.

    Returns:
        The pytree, bit-identical to the one saved.

    Raises:
        Int8ifyError: no such checkpoint, one of another layout version, a target that does not fit (naming the
            leaf), or a tensor that cannot be read (naming its leaf).
    """
    path = os.path.abspath(directory)
    if not os.path.isdir(path):
        raise Int8ifyError(f"no checkpoint at {directory}")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        try:
            layout = checkpointer.restore(path, ocp.args.Composite(layout=ocp.args.JsonRestore())).layout
        except (OSError, ValueError, KeyError) as e:
            raise Int8ifyError(f"{directory} is not a checkpoint written by save_quantized ({e})") from None
        check_layout(layout, f"the checkpoint {directory}")
        abstract = abstract_tensors(layout, target)
        try:
            tensors = checkpointer.restore(path, ocp.args.Composite(tensors=ocp.args.StandardRestore(abstract)))
        except Exception as e:  # tensorstore and Orbax raise many types; name the leaf whichever it is
            raise Int8ifyError(f"the checkpoint {directory} could not be read: {_failed_leaf(layout, e)}: "
                               f"{type(e).__name__}: {str(e)[:300]}") from e
    return rebuild(layout, tensors.tensors, target)


def _failed_leaf(layout, error: Exception) -> str:
    """The leaf whose tensor an Orbax error names (TensorStore writes its path as ``'<tensor name>/'`` or
    ``"<tensor name>/.zarray"``), or a general description."""
    message = str(error)
    named = [(found.start(), name) for name in layout["tensors"]
             for found in [re.search(f"[\"']{re.escape(name)}/", message)] if found]
    return leaf_of_tensor(layout, min(named)[1]) if named else "reading its tensors failed"


def sharded_like(tree, shardings):
    """An abstract target for :func:`load_quantized` whose quantized leaves are sharded like their float weights.

    Arguments:
        tree: the quantized pytree or its abstract version (``jax.eval_shape(lambda p: p, qparams)``).
        shardings: a pytree of the same structure holding, for each leaf, the sharding of the float array it
            stands for (what the float params would be placed with).

    Returns:
        ``tree`` with every array a ``jax.ShapeDtypeStruct`` carrying a sharding: a ``QuantizedArray``'s codes
        get its float weight's ``NamedSharding`` (4-bit codes keep their packed last axis whole where the float
        weight's shards of it hold an odd number of columns: a byte would straddle two shards), its scales and
        exponents the spec of the weight's kept axes, SmoothQuant factors that of its contracting axis
        (:data:`~jaxpr_rewrite._quantized.array.FIELD_AXES`); any other sharding is used for every child as it is.
    """
    def place(leaf, sharding):
        if not is_quantized(leaf):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        spec = (*sharding.spec, *(None,) * (leaf.ndim - len(sharding.spec))) if isinstance(
            sharding, NamedSharding) else None

        def child(name):
            value = getattr(leaf, name)
            if value is None:
                return None
            if spec is None:
                return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
            axes = FIELD_AXES[name](leaf) if name in FIELD_AXES else ()
            entries = [spec[a] if a is not None else None for a in axes]
            packed = name == "codes" and leaf.bits != 8 and bool(entries)
            if packed and not _divides(sharding.mesh, entries[-1], value.shape[-1]):
                # 4-bit codes pack two columns per byte: where the float weight's shards hold an odd number of
                # columns, no byte boundary falls between them, and the packed axis is kept whole on each device
                entries[-1] = None
            child_sharding = NamedSharding(sharding.mesh, PartitionSpec(*entries))
            return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=child_sharding)

        return type(leaf).tree_unflatten(leaf.tree_flatten()[1], [child(name) for name in ARRAY_FIELDS])

    return jax.tree_util.tree_map(place, tree, shardings, is_leaf=is_quantized)


def _divides(mesh, entry, length: int) -> bool:
    """Whether a spec entry (a mesh axis name, a tuple of them, or ``None``) cuts an axis of ``length`` evenly."""
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return length % int(np.prod([mesh.shape[name] for name in names])) == 0
