"""The module class of this file that an object is an instance of, where the source says so for certain.

``model.encode(x)`` in traced code runs ``encode`` of ``model``'s class as traced code, as ``self.encode(x)`` does
in a method; so does ``model.apply(variables, x, method="encode")`` for a linen module. The class is known when
every binding of the name, in the innermost scope that binds it, names one linen, nnx or equinox module class of
this file:

* ``model = Model(...)`` (in the function, an enclosing function or at module level), or ``Model(...)`` itself;
* a parameter annotated ``model: Model`` (or ``Optional[Model]``);
* an unannotated parameter to which the calls of this file pass such an instance (``step(Model(), x)``,
  ``step(model, x)``), also the first parameter of ``fn`` in ``nn.apply(fn, Model())``, which receives the
  bound module; the calls whose argument has a known class must all pass the same one.

Any other binding of the name in that scope (a loop or ``with`` target, an unpacking, a reassignment from another
call, an import, ``global``, a lambda or comprehension variable of the same name) leaves it unknown, and nothing is
resolved through it.
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import libcst as cst

from .annotations import annotated_class
from .call_args import kwarg, positional
from .cstwalk import iter_children
from .module_info import ClassInfo, FuncInfo, ModuleInfo, named_params
from .names import TRANSFORMS

__all__ = ["InstanceClasses"]

# What binds a name in a scope: the call it is assigned from (``model = Model(...)``), the class it defines, the
# parameter it is, or None for any other binding.
_Binding = Optional[cst.CSTNode]
_Bindings = Dict[str, List[_Binding]]
# the scope that binds a name (None: the module) and its bindings there
_Found = Tuple[Optional[FuncInfo], List[_Binding]]


class InstanceClasses:
    """Answers, for one file, which module class of the file a name or expression is an instance of."""

    def __init__(self, info: ModuleInfo, module_body: Sequence[cst.CSTNode]) -> None:
        self.info = info
        self.module_body = module_body
        self._scopes: Dict[int, _Bindings] = {}  # by ``id`` of the function, 0 for the module
        self._method_names: Optional[Set[str]] = None
        self._classes: Optional[Dict[int, ClassInfo]] = None  # by ``id`` of the ``class`` statement
        self._passed: Optional[Dict[int, Dict[str, Set[ClassInfo]]]] = None  # see _passed_classes

    def method(self, expr: cst.Attribute, scope: Optional[FuncInfo]) -> Optional[FuncInfo]:
        """The method ``obj.name`` refers to, when ``obj``'s class is known (see the module docstring)."""
        if self._method_names is None:
            self._method_names = {m for c in self.info.classes if c.framework is not None for m in c.methods}
        name = expr.attr.value
        if name not in self._method_names:
            return None  # no module class of this file has it: nothing to resolve
        cls = self.class_of(expr.value, scope)
        return cls.methods.get(name) if cls is not None else None

    def class_of(self, expr: cst.BaseExpression, scope: Optional[FuncInfo],
                 from_calls: bool = True) -> Optional[ClassInfo]:
        """The module class ``expr`` (``Model(...)`` or a name) is an instance of, seen from ``scope``;
        ``from_calls``: also from the arguments the calls of this file pass to an unannotated parameter."""
        if isinstance(expr, cst.Call):
            return self._constructed(expr, scope)
        if not isinstance(expr, cst.Name):
            return None
        found = self._bindings(expr.value, scope)
        if found is None:
            return None
        owner, bindings = found
        classes = {self._bound_class(b, owner, from_calls) for b in bindings}
        return classes.pop() if len(classes) == 1 else None

    def _constructed(self, call: cst.Call, scope: Optional[FuncInfo]) -> Optional[ClassInfo]:
        """The class ``call`` constructs: ``Model(...)``."""
        return self.class_named(call.func.value, scope) if isinstance(call.func, cst.Name) else None

    def class_named(self, name: str, scope: Optional[FuncInfo]) -> Optional[ClassInfo]:
        """The module class ``name`` stands for, seen from ``scope``: its only binding there is the ``class``
        statement of a linen, nnx or equinox module (test files define a ``Foo`` in many test functions)."""
        found = self._bindings(name, scope)
        if found is None or len({id(b) for b in found[1]}) != 1 or not isinstance(found[1][0], cst.ClassDef):
            return None
        if self._classes is None:
            self._classes = {id(c.node): c for c in self.info.classes}
        cls = self._classes[id(found[1][0])]
        return cls if cls.framework is not None else None

    def _bound_class(self, binding: _Binding, owner: Optional[FuncInfo],
                     from_calls: bool) -> Optional[ClassInfo]:
        if isinstance(binding, cst.Call):
            return self._constructed(binding, owner)
        if not isinstance(binding, cst.Param) or owner is None:
            return None
        if binding.annotation is not None:
            named = annotated_class(binding.annotation)
            return self.class_named(named, owner.parent) if named and "." not in named else None
        if not from_calls:
            return None
        passed = self._passed_classes().get(id(owner), {}).get(binding.name.value, set())
        return next(iter(passed)) if len(passed) == 1 else None

    def _bindings(self, name: str, scope: Optional[FuncInfo]) -> Optional[_Found]:
        """The bindings of ``name`` in the innermost scope (from ``scope`` out to the module) that has any."""
        f = scope
        while f is not None:
            table = self._scope_bindings(f)
            if name in table:
                return f, table[name]
            f = f.parent
        table = self._scope_bindings(None)
        return (None, table[name]) if name in table else None

    def _scope_bindings(self, fi: Optional[FuncInfo]) -> _Bindings:
        key = id(fi) if fi is not None else 0
        table = self._scopes.get(key)
        if table is None:
            table = {}
            if fi is None:
                _scan(self.module_body, table)
            elif isinstance(fi.node, cst.Lambda):
                _scan([fi.node], table)
            else:
                for p in named_params(fi.node.params):
                    _record(table, p.name.value, p)
                for star in _star_params(fi.node.params):
                    _record(table, star.name.value, None)
                _scan([fi.node.body], table)
            self._scopes[key] = table
        return table

    def _passed_classes(self) -> Dict[int, Dict[str, Set[ClassInfo]]]:
        """For each function of this file (by ``id``), the classes the calls of this file pass to each of its
        parameters, where the argument's class is known from bindings and annotations."""
        if self._passed is None:
            self._passed = {}
            info = self.info
            if any(c.framework is not None for c in info.classes):
                calls = [(c, None) for c in info.module_calls]
                calls.extend((c, fi) for fi in info.functions for c in fi.calls)
                for call, scope in calls:
                    for callee, param, arg in self._arguments(call, scope):
                        cls = self.class_of(arg, scope, from_calls=False)
                        if cls is not None:
                            self._passed.setdefault(id(callee), {}).setdefault(param, set()).add(cls)
        return self._passed

    def _arguments(self, call: cst.Call,
                   scope: Optional[FuncInfo]) -> Iterator[Tuple[FuncInfo, str, cst.BaseExpression]]:
        """``(function, parameter, argument)`` for what ``call`` passes to functions of this file: a direct call
        ``f(a, b=c)``, or the module of ``nn.apply(fn, module)``, passed to ``fn``'s first parameter."""
        info = self.info
        q = info.imports.resolve(call.func)
        sig = TRANSFORMS.get(q) if q is not None else None
        if sig is not None and sig.params == "bound_module":
            args = positional(call)
            fn = args[0] if args else kwarg(call, "fn")
            module = args[1] if len(args) > 1 else kwarg(call, "module")
            if isinstance(fn, cst.Name) and module is not None:
                for callee in info.lookup_all(fn.value, scope, call):
                    if callee.params:
                        yield callee, callee.params[0].name.value, module
            return
        if not isinstance(call.func, cst.Name):
            return
        for callee in info.lookup_all(call.func.value, scope, call):
            params = callee.params
            for i, a in enumerate(call.args):  # positional arguments come first
                if a.star:
                    break
                if a.keyword is not None:
                    yield callee, a.keyword.value, a.value
                elif i < len(params):
                    yield callee, params[i].name.value, a.value


