"""The stored layout of a quantized pytree: named tensors plus one JSON document that says how they fit together.

Checkpoints (:mod:`jaxpr_rewrite._io.checkpoint`, Orbax) and portable files (:mod:`jaxpr_rewrite._io.safetensors_io`,
SafeTensors) both store a pytree of arrays and :class:`~jaxpr_rewrite.quantized.QuantizedArray` leaves this way, so
a file can be read without the float params, the code that made it, or a target pytree:

* every array leaf is one tensor, named by its path (``layers.0.attn.w``: dict keys, sequence indices and
  attribute names joined by ``.``);
* every ``QuantizedArray`` leaf is one tensor per present child (:data:`~jaxpr_rewrite._quantized.array.ARRAY_FIELDS`),
  named ``<path>.<child>`` (``layers.0.attn.w.codes``, ``.scales``, ``.exponents``, ``.smooth``);
* the layout document (:func:`to_stored`) lists the leaves in order: each one's path, kind, tensor names, shape
  and dtype, and for a ``QuantizedArray`` its metadata (contracting axes, dtype, bits, ... with the layout
  version). docs/deploy.md spells it out for other tools.

Restoring onto a target pytree (arrays, ``jax.ShapeDtypeStruct`` or abstract ``QuantizedArray`` leaves, with
shardings or not) checks every leaf against it first and gives each tensor the target's sharding; without one,
the containers come back as dicts (dict keys and attributes) and lists (sequence indices), on the default device.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from .._core.errors import Int8ifyError
from .._core.jaxprs import default_device
from .array import ARRAY_FIELDS, LAYOUT_VERSION, QuantizedArray, is_quantized
from .array_layout import READABLE_LAYOUT_VERSIONS, readable_versions

__all__ = ["FORMAT", "abstract_tensors", "check_layout", "leaf_of_tensor", "rebuild", "to_stored"]

# What the layout document calls itself, so a reader can tell it from other JSON.
FORMAT = "int8ify.quantized-pytree"
QUANTIZED, ARRAY = "quantized", "array"  # the kinds of leaf

_PATH_ENTRIES = {  # key type -> (how the layout names it, its value)
    jax.tree_util.DictKey: ("key", lambda k: k.key),
    jax.tree_util.SequenceKey: ("index", lambda k: k.idx),
    jax.tree_util.GetAttrKey: ("attr", lambda k: k.name),
    jax.tree_util.FlattenedIndexKey: ("index", lambda k: k.key),
}


def _path_entries(path) -> list:
    entries = []
    for key in path:
        kind, value = _PATH_ENTRIES[type(key)]
        entries.append([kind, value(key)])
    return entries


def _leaf_name(entries: list) -> str:
    return ".".join(str(value) for _, value in entries)


def _describe(entries: list) -> str:
    """A leaf as ``jax.tree_util.keystr`` would print it, for error messages."""
    return "".join(f"[{value!r}]" if kind == "key" else f"[{value}]" if kind == "index" else f".{value}"
                   for kind, value in entries) or "the root"


def to_stored(tree) -> tuple[dict, dict]:
    """The named tensors and the layout document of a pytree of arrays and ``QuantizedArray`` leaves.

    Arguments:
        tree: the pytree (``quantize_params``'s output, say).

    Returns:
        ``(tensors, layout)``: ``name -> array``, and the JSON-serializable layout document.

    Raises:
        Int8ifyError: a leaf that is not an array, or two leaves whose names collide.
    """
    tensors, leaves = {}, []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_quantized)[0]:
        entries = _path_entries(path)
        name = _leaf_name(entries)
        if is_quantized(leaf):
            leaf.check(f"the QuantizedArray at {_describe(entries)}")
            parts = {field: f"{name}.{field}" if name else field for field in leaf.arrays()}
            record = {"path": entries, "kind": QUANTIZED, "tensors": parts, "shape": list(leaf.shape),
                      "dtype": leaf.dtype.name, "metadata": leaf.metadata()}
            named = {parts[field]: value for field, value in leaf.arrays().items()}
        elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            record = {"path": entries, "kind": ARRAY, "tensors": {"value": name}, "shape": list(leaf.shape),
                      "dtype": np.dtype(leaf.dtype).name}
            named = {name: leaf}
        else:
            raise Int8ifyError(f"cannot store the leaf at {_describe(entries)}: it is a {type(leaf).__name__}, not "
                               "an array or a QuantizedArray; store the arrays alone and put the rest back after "
                               "loading onto a target (an Equinox module: eqx.partition and eqx.combine with "
                               "is_leaf=is_quantized, as docs/deploy.md shows)")
        clash = set(named) & set(tensors)
        if clash:
            raise Int8ifyError(f"the leaf at {_describe(entries)} is stored as {sorted(clash)}, a name another leaf "
                               "already has (paths joined by '.' must differ)")
        tensors.update(named)
        leaves.append(record)
    types = {name: {"shape": list(value.shape), "dtype": np.dtype(value.dtype).name} for name, value in tensors.items()}
    return tensors, {"format": FORMAT, "layout_version": LAYOUT_VERSION, "leaves": leaves, "tensors": types}


def check_layout(layout: Any, where: str) -> None:
    """Raise a clear error unless ``layout`` is a layout document this int8ify reads.

    Arguments:
        layout: the document read from a file.
        where: the file, for the message.
    """
    if not isinstance(layout, Mapping) or layout.get("format") != FORMAT:
        raise Int8ifyError(f"{where} holds no int8ify layout document (it was not written by save_quantized / "
                           "save_safetensors)")
    version = layout.get("layout_version")
    if version not in READABLE_LAYOUT_VERSIONS:
        first = layout.get("leaves") or [{"path": []}]
        raise Int8ifyError(f"{where} is stored in layout version {version!r} (first leaf "
                           f"{_describe(first[0]['path'])}); this int8ify reads {readable_versions()}: write it "
                           "again with this int8ify, or quantize the float params again")


def _target_leaves(target) -> dict:
    """``leaf name -> (path entries, target leaf)`` of a target pytree."""
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(target, is_leaf=is_quantized)[0]:
        entries = _path_entries(path)
        found[_leaf_name(entries)] = (entries, leaf)
    return found


def _abstract(shape, dtype: str, like=None) -> jax.ShapeDtypeStruct:
    sharding = getattr(like, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(default_device())
    return jax.ShapeDtypeStruct(tuple(shape), jax.numpy.dtype(dtype), sharding=sharding)


def leaf_of_tensor(layout: Mapping, name: str) -> str:
    """The leaf a tensor belongs to, as error messages name it."""
    for record in layout["leaves"]:
        if name in record["tensors"].values():
            return f"leaf {_describe(record['path'])}"
    return f"tensor {name}"


def _target_parts(record: dict, leaf, where: str) -> dict:
    """``tensor name -> the target's array for it`` for one stored leaf, after checking the target fits."""
    shape, dtype = tuple(record["shape"]), record["dtype"]
    if record["kind"] == QUANTIZED:
        if not is_quantized(leaf):
            raise Int8ifyError(f"{where} is a QuantizedArray {list(shape)} in the file, but the target's leaf is a "
                               f"{type(leaf).__name__}")
        stored, wanted = record["metadata"], leaf.metadata()
        if tuple(leaf.shape) != shape or stored != wanted:
            raise Int8ifyError(f"{where} is a QuantizedArray of shape {list(shape)} with {stored} in the file, but "
                               f"the target's is of shape {list(leaf.shape)} with {wanted}")
        children = leaf.arrays()
        if set(children) != set(record["tensors"]):
            raise Int8ifyError(f"{where} has arrays {sorted(record['tensors'])} in the file, but the target's has "
                               f"{sorted(children)}")
        return {record["tensors"][field]: value for field, value in children.items()}
    if is_quantized(leaf) or not hasattr(leaf, "shape"):
        raise Int8ifyError(f"{where} is a {dtype} array {list(shape)} in the file, but the target's leaf is "
                           f"{leaf!r:.80}")
    if tuple(leaf.shape) != shape or np.dtype(leaf.dtype).name != dtype:
        raise Int8ifyError(f"{where} is {dtype}{list(shape)} in the file, but the target's is "
                           f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}")
    return {record["tensors"]["value"]: leaf}


def abstract_tensors(layout: Mapping, target=None) -> dict:
    """``tensor name -> jax.ShapeDtypeStruct`` to read a stored pytree into, checked against ``target``.

    Arguments:
        layout: the layout document (checked with :func:`check_layout`).
        target: ``None``, or a pytree like the stored one (arrays, ``ShapeDtypeStruct`` or ``QuantizedArray``
            leaves); each tensor then gets its target array's sharding.

    Raises:
        Int8ifyError: a target whose structure, shapes, dtypes or metadata differ from the file's, naming the
            leaf.
    """
    targets = _target_leaves(target) if target is not None else None
    abstract = {}
    for record in layout["leaves"]:
        where = f"leaf {_describe(record['path'])}"
        likes = {}
        if targets is not None:
            name = _leaf_name(record["path"])
            if name not in targets:
                raise Int8ifyError(f"{where} is in the file but not in the target")
            likes = _target_parts(record, targets.pop(name)[1], where)
        for name in record["tensors"].values():
            shape, dtype = layout["tensors"][name]["shape"], layout["tensors"][name]["dtype"]
            like = likes.get(name)
            if like is not None and tuple(like.shape) != tuple(shape):
                raise Int8ifyError(f"{where}: tensor {name} is {dtype}{list(shape)} in the file, but the target's "
                                   f"is {list(like.shape)}")
            abstract[name] = _abstract(shape, dtype, like)
    if targets:
        extra = ", ".join(_describe(entries) for entries, _ in targets.values())
        raise Int8ifyError(f"the target has leaves the file does not: {extra}")
    return abstract


def rebuild(layout: Mapping, tensors: Mapping, target=None):
    """The pytree from its stored tensors: the target's structure, or dicts and lists from the leaf paths.

    Arguments:
        layout: the layout document.
        tensors: ``tensor name -> array`` (read onto :func:`abstract_tensors`'s types).
        target: the target pytree the tensors were checked against, or ``None``.

    Returns:
        The pytree, its ``QuantizedArray`` leaves rebuilt from their tensors and metadata.
    """
    leaves = []
    for record in layout["leaves"]:
        names = record["tensors"]
        if record["kind"] == QUANTIZED:
            arrays = {field: tensors[name] for field, name in names.items() if field in ARRAY_FIELDS}
            leaves.append(QuantizedArray.from_parts(arrays, record["metadata"], f"leaf {_describe(record['path'])}"))
        else:
            leaves.append(tensors[names["value"]])
    if target is not None:
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target, is_leaf=is_quantized), leaves)
    if len(leaves) == 1 and not layout["leaves"][0]["path"]:
        return leaves[0]
    root: Any = None
    for record, leaf in zip(layout["leaves"], leaves):
        root = _insert(root, record["path"], leaf)
    return root


def _insert(node, entries: list, leaf):
    """``node`` (a dict, a list or ``None``) with ``leaf`` placed at ``entries``."""
    if not entries:
        return leaf
    (kind, key), rest = entries[0], entries[1:]
    if kind == "index":
        node = [] if node is None else node
        if key == len(node):
            node.append(None)
        node[key] = _insert(node[key], rest, leaf)
    else:
        node = {} if node is None else node
        node[key] = _insert(node.get(key), rest, leaf)
    return node
