"""The import table: maps local names to fully qualified dotted names.

This replaces libcst's ``QualifiedNameProvider`` (which costs about ten times a parse) with the
one thing the rules need: knowing that ``np_.matmul`` after ``import jax.numpy as np_`` is
``jax.numpy.matmul``, that ``L.scan`` after ``from jax import lax as L`` is ``jax.lax.scan``, and
that ``matmul`` after ``from jax.numpy import matmul`` is ``jax.numpy.matmul``.

One table serves both syntax trees: the prefilter fills it from flake8's ``ast`` tree
(:meth:`ImportTable.add_ast`), the analysis from the libcst module (:meth:`ImportTable.add`).

Scoping is deliberately coarse: every import in a file (including imports inside functions)
lands in one table. A later import of the same local name wins, which matches straight-line
module code, the overwhelmingly common case. Relative imports are not resolved.
"""

from __future__ import annotations

import ast
from operator import attrgetter
from typing import Any, Callable, Dict, Optional

import libcst as cst

__all__ = ["ImportTable", "ast_dotted_name", "canonical", "dotted_name"]


def _dotted(node: object, attribute: type, name: type, attr_of: Callable[[Any], str],
            id_of: Callable[[Any], str]) -> Optional[str]:
    parts = []
    while isinstance(node, attribute):
        parts.append(attr_of(node))
        node = node.value  # type: ignore[attr-defined]
    if isinstance(node, name):
        parts.append(id_of(node))
        parts.reverse()
        return ".".join(parts)
    return None


_CST_ATTR, _CST_ID = attrgetter("attr.value"), attrgetter("value")
_AST_ATTR, _AST_ID = attrgetter("attr"), attrgetter("id")


def dotted_name(node: cst.BaseExpression) -> Optional[str]:
    """``a.b.c`` for a libcst chain of ``Name``/``Attribute`` nodes, else ``None``."""
    return _dotted(node, cst.Attribute, cst.Name, _CST_ATTR, _CST_ID)


def ast_dotted_name(node: ast.AST) -> Optional[str]:
    """``a.b.c`` for an ``ast`` chain of ``Name``/``Attribute`` nodes, else ``None``."""
    return _dotted(node, ast.Attribute, ast.Name, _AST_ATTR, _AST_ID)


# A few names are re-exported under a shorter public path; resolve both to one spelling so that
# the tables in :mod:`lint_plugin.names` only list the public names.
_CANONICAL_PREFIXES = (
    ("jax._src.numpy.lax_numpy.", "jax.numpy."),
    ("jax.ad_checkpoint.checkpoint", "jax.checkpoint"),
    ("jax.experimental.pjit.pjit", "jax.jit"),
    ("flax.linen.module.", "flax.linen."),
    ("flax.nnx.module.", "flax.nnx."),
    ("flax.nnx.variablelib.", "flax.nnx."),
    ("equinox._module.", "equinox."),
    ("eqx.", "equinox."),
)


def canonical(name: str) -> str:
    for prefix, repl in _CANONICAL_PREFIXES:
        if name.startswith(prefix):
            return repl + name[len(prefix):]
    return name


class ImportTable:
    """Local name -> fully qualified name, filled from ``import`` statements."""

    __slots__ = ("names",)

    def __init__(self) -> None:
        self.names: Dict[str, str] = {}

    # ------------------------------------------------------------------ filling
    def bind_import(self, module: str, asname: Optional[str]) -> None:
        """``import module [as asname]``: ``import jax.numpy`` binds ``jax``."""
        if asname:
            self.names[asname] = module
        else:
            top = module.split(".", 1)[0]
            self.names[top] = top

    def bind_from(self, module: str, name: str, asname: Optional[str]) -> None:
        """``from module import name [as asname]`` (absolute imports only)."""
        self.names[asname or name] = module + "." + name

    def bind_alias(self, local: str, raw: str) -> None:
        """``local = raw`` of an imported name (``mm = jnp.matmul``): ``local`` stands for what ``raw`` does."""
        full = self.resolve_dotted(raw)
        if full is not None:
            self.names[local] = full

    def add(self, node: cst.CSTNode) -> None:
        """Record a libcst ``Import``/``ImportFrom``."""
        if isinstance(node, cst.Import):
            for alias in node.names:
                full = dotted_name(alias.name)
                if full is not None:
                    self.bind_import(full, _cst_asname(alias))
        elif isinstance(node, cst.ImportFrom):
            if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
                return
            module = dotted_name(node.module)
            if module is None:
                return
            for alias in node.names:
                name = dotted_name(alias.name)
                if name is not None:
                    self.bind_from(module, name, _cst_asname(alias))

    def add_ast(self, node: ast.AST) -> None:
        """Record an ``ast.Import``/``ast.ImportFrom``."""
        if isinstance(node, ast.Import):
            for alias in node.names:
                self.bind_import(alias.name, alias.asname)
        elif isinstance(node, ast.ImportFrom):
            if node.module and not node.level:
                for alias in node.names:
                    if alias.name != "*":
                        self.bind_from(node.module, alias.name, alias.asname)

    # ------------------------------------------------------------------ lookups
    def is_imported(self, local: str) -> bool:
        return local in self.names

    def resolve(self, node: cst.BaseExpression) -> Optional[str]:
        """The fully qualified name of a libcst expression if its head was imported, else ``None``."""
        raw = dotted_name(node)
        if raw is None:
            return None
        return self.resolve_dotted(raw)

    def resolve_dotted(self, raw: str) -> Optional[str]:
        head, _, rest = raw.partition(".")
        full = self.names.get(head)
        if full is None:
            return None
        return canonical(full + "." + rest if rest else full)


def _cst_asname(alias: cst.ImportAlias) -> Optional[str]:
    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
        return alias.asname.name.value
    return None
