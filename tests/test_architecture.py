"""The packages' layout, checked from the source with ``ast`` so it holds for every module, tested or not:

* the import graphs: no cycle in either, and no import inside a function or under ``if TYPE_CHECKING:`` (how a
  cycle hides);
* what int8ify knows about a primitive is in its rule (``jaxpr_rewrite/_interpret/rules/``): no primitive name is
  compared anywhere else;
* what a backend can take is asked of the backend: no backend name is compared outside the backend registry;
* the layers of ``jaxpr_rewrite`` import downwards only (:data:`LAYERS`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import jax.extend.core.primitives
import pytest
from jax.extend.core import Primitive

from jaxpr_rewrite._core.backends import BACKEND_ALIASES, BACKENDS
from jaxpr_rewrite._core.jaxprs import SUBJAXPR_PARAMS
from jaxpr_rewrite._interpret.rules import RULES

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


# -- names compared where they belong ----------------------------------------------------------------------------
# Every primitive name JAX exports, and those the rules know (``pjit`` is ``jit`` in newer versions); ``name`` is
# also a primitive but mostly a params key.
PRIMITIVE_NAMES = ({p.name for p in vars(jax.extend.core.primitives).values() if isinstance(p, Primitive)}
                   | set(RULES) | set(SUBJAXPR_PARAMS)) - {"name"}
BACKEND_NAMES = set(BACKENDS) | set(BACKEND_ALIASES)


def _string_constants(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, (ast.Set, ast.Tuple, ast.List)):
        for item in node.elts:
            yield from _string_constants(item)


def _compared_names(source: str, names: set) -> list[tuple[int, str]]:
    """``(line, name)`` for every comparison (``==``, ``!=``, ``in``, ...) of a string constant in ``names``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found += [(node.lineno, name) for name in _string_constants(operand) if name in names]
    return found


def _modules(exempt: tuple[str, ...]):
    for path in sorted((ROOT / "jaxpr_rewrite").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if not relative.startswith(exempt):
            yield relative, path.read_text(encoding="utf-8")


def test_no_primitive_name_is_compared_outside_the_rules():
    # verify.py's JX checks (JX102-JX104 patterns, callbacks) are the contract checker's own table
    exempt = ("jaxpr_rewrite/_interpret/rules/", "jaxpr_rewrite/_inspect/verify.py")
    found = [(module, line, name) for module, source in _modules(exempt)
             for line, name in _compared_names(source, PRIMITIVE_NAMES)]
    assert found == [], found


def test_no_backend_name_is_compared_outside_the_backend_registry():
    found = [(module, line, name) for module, source in _modules(("jaxpr_rewrite/_core/backends.py",))
             for line, name in _compared_names(source, BACKEND_NAMES)]
    assert found == [], found


def test_the_name_checks_see_comparisons():
    source = 'if eqn.primitive.name == "scan" or name in ("while", "x") or backend != "int8":\n    pass\n'
    assert _compared_names(source, PRIMITIVE_NAMES) == [(1, "scan"), (1, "while")]
    assert _compared_names(source, BACKEND_NAMES) == [(1, "int8")]
    assert _compared_names('x = {"scan": 1}["scan"]\n', PRIMITIVE_NAMES) == []


# -- layers ------------------------------------------------------------------------------------------------------
# jaxpr_rewrite's layers, lowest first: a module imports modules of its own layer or of lower ones, never of a
# higher one (within a layer, the module graph has no cycle: test_import_graph_has_no_cycle). A layer is a private
# subpackage or a module; the public modules (the package's __init__, cli, and the thin re-exporting modules
# checkpoint, safetensors_io, quantized, plotting) sit on top.
LAYERS = (
    "_compat",  # the one module that reads jax._src
    "_core",  # errors, jaxpr walking, source lines, name scopes, shapes, the platform and backend registries
    "_numerics",  # the contract's formulas: scales, exact division, codes, static scales, float formats
    "_quantized",  # QuantizedArray and its stored layout, static activation scales
    "_io",  # checkpoints and SafeTensors files of quantized pytrees
    "_dots",  # one rewritten dot: operands quantized, the int8 dot, the epilogue, straight-through gradients
    "_platforms",  # what differs per platform (CPU, GPU, TPU): implementations of _core.platforms' protocol
    "_interpret",  # the options, the evaluator, the rewriting interpreter and its per-primitive rules
    "_backends",  # what a float dot becomes (int8, int8-fused, mxfp8, nvfp4), registered with _core.backends
    "_tracing",  # a function traced to a jaxpr, static arguments, argument updates
    "_ptq",  # post-training quantization: quantize_params, calibration
    "_inspect",  # report, verify, plots
    "_api",  # int8ify
)
PUBLIC_MODULES = ("__init__", "__main__", "cli", "checkpoint", "safetensors_io", "quantized", "plotting")


def _layer(module: str) -> int:
    """The layer of a ``jaxpr_rewrite`` module: its index in :data:`LAYERS`, past them for the public modules."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in PUBLIC_MODULES:
        return len(LAYERS)
    return LAYERS.index(parts[1])


def _upward_imports(imports: dict) -> list:
    return [(module, target, line) for module, deps in imports.items() for target, line, _ in deps
            if target != "jaxpr_rewrite" and _layer(target) > _layer(module)]


def test_every_module_belongs_to_a_layer():
    modules = _imports("jaxpr_rewrite")
    unplaced = [m for m in modules if len(m.split(".")) > 1
                and m.split(".")[1] not in LAYERS + PUBLIC_MODULES]
    assert unplaced == [], unplaced


def test_layers_import_downwards_only():
    upward = _upward_imports(_imports("jaxpr_rewrite"))
    assert upward == [], "\n".join(f"{m} imports {t} (line {line}), a higher layer" for m, t, line in upward)


def test_the_layer_check_sees_an_upward_import():
    imports = {"jaxpr_rewrite._numerics.quantize": [("jaxpr_rewrite._api", 3, False)],
               "jaxpr_rewrite._api": [("jaxpr_rewrite._numerics.quantize", 5, False)]}
    assert _upward_imports(imports) == [("jaxpr_rewrite._numerics.quantize", "jaxpr_rewrite._api", 3)]
