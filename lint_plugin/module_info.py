"""What the discovery records about one file: its functions, classes, imports and root specs.

Filled by :func:`lint_plugin.discovery.discover`, read by the data flow
(:mod:`lint_plugin.walk`, :mod:`lint_plugin.fixpoint`).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Protocol, Set, TypeVar, Union

import libcst as cst

from .aliases import ImportTable
from .names import TransformSig

__all__ = ["BoundFunction", "ClassInfo", "FuncInfo", "FuncNode", "InstanceMethods", "ModuleInfo", "RootSpec"]

FuncNode = Union[cst.FunctionDef, cst.Lambda]
# what ``name = ...`` binds a function to: ``functools.partial(f, ...)`` or a lambda
BoundFunction = Union[cst.Call, cst.Lambda]
T = TypeVar("T")


class RootSpec:
    """How one transform traces the parameters of the function it wraps.

    Parameters are traced unless this says otherwise: ``static_nums``/``static_names``
    (``static_argnums``, values bound with ``functools.partial``, ``None`` in ``shard_map``'s
    ``in_specs``) are Python values; ``unknown_nums`` (``in_axes=None``) may be either;
    ``traced_nums`` (``grad``'s ``argnums``), when set, are the only traced positions;
    ``all_unknown``: the arguments could not be read (``**kwargs``, computed ``static_argnums``).
    """

    __slots__ = ("sig", "static_nums", "static_names", "traced_nums", "unknown_nums", "bound_pos",
                 "all_unknown", "module_method", "inherit_from")

    def __init__(self, sig: TransformSig) -> None:
        self.sig = sig
        self.static_nums: Set[int] = set()
        self.static_names: Set[str] = set()
        self.traced_nums: Optional[Set[int]] = None  # None: all parameters
        self.unknown_nums: Set[int] = set()
        # positional arguments bound by ``functools.partial``: the transform's argument indices
        # (``static_argnums``, ``in_axes``) start after them
        self.bound_pos = 0
        self.all_unknown = False
        self.module_method = False  # ``__call__``/``@nn.compact`` of a linen, nnx or equinox module
        # The function whose body applied the transform (``lax.scan(body, ...)`` inside ``f``):
        # the root is under ``@int8ify`` exactly when ``f`` is.
        self.inherit_from: Optional["FuncInfo"] = None


class ClassInfo:
    """A class; ``framework`` is :data:`~lint_plugin.names.LINEN`/``NNX``/``EQUINOX`` for a module
    class of one of those libraries (directly or through classes of this file)."""

    __slots__ = ("node", "name", "methods", "base_names", "fields", "framework", "is_enum", "attr_kinds")

    def __init__(self, node: cst.ClassDef) -> None:
        self.node = node
        self.name = node.name.value
        self.methods: Dict[str, FuncInfo] = {}
        self.base_names: List[str] = []
        self.fields: List[cst.AnnAssign] = []  # ``name: annotation [= value]`` in the class body
        self.framework: Optional[str] = None
        self.is_enum = False
        self.attr_kinds: Optional[Dict[str, int]] = None  # computed on first use


class FuncInfo:
    """A ``def`` or a ``lambda`` (lambdas only when passed to a transform)."""

    __slots__ = ("node", "name", "parent", "cls", "method_of", "locals", "shadowed", "roots", "traced",
                 "plain", "seed", "closure_env", "params", "calls", "is_lambda", "ret", "ret_elts",
                 "callers", "bound_functions")

    def __init__(self, node: FuncNode, name: str, parent: Optional["FuncInfo"],
                 method_of: Optional[ClassInfo], cls: Optional[ClassInfo]) -> None:
        self.node = node
        self.name = name
        self.parent = parent
        self.method_of = method_of  # class this is directly a method of
        self.cls = cls  # class whose ``self`` is visible here (methods and their nested functions)
        self.locals: Dict[str, FuncInfo] = {}
        # earlier ``def``s of a name ``locals`` holds a later one of (``if a: def f ... else: def f ...``)
        self.shadowed: Dict[str, List[FuncInfo]] = {}
        # ``name = functools.partial(...)`` and ``name = lambda ...`` in this body
        self.bound_functions: Dict[str, BoundFunction] = {}
        self.roots: List[RootSpec] = []
        self.traced = False
        self.plain = False  # traced through a path not under @int8ify
        self.seed: Dict[str, int] = {}
        self.closure_env: Optional[Dict[str, int]] = None
        self.is_lambda = isinstance(node, cst.Lambda)
        self.params = param_list(node.params)
        self.calls: List[cst.Call] = []
        self.ret: Optional[int] = None  # kind of the returned value, once walked
        self.ret_elts: Optional[List[int]] = None  # per element, when it returns tuples
        self.callers: List[FuncInfo] = []


def param_list(params: cst.Parameters) -> List[cst.Param]:
    """Positional parameters, in order (positional-only first)."""
    return list(params.posonly_params) + list(params.params)


def named_params(params: cst.Parameters) -> List[cst.Param]:
    """Every parameter with its own name: the positional ones, in order, then the keyword-only ones."""
    return param_list(params) + list(params.kwonly_params)


class InstanceMethods(Protocol):
    """Resolves ``obj.method`` for an object of a module class of this file (:mod:`lint_plugin.instances`)."""

    def method(self, expr: cst.Attribute, scope: Optional[FuncInfo]) -> Optional[FuncInfo]:
        """The method ``expr`` names, seen from ``scope``, when the class of its object is known."""


class ModuleInfo:
    """Everything the discovery found in one file."""

    __slots__ = ("imports", "functions", "module_funcs", "module_shadowed", "classes", "classes_by_name",
                 "module_calls", "by_node", "lambda_roots", "module_bound_functions", "module_assigns",
                 "module_static", "module_strings", "order", "unconditional", "instances")

    def __init__(self) -> None:
        self.imports = ImportTable()
        self.functions: List[FuncInfo] = []
        self.module_funcs: Dict[str, FuncInfo] = {}
        self.module_shadowed: Dict[str, List[FuncInfo]] = {}
        self.classes: List[ClassInfo] = []
        self.classes_by_name: Dict[str, ClassInfo] = {}
        self.module_calls: List[cst.Call] = []
        self.by_node: Dict[int, FuncInfo] = {}
        self.lambda_roots: Dict[int, FuncInfo] = {}
        self.module_bound_functions: Dict[str, BoundFunction] = {}
        # ``Name = value`` at module level (type aliases such as ``Cache = dict[str, jax.Array]``)
        self.module_assigns: Dict[str, cst.BaseExpression] = {}
        # module-level names bound only to Python values (``_EYE = np.eye(3)``), set by the analysis
        self.module_static: Set[str] = set()
        # module-level names bound to a string literal (``MODEL_MODE_TRAIN = "train"``)
        self.module_strings: Set[str] = set()
        # source order of every ``def`` and call (by ``id`` of the node), and the ``def``s that are statements of
        # their scope's own body (not under an ``if``/``try``/loop): such a ``def`` rebinds its name for good
        self.order: Dict[int, int] = {}
        self.unconditional: Set[int] = set()
        # the methods of objects of the module classes of this file, set once the classes are resolved
        self.instances: Optional[InstanceMethods] = None

    def lookup(self, name: str, scope: Optional[FuncInfo]) -> Optional[FuncInfo]:
        """The function a bare name refers to, from inside ``scope``."""
        return _innermost(name, scope, "locals", self.module_funcs)

    def lookup_all(self, name: str, scope: Optional[FuncInfo], at: Optional[cst.CSTNode] = None) -> List[FuncInfo]:
        """Every ``def`` of a bare name in the innermost scope that has one that the name may refer to at the
        call ``at``: a name defined on two branches may refer to either. A ``def`` of the scope's own body
        hides the ones before it (a notebook that redefines ``loss``), and a call that runs in that body
        itself (not in a nested function, which runs later) sees only the ``def``s before it."""
        last = self.lookup(name, scope)
        if last is None:
            return []
        f = scope
        while f is not None and f.locals.get(name) is not last:
            f = f.parent
        shadowed = f.shadowed if f is not None else self.module_shadowed
        defs = [*shadowed.get(name, ()), last]
        if len(defs) == 1 or at is None:
            return defs
        pos = self.order.get(id(at))
        if pos is not None and scope is f:
            defs = [d for d in defs if self.order.get(id(d.node), -1) < pos] or defs
        for i in range(len(defs) - 1, 0, -1):
            if id(defs[i].node) in self.unconditional:
                return defs[i:]
        return defs

    def lookup_expr(self, expr: cst.BaseExpression, scope: Optional[FuncInfo]) -> Optional[FuncInfo]:
        """The function ``name`` or ``self.method`` refers to, from inside ``scope``."""
        if isinstance(expr, cst.Name):
            return self.lookup(expr.value, scope)
        if (isinstance(expr, cst.Attribute) and isinstance(expr.value, cst.Name)
                and expr.value.value == "self" and scope is not None and scope.cls is not None):
            return scope.cls.methods.get(expr.attr.value)
        return None

    def lookup_callee(self, expr: cst.BaseExpression, scope: Optional[FuncInfo]) -> Optional[FuncInfo]:
        """The function a call of ``expr`` from inside ``scope`` runs: as :meth:`lookup_expr`, or ``obj.method``
        of an instance of a module class of this file (see :mod:`lint_plugin.instances`). Not for the functions
        given to transforms: flax nnx refuses bound methods there (``nnx.jit(model.encode)`` raises)."""
        fi = self.lookup_expr(expr, scope)
        if fi is None and isinstance(expr, cst.Attribute) and self.instances is not None:
            return self.instances.method(expr, scope)
        return fi

    def bound_function_at(self, name: str, scope: Optional[FuncInfo], at: cst.CSTNode) -> Optional[BoundFunction]:
        """The ``functools.partial(...)`` call or the lambda a bare name holds at the call ``at`` from inside
        ``scope``: the one bound to it in the innermost scope that binds the name, unless a ``def`` of the name
        there replaces it, one that comes after it (``foo = partial(foo, flag=True)`` rebinds the ``def foo``
        before it). A call in that scope's own body sees only what was bound before it; one in a nested
        function runs later and sees the last binding."""
        f = scope
        while f is not None and name not in f.bound_functions and name not in f.locals:
            f = f.parent
        bound_functions, functions = (f.bound_functions, f.locals) if f is not None \
            else (self.module_bound_functions, self.module_funcs)
        bound = bound_functions.get(name)
        if bound is None:
            return None
        order = self.order
        end = order.get(id(at), len(order)) if scope is f else len(order)
        bound_at = order.get(id(bound), end)
        if bound_at >= end:
            return None
        defs = [*(f.shadowed if f is not None else self.module_shadowed).get(name, ()), functions.get(name)]
        if any(d is not None and bound_at < order.get(id(d.node), -1) < end for d in defs):
            return None
        return bound


def _innermost(name: str, scope: Optional[FuncInfo], table: str, module_table: Dict[str, T]) -> Optional[T]:
    """``name`` in the ``table`` of the innermost enclosing function that has it, else at module level."""
    f = scope
    while f is not None:
        hit = getattr(f, table).get(name)
        if hit is not None:
            return hit
        f = f.parent
    return module_table.get(name)
