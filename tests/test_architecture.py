"""The packages' import graphs: no cycle in either, and no import inside a function or under ``if TYPE_CHECKING:``
(how a cycle hides).

Read from the source with ``ast`` (nothing is imported), so it holds for every module, tested or not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxpr_rewrite", "lint_plugin")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(package: str):
    """``{module: [(imported module, line, inside a function)]}`` for the package's intra-package imports."""
    modules = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found = []
        hiding = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                  or (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))]
        nested = {id(n) for f in hiding for n in ast.walk(f) if n is not f}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(module, path.name == "__init__.py", node)
                names = [f"{target}.{a.name}" for a in node.names]
                candidates = [target] + names
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            for name in candidates:
                if name == package or name.startswith(package + "."):
                    found.append((name, node.lineno, id(node) in nested))
        modules[module] = found
    # keep only names that are modules (``from .x import f`` names the module x, not x.f)
    return {
        m: [(t if t in modules else t.rsplit(".", 1)[0], line, inner) for t, line, inner in deps
            if t in modules or t.rsplit(".", 1)[0] in modules]
        for m, deps in modules.items()
    }


def _cycle(graph: dict) -> list | None:
    state: dict = {}
    stack: list = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in graph.get(node, ()):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in graph:
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


@pytest.mark.parametrize("package", PACKAGES)
def test_import_graph_has_no_cycle(package):
    imports = _imports(package)
    # a package's __init__ re-exports its modules; the modules never import the package itself back
    graph = {m: sorted({t for t, _, _ in deps if t != m and t != package}) for m, deps in imports.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_inside_a_function_or_type_checking_block(package):
    inner = [(m, t, line) for m, deps in _imports(package).items() for t, line, nested in deps if nested]
    assert inner == [], inner


def test_the_check_sees_a_cycle():
    assert _cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert _cycle({"a": ["b"], "b": []}) is None
