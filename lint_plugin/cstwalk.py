"""Fast child iteration over libcst nodes.

``CSTNode.children`` rebuilds every node it visits, which is several times slower than reading
the dataclass fields directly. The rules never look at whitespace, commas or parentheses, so those
fields are skipped.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, Tuple, Type

import libcst as cst

__all__ = ["STRING_NODES", "iter_children"]

_SKIP_SUBSTRINGS = ("whitespace", "lpar", "rpar", "leading_lines", "lines_after", "newline")
_SKIP_NAMES = frozenset({"comma", "semicolon", "colon", "header", "footer", "equal", "lbracket",
                         "rbracket", "lbrace", "rbrace", "operator", "asynchronous", "relative",
                         "star", "dot", "keyword", "asname", "prefix", "quote", "start", "end"})

_FIELDS: Dict[Type[cst.CSTNode], Tuple[str, ...]] = {}

# the nodes of a string literal (plain, implicitly concatenated, f-string)
STRING_NODES = (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)


def _fields_of(cls: Type[cst.CSTNode]) -> Tuple[str, ...]:
    names = []
    for f in dataclasses.fields(cls):
        if f.name in _SKIP_NAMES or any(s in f.name for s in _SKIP_SUBSTRINGS):
            continue
        if cls is cst.Attribute and f.name == "attr":
            continue
        names.append(f.name)
    result = tuple(names)
    _FIELDS[cls] = result
    return result


def iter_children(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    cls = type(node)
    fields = _FIELDS.get(cls)
    if fields is None:
        fields = _fields_of(cls)
    for name in fields:
        value = getattr(node, name)
        if isinstance(value, cst.CSTNode):
            yield value
        elif isinstance(value, (tuple, list)):
            for item in value:
                if isinstance(item, cst.CSTNode):
                    yield item
