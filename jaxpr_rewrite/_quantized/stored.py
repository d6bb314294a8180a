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

from typing import Any, Callable, Mapping

import jax
import numpy as np

from .._core.errors import Int8ifyError
from .._core.jaxprs import default_device
from .array import ARRAY_FIELDS, LAYOUT_VERSION, QuantizedArray, is_quantized
from .array_layout import READABLE_LAYOUT_VERSIONS, readable_versions

__all__ = ["FORMAT", "abstract_tensors", "check_layout", "leaf_of_tensor", "over_tensors", "rebuild", "to_stored"]

# What the layout document calls itself, so a reader can tell it from other JSON.
FORMAT = "int8ify.quantized-pytree"
QUANTIZED, ARRAY = "quantized", "array"  # the kinds of leaf

_PATH_ENTRIES = {  # key type -> (how the layout names it, its value)
    jax.tree_util.DictKey: ("key", lambda k: k.key),
    jax.tree_util.SequenceKey: ("index", lambda k: k.idx),
    jax.tree_util.GetAttrKey: ("attr", lambda k: k.name),
    jax.tree_util.FlattenedIndexKey: ("index", lambda k: k.key),
}


# The dict keys a path entry can hold: JSON's scalars, and tuples of them (``flax.traverse_util.flatten_dict``'s
# keys), which JSON writes as lists and a reader takes back as tuples (a list is no dict key).
_KEY_TYPES = (str, int, float, bool, type(None))


def _storable_key(value) -> bool:
    return isinstance(value, _KEY_TYPES) or (isinstance(value, tuple) and all(_storable_key(v) for v in value))


def _path_entries(path) -> list:
    entries = []
    for key in path:
        kind, value = _PATH_ENTRIES[type(key)]
        entries.append([kind, value(key)])
        if not _storable_key(entries[-1][1]):
            raise Int8ifyError(f"cannot store the leaf at {_describe(entries)}: its dict key "
                               f"{entries[-1][1]!r} is a {type(entries[-1][1]).__name__}; stored keys are strings, "
                               "numbers, booleans, None and tuples of them")
    return entries


def _as_key(value):
    """A path entry's value as read from JSON: a list (a tuple key, written as a list) back to a tuple."""
    return tuple(_as_key(v) for v in value) if isinstance(value, list) else value


def _entries_key(entries: list) -> tuple:
    """A hashable key of a leaf's path entries, the same for the entries written and those read back."""
    return tuple((kind, _as_key(value)) for kind, value in entries)


def _name_part(value) -> str:
    return ".".join(_name_part(v) for v in value) if isinstance(value, (list, tuple)) else str(value)


def _leaf_name(entries: list) -> str:
    return ".".join(_name_part(value) for _, value in entries)


def _describe(entries: list) -> str:
    """A leaf as ``jax.tree_util.keystr`` would print it, for error messages."""
    return "".join(f"[{value!r}]" if kind == "key" else f"[{value}]" if kind == "index" else f".{value}"
                   for kind, value in entries) or "the root"


def _holds_nothing(x) -> bool:
    """A place of a pytree that holds no leaf: ``None``, or an empty dict, list or tuple."""
    return x is None or (type(x) in (dict, list, tuple) and not x)


def to_stored(tree) -> tuple[dict, dict]:
    """The named tensors and the layout document of a pytree of arrays and ``QuantizedArray`` leaves.

    Arguments:
        tree: the pytree (``quantize_params``'s output, say).

    Returns:
        ``(tensors, layout)``: ``name -> array``, and the JSON-serializable layout document. Its ``empty`` lists the
        places holding no array (``None``, an empty dict, list or tuple), so a reader without a target puts them
        back (readers that do not know it drop them, as they did before it).

    Raises:
        Int8ifyError: a leaf that is not an array, a dict key that is not stored (an object), or two leaves whose
            names collide.
    """
    tensors, leaves, empty = {}, [], []
    is_leaf = lambda x: is_quantized(x) or _holds_nothing(x)  # noqa: E731
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        entries = _path_entries(path)
        name = _leaf_name(entries)
        if _holds_nothing(leaf):
            kind = "none" if leaf is None else "dict" if isinstance(leaf, dict) else "list"
            empty.append({"path": entries, "kind": kind, "at": len(leaves)})
            continue
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
    layout = {"format": FORMAT, "layout_version": LAYOUT_VERSION, "leaves": leaves, "tensors": types}
    if empty:
        layout["empty"] = empty
    return tensors, layout


