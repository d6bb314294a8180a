"""State a traced function stores into its arguments, carried out of the program and back into them.

A Flax NNX module updates its variables in place when it runs (a KV cache, BatchNorm statistics, the RNG
counters of dropout), and ``nnx.jit`` carries those updates out of its trace. int8ify traces the function on
copies of its arguments rebuilt from their leaves, so without more the updates would stay on the copies: a
decoding step would see an empty cache, silently. Here the leaves a call replaced inside its arguments are found
when the program is traced (:func:`find_updates`), become extra outputs of the program, and are set on the
caller's own objects after each run (:func:`write_back`), so ``int8ify(f)(model, x)`` updates ``model`` as
``f(model, x)`` does, eagerly or inside ``nnx.jit``.

Two more things keep the traced call faithful to the float one. Objects the caller's arguments reach at two places
(a tied submodule, one module passed as two arguments) are shared again in the rebuilt copies
(:func:`shared_objects`, :func:`relink`), so the call updates them once per use, not each copy on its own. And a
plain Python attribute the call sets (``self.calls += 1``: static, not a leaf) is set on the caller's object too
(:func:`write_attributes`), as ``nnx.jit`` does; its new value is part of the next call's signature, so that call
traces again, as ``nnx.jit``'s does.

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

__all__ = ["find_updates", "relink", "shared_objects", "write_attributes", "write_back"]

Path = tuple  # a leaf's key path in the tree of a call's traced arguments


def shared_objects(root, leaves: Sequence) -> tuple:
    """The objects a call's arguments reach at two places (a tied submodule, one module passed as two arguments):
    ``((path, path it is shared with), ...)``, shallowest first, for :func:`relink`. Found only among objects
    holding the same array leaf, so a call whose leaves are all distinct pays one set of ids.

    Arguments:
        root: the call's ``(dynamic positional args, dynamic kwargs)``, the caller's objects.
        leaves: ``(path, leaf)`` of every traced leaf of ``root`` (from ``jax.tree_util.tree_flatten_with_path``).

    Returns:
        The pairs; for each, the object at the first path is the one at the second in the caller's arguments.
    """
    places: dict = {}
    for path, leaf in leaves:
        places.setdefault(id(leaf), []).append(path)
    shared = {}
    for paths in places.values():
        first = paths[0]
        for other in paths[1:]:
            # the shallowest object both paths pass through, at the same place within it (its leaf excluded: an
            # array is immutable, two places holding it share nothing), that its parent lets be set
            for depth in range(2, min(len(first), len(other))):
                if first[depth:] != other[depth:] or other[:depth] in shared:
                    continue
                node = _node(root, first[:depth])
                if node is not None and node is _node(root, other[:depth]) and _settable(
                        _node(root, other[:depth - 1]), other[depth - 1]):
                    shared[other[:depth]] = first[:depth]
                    break
    return tuple(sorted(shared.items(), key=lambda pair: len(pair[0])))


def relink(root, shared: tuple) -> None:
    """Make the objects of ``root`` (the arguments rebuilt from their leaves, copies) shared where the caller's are
    (:func:`shared_objects`): a traced call then updates a tied module once, as the float function does, instead
    of each copy on its own."""
    for path, source in shared:
        _set(_node(root, path[:-1]), path[-1], _node(root, source))


def find_updates(root, before, is_dynamic: Sequence[bool], inputs: Sequence, fn_name: str,
                 shared: tuple = ()) -> tuple[tuple, list, tuple]:
    """The leaves a traced call replaced inside its arguments, and the Python attributes it set.

    Arguments:
        root: the arguments the function was called with (the tree of its traced and static leaves), after it ran.
        before: the same arguments rebuilt again, untouched (what ``root`` was before the call).
        is_dynamic: per leaf, whether it is traced.
        inputs: the traced leaves the call was given, in order.
        fn_name: the function's name, for messages.
        shared: the places of ``root`` that share an object with another (:func:`shared_objects`): their leaves
            are the other place's, written back through it.

    Returns:
        ``(paths, values, attributes)``: the path of each leaf the call replaced (a traced one, or a static one by a
        traced value) and the value it left there; and ``(path of an object, attribute name, new value)`` for
        each Python attribute (not a leaf: a counter, a flag, a static field of a Flax NNX module) the call set to
        another Python value, which ``nnx.jit`` carries out of its trace too.

    Raises:
        Int8ifyError: the call stored a traced value where it cannot be written back.
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(root, is_leaf=is_quantized)
    old_leaves, _ = jax.tree_util.tree_flatten_with_path(before, is_leaf=is_quantized)
    given = {id(x) for x in inputs}
    if [path for path, _ in leaves] != [path for path, _ in old_leaves]:
        stored = [_describe(path) for path, leaf in leaves
                  if isinstance(leaf, jax.core.Tracer) and id(leaf) not in given]
        if stored:
            raise Int8ifyError(
                f"{fn_name} stores traced values into its arguments at {', '.join(stored[:3])} and changes their "
                "structure (a new attribute, entry or item), which int8ify cannot carry out of the traced program; "
                "create that state before the call, or return the values instead")
        return (), [], ()
    inputs_left, changed = iter(inputs), []
    for (path, leaf), traced in zip(leaves, is_dynamic):
        # a traced leaf replaced, or a static one (a Python number) that now holds a traced value
        replaced = (leaf is not next(inputs_left)) if traced else isinstance(leaf, jax.core.Tracer)
        if replaced and not (id(leaf) in given and any(path[:len(place)] == place for place, _ in shared)):
            changed.append((path, leaf))
    for path, _ in changed:
        _parent(root, path, fn_name)  # fails now, at trace time, where a value could not be written back
    attributes = tuple(_set_attributes(root, before, (), fn_name))
    return tuple(path for path, _ in changed), [leaf for _, leaf in changed], attributes


