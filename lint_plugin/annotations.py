"""What a type annotation says about a value's kind.

``x: jax.Array`` (or ``Float[Array, "b d"]``) is an array; ``n: int``, ``mode: Mode`` (an ``Enum`` of
this file), ``fn: Callable``, ``shape: tuple[int, ...]``, ``spec: PartitionSpec`` (and the other sharding
classes) are Python values; ``cache: dict[str, jax.Array]``
(also through a module-level alias ``Cache = dict[str, jax.Array]``) is a Python container, whose
truthiness and ``len()`` are static but whose items are not known. ``Optional[X]`` and ``X | None``
say what ``X`` says.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Set

import libcst as cst

from .aliases import ImportTable, dotted_name
from .kinds import STATIC, TRACED, UNKNOWN
from .module_info import ModuleInfo
from .names import SHARDING_TYPES

__all__ = ["AnnotationReader", "annotated_class"]

_ARRAY_TYPES = frozenset({
    "jax.Array", "jax.numpy.ndarray", "jax.typing.ArrayLike", "jaxtyping.Array", "jaxtyping.ArrayLike",
    "chex.Array",
})
# jaxtyping's dtype-annotated arrays: ``Float[Array, "b d"]``, ``Int[Array, ""]``, ...
_JAXTYPING = "jaxtyping."

_STATIC_TYPES = frozenset({
    "bool", "int", "str", "bytes", "type",
    "typing.Callable", "collections.abc.Callable", "typing.Literal", "typing_extensions.Literal",
    "typing.Type",
})
# a Python scalar passed to ``jit`` arrives as a (weakly typed) tracer: not known either way
_UNKNOWN_TYPES = frozenset({"float", "complex", "typing.Any", "object"})
_CONTAINERS = frozenset(
    ["dict", "list", "set", "frozenset"]
    + ["typing." + n for n in ("Dict", "List", "Set", "FrozenSet", "Mapping", "MutableMapping", "Sequence",
                               "MutableSequence", "Iterable", "Collection", "DefaultDict", "OrderedDict")]
    + ["collections.abc." + n for n in ("Mapping", "MutableMapping", "Sequence", "MutableSequence",
                                        "Iterable", "Collection")]
)
_TUPLES = frozenset({"tuple", "typing.Tuple"})
_OPTIONAL = "typing.Optional"
_UNION = "typing.Union"
_NONE = -1  # the ``None`` in ``X | None``: says nothing about ``X``
# type aliases are followed this far (``A = B`` chains; also stops ``A = A`` loops)
_MAX_ALIAS_DEPTH = 8


class AnnotationReader:
    """Reads annotations of one file, knowing its imports, module-level aliases and enum classes."""

    __slots__ = ("imports", "aliases", "enums")

    def __init__(self, imports: ImportTable, aliases: Dict[str, cst.BaseExpression], enums: Set[str]) -> None:
        self.imports = imports
        self.aliases = aliases
        self.enums = enums

    @classmethod
    def of(cls, info: ModuleInfo) -> "AnnotationReader":
        """The reader for the file ``info`` describes (after :func:`~lint_plugin.module_classes.resolve_classes`)."""
        return cls(info.imports, info.module_assigns, {c.name for c in info.classes if c.is_enum})

    def kind(self, annotation: Optional[cst.Annotation]) -> Optional[int]:
        """``TRACED`` (an array), ``STATIC`` (a Python value), ``UNKNOWN`` (a Python container, or a
        type a traced value may also have), or ``None`` when the annotation says nothing known."""
        if annotation is None:
            return None
        k = self._kind(annotation.annotation, 0)
        return None if k == _NONE else k

    def _kind(self, node: cst.BaseExpression, depth: int) -> Optional[int]:
        if depth > _MAX_ALIAS_DEPTH:
            return None
        if isinstance(node, cst.SimpleString):
            return UNKNOWN  # a forward reference: do not guess
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.BitOr):
            return _union(self._kind(side, depth) for side in (node.left, node.right))
        if isinstance(node, cst.Subscript):
            return self._subscript_kind(node, depth)
        raw = dotted_name(node)
        if raw is None:
            return None
        if raw == "None":
            return _NONE
        q = self.imports.resolve_dotted(raw)
        if q is None:
            alias = self.aliases.get(raw)
            if alias is not None:
                return self._kind(alias, depth + 1)
            if raw in self.enums:
                return STATIC
            q = raw  # a builtin (``int``, ``dict``) or a class of this file
        return _named_kind(q)

    def _subscript_kind(self, node: cst.Subscript, depth: int) -> Optional[int]:
        raw = dotted_name(node.value)
        if raw is None:
            return None
        head = self.imports.resolve_dotted(raw) or raw
        items = [el.slice.value for el in node.slice if isinstance(el.slice, cst.Index)]
        if head.startswith(_JAXTYPING):
            return TRACED
        if head == _OPTIONAL or head == _UNION:
            return _union(self._kind(item, depth) for item in items)
        if head in _TUPLES:
            kinds = [self._kind(item, depth) for item in items if not isinstance(item, cst.Ellipsis)]
            return STATIC if kinds and all(k == STATIC for k in kinds) else UNKNOWN
        return _named_kind(head)


def annotated_class(annotation: Optional[cst.Annotation]) -> Optional[str]:
    """The dotted name of the one class an annotation names: ``Mode``, ``types.Mode``,
    ``Optional[Mode]``, ``Mode | None``; None for anything else."""
    if annotation is None:
        return None
    node = annotation.annotation
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.BitOr):
        sides = [side for side in (node.left, node.right) if dotted_name(side) != "None"]
        node = sides[0] if len(sides) == 1 else node
    elif isinstance(node, cst.Subscript) and (dotted_name(node.value) or "").endswith("Optional") \
            and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
        node = node.slice[0].slice.value
    return dotted_name(node)


def _named_kind(q: str) -> Optional[int]:
    if q in _ARRAY_TYPES:
        return TRACED
    if q in _STATIC_TYPES or q in SHARDING_TYPES:
        return STATIC
    if q in _CONTAINERS or q in _TUPLES or q in _UNKNOWN_TYPES:
        return UNKNOWN
    return None


def _union(kinds: Iterable[Optional[int]]) -> Optional[int]:
    """``A | B``: what all members (``None`` aside) agree on; ``UNKNOWN`` when they differ."""
    seen = {k for k in kinds if k != _NONE}
    if not seen:
        return _NONE
    if None in seen:
        return None
    return seen.pop() if len(seen) == 1 else UNKNOWN
