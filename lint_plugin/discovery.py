"""Find the functions of a file and which of them run as traced code.

One walk over the module records imports, every function (with its decorators, class and
enclosing function), every class (with its bases and annotated fields), every call, module-level
assignments and ``functools.partial`` bindings. Afterwards:

* *roots* are functions decorated with or passed to a JAX transform (``jax.jit``, ``jax.vmap``,
  ``jax.grad``, ``lax.scan`` bodies, their ``flax.nnx`` versions, ``pl.pallas_call`` kernels,
  ``@pl.when`` bodies, ``jax.custom_vjp``/``custom_jvp`` primals and the rules ``f.defvjp``/``f.defjvp``
  register, ...), ``int8ify``, ``equinox.filter_*``, the extra decorators named by
  ``--jx-traced-decorators``, the ``fn`` of ``flax.linen.apply(fn, module)``, ``__call__`` of flax
  linen, flax nnx and equinox modules, ``@nn.compact`` methods of linen modules and the linen methods
  given as ``method=`` to ``apply``/``init`` (``Model.encode``, ``model.encode``, ``"encode"``; see
  :mod:`lint_plugin.roots` and :mod:`lint_plugin.instances`);
* module-local functions called from traced code become traced too, and so do the methods called on
  objects of a module class of this file whose class is known (``model.encode(x)``, see
  :mod:`lint_plugin.instances`); that closure (and which parameters of a helper receive traced values)
  is computed in :mod:`lint_plugin.fixpoint`, which knows the kinds of the arguments at each call site.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import libcst as cst

from .aliases import dotted_name
from .call_args import kwarg
from .cstwalk import STRING_NODES, iter_children
from .instances import InstanceClasses
from .module_classes import resolve_classes
from .module_info import ClassInfo, FuncInfo, ModuleInfo, RootSpec, named_params
from .names import LINEN, LINEN_COMPACT, TRANSFORMS
from .roots import RootFinder, add_root
from .traced_decorators import TracedDecorators

__all__ = ["discover"]

_Frame = Tuple[cst.CSTNode, Optional[FuncInfo], Optional[ClassInfo], Optional[ClassInfo]]
_BLOCKS = (cst.IndentedBlock, cst.SimpleStatementLine, cst.SimpleStatementSuite)


class _Walker:
    """One iterative pass over the module (deep expressions cannot exhaust the Python stack)."""

    def __init__(self, info: ModuleInfo) -> None:
        self.info = info
        self.decorated: List[Tuple[FuncInfo, Sequence[cst.Decorator]]] = []

    def walk(self, module: cst.Module) -> None:
        info = self.info
        # (node, enclosing function, class whose body this directly is, class whose ``self`` is visible)
        stack: List[_Frame] = [(module, None, None, None)]
        pop = stack.pop
        push = stack.append
        while stack:
            node, func, cls, self_cls = pop()
            t = type(node)
            if t is cst.Call:
                info.order[id(node)] = len(info.order)
                if func is None:
                    info.module_calls.append(node)  # type: ignore[arg-type]
                else:
                    func.calls.append(node)  # type: ignore[arg-type]
            elif t is cst.FunctionDef:
                self._function(node, func, cls, self_cls, push)  # type: ignore[arg-type]
                continue
            elif t is cst.ClassDef:
                ci = ClassInfo(node)  # type: ignore[arg-type]
                info.classes.append(ci)
                info.classes_by_name[ci.name] = ci
                for b in node.bases:  # type: ignore[attr-defined]
                    raw = dotted_name(b.value)
                    if raw is not None:
                        ci.base_names.append(raw)
                    push((b.value, func, None, self_cls))
                for d in node.decorators:  # type: ignore[attr-defined]
                    push((d, func, None, self_cls))
                push((node.body, func, ci, None))  # type: ignore[attr-defined]
                continue
            elif t is cst.Import or t is cst.ImportFrom:
                info.imports.add(node)
                continue
            elif t is cst.Assign or t is cst.AnnAssign:
                self._assignment(node, func, cls)  # type: ignore[arg-type]
            elif t is cst.SimpleString or t is cst.Integer or t is cst.Float or t is cst.Name:
                continue
            block = t in _BLOCKS
            # pushed last to first, so nodes come off the stack in source order: a later import or
            # ``def`` of the same name wins, as when Python runs the file
            for child in reversed(tuple(iter_children(node))):
                push((child, func, cls if block else None, self_cls))

    def _function(self, node: cst.FunctionDef, func: Optional[FuncInfo], cls: Optional[ClassInfo],
                  self_cls: Optional[ClassInfo], push: Callable[[_Frame], None]) -> None:
        info = self.info
        info.order[id(node)] = len(info.order)
        fi = FuncInfo(node, node.name.value, func, cls, cls or self_cls)
        info.functions.append(fi)
        info.by_node[id(node)] = fi
        if cls is not None:
            cls.methods[fi.name] = fi
        else:
            if func is not None:
                table, shadowed = func.locals, func.shadowed
            else:
                table, shadowed = info.module_funcs, info.module_shadowed
            earlier = table.get(fi.name)
            if earlier is not None:
                shadowed.setdefault(fi.name, []).append(earlier)
            table[fi.name] = fi
        if node.decorators:
            self.decorated.append((fi, node.decorators))
            for d in node.decorators:
                push((d, func, None, self_cls))
        for p in named_params(node.params):
            if p.default is not None:
                push((p.default, func, None, self_cls))
        push((node.body, fi, None, cls or self_cls))

    def _assignment(self, node: cst.BaseSmallStatement, func: Optional[FuncInfo], cls: Optional[ClassInfo]) -> None:
        """Record what later lookups need: class fields, module-level values, names bound to a
        ``functools.partial`` or a lambda."""
        if isinstance(node, cst.AnnAssign):
            if cls is not None and isinstance(node.target, cst.Name):
                cls.fields.append(node)
            targets = [node.target]
        else:
            targets = [t.target for t in node.targets]  # type: ignore[attr-defined]
        value = node.value  # type: ignore[attr-defined]
        if value is None or cls is not None:
            return
        for target in targets:
            if not isinstance(target, cst.Name):
                continue
            name = target.value
            if func is None:
                self.info.module_assigns[name] = value
                raw = dotted_name(value)
                if raw is not None:
                    self.info.imports.bind_alias(name, raw)  # ``mm = jnp.matmul``: ``mm(x, w)`` is jnp.matmul
            if isinstance(value, cst.Lambda) or (isinstance(value, cst.Call)
                                                 and (dotted_name(value.func) or "").endswith("partial")):
                bound = self.info.module_bound_functions if func is None else func.bound_functions
                bound[name] = value
                if isinstance(value, cst.Lambda):
                    self.info.order[id(value)] = len(self.info.order)  # a call's place is taken when it is reached


def _module_method_spec() -> RootSpec:
    spec = RootSpec(TRANSFORMS["jax.jit"])
    spec.module_method = True
    return spec


def _mark_unconditional(info: ModuleInfo, module: cst.Module) -> None:
    """Record the ``def``s that are statements of their scope's own body (see :meth:`ModuleInfo.lookup_all`)."""
    bodies: List[Sequence[cst.CSTNode]] = [module.body]
    for fi in info.functions:
        if isinstance(fi.node, cst.FunctionDef) and isinstance(fi.node.body, cst.IndentedBlock):
            bodies.append(fi.node.body.body)
    for body in bodies:
        info.unconditional.update(id(s) for s in body if isinstance(s, cst.FunctionDef))


