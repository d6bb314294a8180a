"""A small import/alias table: maps local names to fully qualified dotted names.

This replaces libcst's ``QualifiedNameProvider`` (which costs about ten times a parse) with the
one thing the rules need: knowing that ``np_.matmul`` after ``import jax.numpy as np_`` is
``jax.numpy.matmul``, that ``L.scan`` after ``from jax import lax as L`` is ``jax.lax.scan``, and
that ``matmul`` after ``from jax.numpy import matmul`` is ``jax.numpy.matmul``.

Scoping is deliberately coarse: every import in a file (including imports inside functions)
lands in one table. A later import of the same local name wins, which matches straight-line
module code, the overwhelmingly common case.
"""

from __future__ import annotations

from typing import Dict, Optional

import libcst as cst

__all__ = ["ImportTable", "dotted_name"]


def dotted_name(node: cst.BaseExpression) -> Optional[str]:
    """``a.b.c`` for a chain of ``Name``/``Attribute`` nodes, else ``None``."""
    parts = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if isinstance(node, cst.Name):
        parts.append(node.value)
        parts.reverse()
        return ".".join(parts)
    return None


# A few modules are re-exported under a shorter public path; resolve both to one spelling so
# that the rule tables only list the public names.
_CANONICAL_PREFIXES = (
    ("jax._src.numpy.lax_numpy.", "jax.numpy."),
    ("jax.ad_checkpoint.checkpoint", "jax.checkpoint"),
    ("jax.experimental.pjit.pjit", "jax.jit"),
    ("flax.linen.module.", "flax.linen."),
    ("flax.linen.Module", "flax.linen.Module"),
    ("eqx.", "equinox."),
)


def _canonical(name: str) -> str:
    for prefix, repl in _CANONICAL_PREFIXES:
        if name.startswith(prefix):
            return repl + name[len(prefix):]
    return name


class ImportTable:
    """Local name -> fully qualified name, filled from ``import`` statements."""

    __slots__ = ("names",)

    def __init__(self) -> None:
        self.names: Dict[str, str] = {}

    def add(self, node: cst.CSTNode) -> None:
        if isinstance(node, cst.Import):
            for alias in node.names:
                full = dotted_name(alias.name)
                if full is None:
                    continue
                if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                    self.names[alias.asname.name.value] = full
                else:
                    # ``import jax.numpy`` binds ``jax``.
                    top = full.split(".", 1)[0]
                    self.names[top] = top
        elif isinstance(node, cst.ImportFrom):
            if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
                return
            module = dotted_name(node.module)
            if module is None:
                return
            for alias in node.names:
                name = dotted_name(alias.name)
                if name is None:
                    continue
                if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                    local = alias.asname.name.value
                else:
                    local = name
                self.names[local] = module + "." + name

    def is_imported(self, local: str) -> bool:
        return local in self.names

    def resolve(self, node: cst.BaseExpression) -> Optional[str]:
        """The fully qualified name of ``node`` if its head was imported, else ``None``."""
        raw = dotted_name(node)
        if raw is None:
            return None
        return self.resolve_dotted(raw)

    def resolve_dotted(self, raw: str) -> Optional[str]:
        head, _, rest = raw.partition(".")
        full = self.names.get(head)
        if full is None:
            return None
        return _canonical(full + "." + rest if rest else full)

    def mentions(self, *roots: str) -> bool:
        """Whether any import comes from one of the top-level packages ``roots``."""
        for full in self.names.values():
            if full.split(".", 1)[0] in roots:
                return True
        return False