def _set_attributes(node, before, path: tuple, fn_name: str):
    """``(path, name, value)`` of each Python attribute of ``node`` and the objects below it that the call set to
    another value than ``before`` (its copy before the call) holds: attributes that are not pytree children, whose
    values both copies share unless the call replaced them. Only objects whose children are all attributes (a
    Flax NNX module, a dataclass) are compared: another node's attributes hold its children otherwise (an NNX
    ``State``'s mapping)."""
    children = _children(node)
    if children is None:
        return
    names = {key.name for key, _ in children if isinstance(key, GetAttrKey)}
    by_attributes = len(names) == len(children) and type(node) is type(before)
    if by_attributes and hasattr(node, "__dict__") and hasattr(before, "__dict__"):
        old = vars(before)
        for name, value in vars(node).items():
            if name in names or (name in old and old[name] is value):
                continue
            if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(value)):
                raise Int8ifyError(f"{fn_name} stores a traced value in {_describe(path + (GetAttrKey(name),))}, "
                                   "a plain Python attribute (not a leaf of its pytree), so int8ify cannot carry it "
                                   "out of the traced program; hold it in a Variable (an array leaf), or return it")
            yield path, name, value
    old_children = dict(_children(before) or ())
    for key, child in children:
        if key in old_children:
            yield from _set_attributes(child, old_children[key], path + (key,), fn_name)


def _children(node):
    """``[(key, child), ...]`` of a pytree node one level down, or ``None`` for a leaf."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return None
    return [(path[0], child) for path, child in leaves if path]


def write_attributes(root, attributes: Sequence) -> None:
    """Set the Python attributes a call set (from :func:`find_updates`) on the caller's objects ``root``."""
    for path, name, value in attributes:
        _set(_node(root, path), GetAttrKey(name), value)


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


def _node(root, path: Path):
    """The object at ``path`` of ``root``, or ``None`` where a key does not lead anywhere."""
    node = root
    for key in path:
        try:
            if isinstance(key, GetAttrKey):
                node = getattr(node, key.name)
            elif isinstance(key, DictKey):
                node = node[key.key]
            elif isinstance(key, SequenceKey):
                node = node[key.idx]
            else:
                return None
        except (AttributeError, KeyError, IndexError, TypeError):
            return None
    return node


def _settable(parent, key) -> bool:
    """Whether ``parent``'s child at ``key`` can be replaced: an attribute of a mutable object (not a frozen
    dataclass, such as an Equinox module), a mutable mapping's entry, a mutable sequence's item."""
    if isinstance(key, GetAttrKey):
        params = getattr(type(parent), "__dataclass_params__", None)
        return hasattr(parent, "__dict__") and not (params is not None and params.frozen)
    if isinstance(key, DictKey):
        return isinstance(parent, collections.abc.MutableMapping)
    return isinstance(key, SequenceKey) and isinstance(parent, collections.abc.MutableSequence)


def _set(parent, key, value) -> None:
    if isinstance(key, GetAttrKey):
        setattr(parent, key.name, value)
    else:
        parent[key.key if isinstance(key, DictKey) else key.idx] = value
