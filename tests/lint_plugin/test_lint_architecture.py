"""The shape of ``lint_plugin``: its modules import each other without cycles, and only at module
level (an import inside a function body, or under ``if TYPE_CHECKING:``, is how a cycle hides)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

from lint_helpers import REPO_ROOT

PACKAGE = "lint_plugin"
PACKAGE_DIR = REPO_ROOT / PACKAGE


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _imported(module: str, path: Path, node: ast.AST, known: Set[str]) -> Set[str]:
    """The package modules an import statement of ``module`` refers to."""
    is_package = path.name == "__init__.py"
    targets: List[str] = []
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".")
            base = base[:len(base) - node.level + (1 if is_package else 0)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        targets = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
    return {t for t in targets if t in known and t != module}


def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: set().union(*[_imported(name, path, node, known)
                                for node in ast.walk(ast.parse(path.read_text()))]) or set()
            for name, path in modules.items()}


def _cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import cycle (as a path), or [] if there is none."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        iters = [iter(sorted(graph[start]))]
        state[start] = 1
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph[nxt])))
    return []


def test_package_has_no_import_cycles():
    graph = _graph()
    assert len(graph) > 10 and graph["lint_plugin.engine"], "the import graph was not read"
    assert _cycle(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_imports_are_at_module_level_only():
    misplaced = []
    for path in _modules().values():
        tree = ast.parse(path.read_text())
        for scope in ast.walk(tree):
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
                misplaced += [f"{path.name}:{n.lineno} in {scope.name}()" for n in ast.walk(scope)
                              if isinstance(n, (ast.Import, ast.ImportFrom))]
            elif isinstance(scope, ast.If) and "TYPE_CHECKING" in ast.unparse(scope.test):
                misplaced.append(f"{path.name}:{scope.lineno} under TYPE_CHECKING")
    assert misplaced == []