# the linen ``Module`` methods that run a method of the module given as ``method=`` (``model.apply(params, x,
# method=Model.encode)``) like ``__call__``
_LINEN_APPLY_METHODS = frozenset({"apply", "init", "init_with_output"})


def _applied_method(info: ModuleInfo, instances: InstanceClasses, call: cst.Call, scope: Optional[FuncInfo]) -> None:
    """``m.apply(variables, ..., method=...)`` naming a method of a linen module of this file: ``Model.encode``,
    ``model.encode`` (``model``'s class known, see :mod:`lint_plugin.instances`) or ``"encode"`` (a method of the
    class of ``m``) runs as ``__call__`` does (a root like it)."""
    func = call.func
    target = kwarg(call, "method")
    if not isinstance(func, cst.Attribute) or func.attr.value not in _LINEN_APPLY_METHODS or target is None:
        return
    if isinstance(target, cst.Attribute):  # ``Model.encode`` or ``model.encode``
        owner, name = target.value, target.attr.value
        cls = instances.class_named(owner.value, scope) if isinstance(owner, cst.Name) else None
        cls = cls or instances.class_of(owner, scope)
    elif isinstance(target, cst.SimpleString) and isinstance(target.evaluated_value, str):
        cls, name = instances.class_of(func.value, scope), target.evaluated_value
    else:
        return
    fi = cls.methods.get(name) if cls is not None and cls.framework == LINEN else None
    if fi is not None and not any(r.module_method for r in fi.roots):
        add_root(fi, _module_method_spec())


def discover(module: cst.Module, extra: TracedDecorators = TracedDecorators()) -> ModuleInfo:
    info = ModuleInfo()
    walker = _Walker(info)
    walker.walk(module)
    _mark_unconditional(info, module)
    resolve_classes(info)
    instances = info.instances = InstanceClasses(info, module.body)
    info.module_strings = {name for name, value in info.module_assigns.items() if isinstance(value, STRING_NODES)}
    finder = RootFinder(info, extra)
    for fi, decorators in walker.decorated:
        for d in decorators:
            spec = finder.decorator_root(d.decorator, fi.parent)
            if spec is not None:
                add_root(fi, spec)
            elif fi.method_of is not None and fi.method_of.framework == LINEN \
                    and info.imports.resolve(d.decorator) == LINEN_COMPACT:
                add_root(fi, _module_method_spec())
    for c in info.classes:
        if c.framework is not None:
            call = c.methods.get("__call__")
            if call is not None and not any(r.module_method for r in call.roots):
                add_root(call, _module_method_spec())
    for call in info.module_calls:
        _applied_method(info, instances, call, None)
    for fi in info.functions:
        for call in fi.calls:
            _applied_method(info, instances, call, fi)
    for call in info.module_calls:
        finder.function_args(call, None)
    for fi in list(info.functions):
        for call in fi.calls:
            finder.function_args(call, fi)
    return info
