"""Skip work early: decide, before paying for the libcst parse (~10x the cost of ``ast.parse``),
which rules can apply to a file at all.

Two stages, both conservative supersets of what the analysis would find:

1. text: the file must spell a package the rules know (``jax``, ``flax``, ``equinox``,
   ``int8ify``) or an extra traced decorator, and a marker word: the last part of a transform or
   module base class of :mod:`lint_plugin.names` (``jit``, ``scan``, ``pallas_call``, ``Module``,
   ...) for traced code, ``int8`` for the rule that applies anywhere (JX102);
2. ``ast`` (flake8's tree, already parsed, so free): with the imports resolved by the same
   :class:`~lint_plugin.aliases.ImportTable` the analysis uses, traced code needs a decorator,
   call or base class that resolves to a transform, a module base class, ``int8ify`` or an extra
   traced decorator (directly or through ``functools.partial``); JX102 needs a matmul.
"""

from __future__ import annotations

import ast
import re
from typing import List, NamedTuple, Optional, Tuple

from .aliases import ImportTable, ast_dotted_name
from .names import MATMUL_FUNCS, MODULE_BASES, TRANSFORMS
from .roots import transform_sig
from .traced_decorators import TracedDecorators

__all__ = ["Applicable", "applicable_rules"]

_ROOT_NAMES = (*TRANSFORMS, *MODULE_BASES)
_PACKAGES = tuple(sorted({q.split(".", 1)[0] for q in _ROOT_NAMES} | {"int8ify"}))
_MARKERS = re.compile(r"\b(?:%s)\b" % "|".join(sorted({q.rsplit(".", 1)[-1] for q in _ROOT_NAMES} | {"int8ify"})))


class Applicable(NamedTuple):
    """Which rules the file needs: ``traced`` (it may define traced code), ``anywhere`` (it may hold
    an int8 matmul outside traced code); ``tree``: its ``ast`` when it was read (None if it does not
    parse)."""

    traced: bool
    anywhere: bool
    tree: Optional[ast.AST] = None


_NOTHING = Applicable(False, False)


def applicable_rules(source: str, tree: Optional[ast.AST], extra: TracedDecorators) -> Applicable:
    """What the rules need to look at in ``source``; ``tree``: its ``ast`` if already parsed, else
    it is parsed here once the text stage lets the file through."""
    if not any(p in source for p in _PACKAGES) and not extra.mentioned_in(source):
        return _NOTHING
    traced = _MARKERS.search(source) is not None or extra.mentioned_in(source)
    int8 = "int8" in source
    if not traced and not int8:
        return _NOTHING
    if tree is None:
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return Applicable(traced, int8)  # let the libcst parse report it
    return _scan(tree, extra, traced, int8)


def _scan(tree: ast.AST, extra: TracedDecorators, want_traced: bool, want_matmul: bool) -> Applicable:
    imports = ImportTable()
    candidates: List[ast.AST] = []
    matmul_calls: List[ast.AST] = []
    has_matmul = False
    for node in ast.walk(tree):
        t = type(node)
        if t is ast.Import or t is ast.ImportFrom:
            imports.add_ast(node)
        elif t is ast.Assign and len(node.targets) == 1 and type(node.targets[0]) is ast.Name:  # type: ignore
            raw = ast_dotted_name(node.value)  # type: ignore[attr-defined]
            if raw is not None:
                imports.bind_alias(node.targets[0].id, raw)  # type: ignore[attr-defined]  # mm = jnp.matmul
        elif t is ast.Call:
            func = node.func  # type: ignore[attr-defined]
            candidates.append(func)
            if node.args:  # type: ignore[attr-defined]
                candidates.append(node.args[0])  # type: ignore[attr-defined]  # partial(jax.jit, ...)
            if type(func) is ast.Attribute and func.attr in ("dot", "__matmul__", "__rmatmul__"):
                has_matmul = True  # ``x.dot(w)``, ``x.__matmul__(w)``
            else:
                matmul_calls.append(func)
        elif t is ast.MatMult:
            has_matmul = True
        elif t is ast.FunctionDef or t is ast.AsyncFunctionDef:
            candidates.extend(node.decorator_list)  # type: ignore[attr-defined]
        elif t is ast.ClassDef:
            candidates.extend(node.bases)  # type: ignore[attr-defined]
    traced = want_traced and any(_is_root_marker(expr, imports, extra) for expr in candidates)
    if want_matmul and not has_matmul:
        has_matmul = any(_resolve(expr, imports)[1] in MATMUL_FUNCS for expr in matmul_calls)
    return Applicable(traced, want_matmul and has_matmul, tree)


def _resolve(expr: ast.AST, imports: ImportTable) -> Tuple[Optional[str], Optional[str]]:
    """The dotted spelling of ``expr`` and what it resolves to through the imports."""
    raw = ast_dotted_name(expr)
    return raw, (imports.resolve_dotted(raw) if raw is not None else None)


def _is_root_marker(expr: ast.AST, imports: ImportTable, extra: TracedDecorators) -> bool:
    raw, q = _resolve(expr, imports)
    if raw is None:
        return False
    return (q is not None and q in MODULE_BASES) or transform_sig(raw, q, extra) is not None