def _scan(roots: Iterable[cst.CSTNode], table: _Bindings) -> None:
    """Record every name the code under ``roots`` binds in its own scope (not in nested functions and classes,
    whose names, decorators and defaults it does record). Names a lambda or comprehension inside binds are recorded
    too, as unknown: the analysis evaluates those inline, where such a name hides the scope's own."""
    stack = list(roots)
    while stack:
        node = stack.pop()
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            _record(table, node.name.value, node if isinstance(node, cst.ClassDef) else None)
            stack.extend(d.decorator for d in node.decorators)
            if isinstance(node, cst.ClassDef):
                stack.extend(a.value for a in node.bases)
            else:
                stack.extend(p.default for p in named_params(node.params) if p.default is not None)
            continue
        if isinstance(node, (cst.Assign, cst.AnnAssign)):
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            if node.value is not None:
                for target in targets:
                    if isinstance(target, cst.Name) and isinstance(node.value, cst.Call):
                        _record(table, target.value, node.value)
                    else:
                        _record_targets(table, target)
        elif isinstance(node, (cst.AugAssign, cst.For, cst.CompFor, cst.NamedExpr)):
            _record_targets(table, node.target)
        elif isinstance(node, (cst.WithItem, cst.ExceptHandler, cst.ExceptStarHandler)):
            asname = node.asname if isinstance(node, cst.WithItem) else node.name
            if asname is not None:
                _record_targets(table, asname.name)
        elif isinstance(node, (cst.Import, cst.ImportFrom)) and not isinstance(node.names, cst.ImportStar):
            for alias in node.names:
                bound = alias.asname.name if alias.asname is not None else alias.name
                while isinstance(bound, cst.Attribute):
                    bound = bound.value  # ``import a.b`` binds ``a``
                _record_targets(table, bound)
        elif isinstance(node, (cst.Global, cst.Nonlocal)):
            for item in node.names:
                _record(table, item.name.value, None)
        elif isinstance(node, cst.Lambda):
            for p in (*named_params(node.params), *_star_params(node.params)):
                _record(table, p.name.value, None)
        elif isinstance(node, (cst.MatchAs, cst.MatchStar)) and node.name is not None:
            _record(table, node.name.value, None)
        elif isinstance(node, cst.MatchMapping) and node.rest is not None:
            _record(table, node.rest.value, None)
        stack.extend(iter_children(node))


def _star_params(params: cst.Parameters) -> List[cst.Param]:
    return [star for star in (params.star_arg, params.star_kwarg) if isinstance(star, cst.Param)]


def _record_targets(table: _Bindings, target: cst.BaseExpression) -> None:
    """The names an assignment target binds (``a``, ``a, *b``), as unknown; ``obj.attr`` and ``obj[i]`` bind none."""
    if isinstance(target, cst.Name):
        _record(table, target.value, None)
    elif isinstance(target, (cst.Tuple, cst.List)):
        for el in target.elements:
            _record_targets(table, el.value)
    elif isinstance(target, cst.StarredElement):
        _record_targets(table, target.value)


def _record(table: _Bindings, name: str, binding: _Binding) -> None:
    table.setdefault(name, []).append(binding)
