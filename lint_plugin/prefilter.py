"""Skip work early: decide from flake8's ``ast`` tree (already parsed, free) whether a file can hold
traced code at all, before paying for the libcst parse (~10x the cost of ``ast.parse``).

The test is a conservative superset of :func:`lint_plugin.discovery.discover`'s roots: a decorator
or call that resolves to a transform / ``int8ify`` / an extra traced decorator (directly or
through ``functools.partial``), or a class deriving from ``flax.linen.Module``.
"""

from __future__ import annotations

import ast
from typing import Dict, FrozenSet, Optional

from .aliases import _canonical
from .names import FLAX_MODULE_BASES, TRANSFORMS, is_int8ify

__all__ = ["may_have_traced_code"]


def _dotted(node: ast.AST) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def may_have_traced_code(tree: ast.AST, extra: FrozenSet[str] = frozenset()) -> bool:
    imports: Dict[str, str] = {}
    candidates = []
    for node in ast.walk(tree):
        t = type(node)
        if t is ast.Import:
            for a in node.names:  # type: ignore[attr-defined]
                if a.asname:
                    imports[a.asname] = a.name
                else:
                    top = a.name.split(".", 1)[0]
                    imports[top] = top
        elif t is ast.ImportFrom:
            if node.module and not node.level:  # type: ignore[attr-defined]
                for a in node.names:  # type: ignore[attr-defined]
                    imports[a.asname or a.name] = f"{node.module}.{a.name}"  # type: ignore[attr-defined]
        elif t is ast.Call:
            candidates.append(node.func)  # type: ignore[attr-defined]
            if node.args:  # type: ignore[attr-defined]
                candidates.append(node.args[0])  # type: ignore[attr-defined]  # partial(jax.jit, ...)
        elif t is ast.FunctionDef or t is ast.AsyncFunctionDef:
            candidates.extend(node.decorator_list)  # type: ignore[attr-defined]
        elif t is ast.ClassDef:
            candidates.extend(node.bases)  # type: ignore[attr-defined]
    for expr in candidates:
        raw = _dotted(expr)
        if raw is None:
            continue
        head, _, rest = raw.partition(".")
        full = imports.get(head)
        q = _canonical(full + "." + rest if rest else full) if full is not None else None
        if q is not None and (q in TRANSFORMS or q in FLAX_MODULE_BASES):
            return True
        if is_int8ify(q, raw):
            return True
        if extra and (raw in extra or (q is not None and q in extra) or raw.rsplit(".", 1)[-1] in extra):
            return True
    return False
