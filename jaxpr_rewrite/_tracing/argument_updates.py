"""State a traced function stores into its arguments, carried out of the program and back into them.

A Flax NNX module updates its variables in place when it runs (a KV cache, BatchNorm statistics, the RNG
counters of dropout), and ``nnx.jit`` carries those updates out of its trace. int8ify traces the function on
copies of its arguments rebuilt from their leaves, so without more the updates would stay on the copies: a
decoding step would see an empty cache, silently. Here the leaves a call replaced inside its arguments are found
when the program is traced (:func:`find_updates`), become extra outputs of the program, and are set on the
caller's own objects after each run (:func:`write_back`), so ``int8ify(f)(model, x)`` updates ``model`` as
``f(model, x)`` does, eagerly or inside ``nnx.jit``.

An update is written back along its path in the arguments' tree: an attribute, a dict entry or a list item. A
function that stores traced values where that cannot reach (a tuple, a pytree node without keys) or that changes
the arguments' structure (a new attribute holding an array) gets an :class:`~jaxpr_rewrite._core.errors.Int8ifyError`
naming the place instead of losing the values.
"""

from __future__ import annotations

import collections.abc
from typing import Any, Sequence

import jax
from jax.tree_util import DictKey, GetAttrKey, SequenceKey, keystr

from .._core.errors import Int8ifyError
from .._quantized.array import is_quantized

__all__ = ["find_updates", "write_back"]

Path = tuple  # a leaf's key path in the tree of a call's traced arguments


def find_updates(root, tree, is_dynamic: Sequence[bool], inputs: Sequence, fn_name: str) -> tuple[tuple, list]:
    """The leaves a traced call replaced inside its arguments.

    Arguments:
        root: the arguments the function was called with (the tree of its traced and static leaves), after it ran.
        tree: their tree structure before the call.
        is_dynamic: per leaf of ``tree``, whether it is traced.
        inputs: the traced leaves the call was given, in order.
        fn_name: the function's name, for messages.

    Returns:
        ``(paths, values)``: the path of each leaf the call replaced (a traced one, or a static one by a traced
        value) and the value it left there.

    Raises:
        Int8ifyError: the call stored a traced value where it cannot be written back.
    """
    leaves, after = jax.tree_util.tree_flatten_with_path(root, is_leaf=is_quantized)
    given = {id(x) for x in inputs}
    if after != tree:
        stored = [_describe(path) for path, leaf in leaves
                  if isinstance(leaf, jax.core.Tracer) and id(leaf) not in given]
        if stored:
            raise Int8ifyError(
                f"{fn_name} stores traced values into its arguments at {', '.join(stored[:3])} and changes their "
                "structure (a new attribute, entry or item), which int8ify cannot carry out of the traced program; "
                "create that state before the call, or return the values instead")
        return (), []
    inputs_left, changed = iter(inputs), []
    for (path, leaf), traced in zip(leaves, is_dynamic):
        # a traced leaf replaced, or a static one (a Python number) that now holds a traced value
        if (leaf is not next(inputs_left)) if traced else isinstance(leaf, jax.core.Tracer):
            changed.append((path, leaf))
    for path, _ in changed:
        _parent(root, path, fn_name)  # fails now, at trace time, where a value could not be written back
    return tuple(path for path, _ in changed), [leaf for _, leaf in changed]


def write_back(root, paths: Sequence[Path], values: Sequence, fn_name: str) -> None:
    """Set each of ``values`` on the caller's arguments ``root`` at its path (from :func:`find_updates`)."""
    for path, value in zip(paths, values):
        parent, key = _parent(root, path, fn_name)
        if isinstance(key, GetAttrKey):
            # a Flax NNX Variable's value is set with set_value (assigning .value is deprecated there)
            set_value = getattr(parent, "set_value", None) if key.name == "value" else None
            if callable(set_value):
                set_value(value)
            else:
                setattr(parent, key.name, value)
        else:
            parent[key.key if isinstance(key, DictKey) else key.idx] = value


def _parent(root, path: Path, fn_name: str) -> tuple[Any, Any]:
    """The object holding the leaf at ``path`` and its key there, checked to be settable."""
    node = root
    for key in path[:-1]:
        node = _child(node, key, path, fn_name)
    key = path[-1]
    settable = (isinstance(key, GetAttrKey)
                or (isinstance(key, DictKey) and isinstance(node, collections.abc.MutableMapping))
                or (isinstance(key, SequenceKey) and isinstance(node, collections.abc.MutableSequence)))
    if not settable:
        why = (f"a {type(node).__name__} cannot be updated in place" if isinstance(key, (DictKey, SequenceKey))
               else f"{type(node).__name__} names its children by position only")
        _cannot_write(path, why, fn_name)
    return node, key


def _child(node, key, path: Path, fn_name: str):
    if isinstance(key, GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, DictKey):
        return node[key.key]
    if isinstance(key, SequenceKey):
        return node[key.idx]
    _cannot_write(path, f"{type(node).__name__} names its children by position only", fn_name)


def _describe(path: Path) -> str:
    """Where a leaf is among a call's arguments: ``argument 0 .cache.value``, ``keyword 'state' ['k']``."""
    where = f"argument {path[1].idx}" if path[0].idx == 0 else f"keyword {path[1].key!r}"
    return f"{where} {keystr(path[2:])}".rstrip()


def _cannot_write(path: Path, why: str, fn_name: str):
    raise Int8ifyError(
        f"{fn_name} updates {_describe(path)} in place, and int8ify cannot carry that update out "
        f"of the traced program ({why}); return the new value instead")