def over_tensors(fn: Callable, params) -> tuple[Callable, dict]:
    """``fn`` taking the named tensors of ``params`` in place of ``params``: what to export with ``jax.export`` for a
    program that JAX alone serves.

    An exported program's arguments are rebuilt from its serialized pytree structure, and a ``QuantizedArray`` in
    it deserializes only in a process that registered it (one that imported ``jaxpr_rewrite``). Over the named
    tensors (a dict of arrays, :func:`to_stored`'s: the tensors :func:`~jaxpr_rewrite.safetensors_io.save_safetensors`
    writes) the structure is JAX's own, and a server loads the tensors with ``safetensors`` and calls the program
    with ``jax.export.deserialize`` alone.

    Arguments:
        fn: ``fn(params, *args, **kwargs)``, the model (an ``int8ify``-wrapped function, for int8 dots).
        params: its params, quantized (``quantize_params``' output or a loaded file): arrays and ``QuantizedArray``
            leaves.

    Returns:
        ``(program, tensors)``: ``program(tensors, *args, **kwargs)`` computes ``fn(params, *args, **kwargs)``,
        bit for bit; ``tensors`` is ``name -> array``.
    """
    tensors, layout = to_stored(params)

    def program(named, *args, **kwargs):
        return fn(rebuild(layout, named, params), *args, **kwargs)

    program.__name__ = program.__qualname__ = getattr(fn, "__name__", "program")
    return program, tensors


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
        path = first[0].get("path") if isinstance(first, list) and isinstance(first[0], Mapping) else None
        leaf = f" (first leaf {_describe(path)})" if _is_path(path) else ""
        raise Int8ifyError(f"{where} is stored in layout version {version!r}{leaf}; this int8ify reads "
                           f"{readable_versions()}: write it again with this int8ify, or quantize the float params "
                           "again")
    problem = _document_problem(layout)
    if problem:
        raise Int8ifyError(f"{where}: its layout document is damaged: {problem}")


def _is_path(path) -> bool:
    return isinstance(path, list) and all(
        isinstance(entry, list) and len(entry) == 2 and entry[0] in ("key", "index", "attr") for entry in path)


def _is_shape(shape) -> bool:
    return isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)


def _document_problem(layout: Mapping) -> str | None:
    """What is wrong with a layout document's leaves and tensors (what a reader looks up), or ``None``."""
    tensors, leaves = layout.get("tensors"), layout.get("leaves")
    if not isinstance(tensors, Mapping) or not isinstance(leaves, list):
        return "it needs a 'leaves' list and a 'tensors' mapping"
    for name, entry in tensors.items():
        if not (isinstance(entry, Mapping) and _is_shape(entry.get("shape")) and isinstance(entry.get("dtype"), str)):
            return f"tensor {name!r} has no shape and dtype ({entry!r:.80})"
        try:
            jax.numpy.dtype(entry["dtype"])
        except TypeError:
            return f"tensor {name!r} has the unknown dtype {entry['dtype']!r}"
    for i, record in enumerate(leaves):
        if not (isinstance(record, Mapping) and _is_path(record.get("path"))):
            return f"leaf {i} has no path ({record!r:.80})"
        leaf = f"leaf {i} ({_describe(record['path'])})"
        names = record.get("tensors")
        if record.get("kind") not in (QUANTIZED, ARRAY):
            return f"{leaf} is of the unknown kind {record.get('kind')!r}"
        if not (_is_shape(record.get("shape")) and isinstance(record.get("dtype"), str)):
            return f"{leaf} has no shape and dtype"
        if not isinstance(names, Mapping) or not names or (record["kind"] == ARRAY and set(names) != {"value"}):
            return f"{leaf} names no tensors ({names!r:.80})"
        missing = [name for name in names.values() if not isinstance(name, str) or name not in tensors]
        if missing:
            return f"{leaf} names tensors {missing} the document does not list"
        if record["kind"] == QUANTIZED and not isinstance(record.get("metadata"), Mapping):
            return f"{leaf} is a QuantizedArray without its metadata"
    for i, place in enumerate(layout.get("empty", [])):
        if not (isinstance(place, Mapping) and _is_path(place.get("path")) and place.get("kind") in _EMPTY
                and isinstance(place.get("at"), int) and 0 <= place["at"] <= len(leaves)):
            return f"empty place {i} is not a path, kind and position ({place!r:.80})"
    return None


def _target_leaves(target) -> dict:
    """``leaf path key -> (path entries, target leaf)`` of a target pytree (:func:`_entries_key`)."""
    found = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(target, is_leaf=is_quantized)[0]:
        entries = _path_entries(path)
        found[_entries_key(entries)] = (entries, leaf)
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
            key = _entries_key(record["path"])
            if key not in targets:
                raise Int8ifyError(f"{where} is in the file but not in the target")
            likes = _target_parts(record, targets.pop(key)[1], where)
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
    # every place in flattening order: the leaves, and the places holding none put back where they were
    places = [(record["path"], leaf) for record, leaf in zip(layout["leaves"], leaves)]
    for place in sorted(layout.get("empty", []), key=lambda place: -place["at"]):
        places.insert(place["at"], (place["path"], _EMPTY[place["kind"]]()))
    if len(places) == 1 and not places[0][0]:
        return places[0][1]
    root: Any = None
    for path, leaf in places:
        root = _insert(root, path, leaf)
    return root


# what each kind of place holding no array is rebuilt as (a tuple comes back as a list, as sequences do)
_EMPTY = {"none": lambda: None, "dict": dict, "list": list}
_UNSET = object()  # a list item not placed yet


def _insert(node, entries: list, leaf):
    """``node`` (a dict, a list or ``None``) with ``leaf`` placed at ``entries``."""
    if not entries:
        return leaf
    (kind, key), rest = entries[0], entries[1:]
    key = _as_key(key)
    if kind == "index":
        node = [] if node is None else node
        node.extend(_UNSET for _ in range(key + 1 - len(node)))
        node[key] = _insert(None if node[key] is _UNSET else node[key], rest, leaf)
    else:
        node = {} if node is None else node
        node[key] = _insert(node.get(key), rest, leaf)
    return node
