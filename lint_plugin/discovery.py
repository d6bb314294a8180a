"""Find the functions of a file and which of them run as traced code.

One walk over the module records imports, every function (with its decorators, class and
enclosing function), every class, and every call. Afterwards:

* *roots* are functions decorated with or passed to a JAX transform (``jax.jit``, ``jax.vmap``,
  ``jax.grad``, ``lax.scan`` bodies, ...), ``int8ify``, ``equinox.filter_*``, the extra decorators
  named by ``--jx-traced-decorators``, and ``__call__``/``@nn.compact`` methods of flax modules;
* module-local functions called from traced code become traced too; that closure (and which
  parameters of a helper receive traced values) is computed in :mod:`lint_plugin.dataflow`, which
  knows the kinds of the arguments at each call site.
"""

from __future__ import annotations

from typing import Dict, FrozenSet, List, Optional, Sequence, Set, Tuple, Union

import libcst as cst

from .aliases import ImportTable, dotted_name
from .cstwalk import iter_children
from .names import (
    FLAX_COMPACT,
    FLAX_MODULE_BASES,
    TRANSFORMS,
    TransformSig,
    int8ify_sig,
    is_int8ify,
)

__all__ = ["ClassInfo", "FuncInfo", "RootSpec", "ModuleInfo", "discover"]

FuncNode = Union[cst.FunctionDef, cst.Lambda]

_PARTIAL = frozenset({"functools.partial"})


class RootSpec:
    """How one transform traces the parameters of the function it wraps."""

    __slots__ = ("sig", "static_nums", "static_names", "traced_nums", "unknown_nums",
                 "bound_pos", "bound_names", "all_unknown", "flax", "inherit_from")

    def __init__(self, sig: TransformSig) -> None:
        self.sig = sig
        self.static_nums: Set[int] = set()
        self.static_names: Set[str] = set()
        self.traced_nums: Optional[Set[int]] = None  # None: all parameters
        self.unknown_nums: Set[int] = set()
        self.bound_pos = 0
        self.bound_names: Set[str] = set()
        self.all_unknown = False
        self.flax = False
        # The function whose body applied the transform (``lax.scan(body, ...)`` inside ``f``):
        # the root is under ``@int8ify`` exactly when ``f`` is.
        self.inherit_from: Optional["FuncInfo"] = None


class ClassInfo:
    __slots__ = ("node", "name", "methods", "is_flax", "base_names")

    def __init__(self, node: cst.ClassDef) -> None:
        self.node = node
        self.name = node.name.value
        self.methods: Dict[str, FuncInfo] = {}
        self.is_flax = False
        self.base_names: List[str] = []


class FuncInfo:
    """A ``def`` or a ``lambda`` (lambdas only when passed to a transform)."""

    __slots__ = ("node", "name", "parent", "cls", "method_of", "locals", "roots", "traced",
                 "plain", "seed", "closure_env", "params", "calls", "is_lambda", "ret", "ret_elts",
                 "callers")

    def __init__(self, node: FuncNode, name: str, parent: Optional["FuncInfo"],
                 method_of: Optional[ClassInfo], cls: Optional[ClassInfo]) -> None:
        self.node = node
        self.name = name
        self.parent = parent
        self.method_of = method_of  # class this is directly a method of
        self.cls = cls  # class whose ``self`` is visible here (methods and their nested functions)
        self.locals: Dict[str, FuncInfo] = {}
        self.roots: List[RootSpec] = []
        self.traced = False
        self.plain = False  # traced through a path not under @int8ify
        self.seed: Dict[str, int] = {}
        self.closure_env: Optional[Dict[str, int]] = None
        self.is_lambda = isinstance(node, cst.Lambda)
        self.params = _param_list(node.params)
        self.calls: List[cst.Call] = []
        self.ret: Optional[int] = None  # kind of the returned value, once walked
        self.ret_elts: Optional[List[int]] = None  # per element, when it returns tuples
        self.callers: List[FuncInfo] = []


def _param_list(params: cst.Parameters) -> List[cst.Param]:
    return list(params.posonly_params) + list(params.params)


class ModuleInfo:
    __slots__ = ("imports", "functions", "module_funcs", "classes", "module_calls",
                 "by_node", "lambda_roots")

    def __init__(self) -> None:
        self.imports = ImportTable()
        self.functions: List[FuncInfo] = []
        self.module_funcs: Dict[str, FuncInfo] = {}
        self.classes: List[ClassInfo] = []
        self.module_calls: List[cst.Call] = []
        self.by_node: Dict[int, FuncInfo] = {}
        self.lambda_roots: Dict[int, FuncInfo] = {}

    def lookup(self, name: str, scope: Optional[FuncInfo]) -> Optional[FuncInfo]:
        """The function a bare name refers to, from inside ``scope``."""
        f = scope
        while f is not None:
            hit = f.locals.get(name)
            if hit is not None:
                return hit
            f = f.parent
        return self.module_funcs.get(name)

    def lookup_expr(self, expr: cst.BaseExpression, scope: Optional[FuncInfo]) -> Optional[FuncInfo]:
        if isinstance(expr, cst.Name):
            return self.lookup(expr.value, scope)
        if (isinstance(expr, cst.Attribute) and isinstance(expr.value, cst.Name)
                and expr.value.value == "self" and scope is not None and scope.cls is not None):
            return scope.cls.methods.get(expr.attr.value)
        return None


class _Walker:
    def __init__(self, info: ModuleInfo) -> None:
        self.info = info
        self.decorated: List[Tuple[FuncInfo, Sequence[cst.Decorator]]] = []

    def walk(self, node: cst.CSTNode, func: Optional[FuncInfo], cls: Optional[ClassInfo],
             self_cls: Optional[ClassInfo]) -> None:
        info = self.info
        stack: List[Tuple[cst.CSTNode, Optional[FuncInfo], Optional[ClassInfo], Optional[ClassInfo]]] = [
            (node, func, cls, self_cls)]
        pop = stack.pop
        push = stack.append
        while stack:
            node, func, cls, self_cls = pop()
            t = type(node)
            if t is cst.Call:
                if func is None:
                    info.module_calls.append(node)  # type: ignore[arg-type]
                else:
                    func.calls.append(node)  # type: ignore[arg-type]
            elif t is cst.FunctionDef:
                fi = FuncInfo(node, node.name.value, func, cls, cls or self_cls)  # type: ignore[union-attr]
                info.functions.append(fi)
                info.by_node[id(node)] = fi
                if cls is not None:
                    cls.methods[fi.name] = fi
                elif func is not None:
                    func.locals[fi.name] = fi
                else:
                    info.module_funcs[fi.name] = fi
                if node.decorators:  # type: ignore[union-attr]
                    self.decorated.append((fi, node.decorators))  # type: ignore[union-attr]
                    for d in node.decorators:  # type: ignore[union-attr]
                        push((d, func, None, self_cls))
                for p in _param_list(node.params) + list(node.params.kwonly_params):  # type: ignore[union-attr]
                    if p.default is not None:
                        push((p.default, func, None, self_cls))
                push((node.body, fi, None, cls or self_cls))  # type: ignore[union-attr]
                continue
            elif t is cst.ClassDef:
                ci = ClassInfo(node)  # type: ignore[arg-type]
                info.classes.append(ci)
                for b in node.bases:  # type: ignore[union-attr]
                    raw = dotted_name(b.value)
                    if raw is not None:
                        ci.base_names.append(raw)
                    push((b.value, func, None, self_cls))
                for d in node.decorators:  # type: ignore[union-attr]
                    push((d, func, None, self_cls))
                push((node.body, func, ci, None))  # type: ignore[union-attr]
                continue
            elif t is cst.Import or t is cst.ImportFrom:
                info.imports.add(node)
                continue
            elif t is cst.SimpleString or t is cst.Integer or t is cst.Float or t is cst.Name:
                continue
            for child in iter_children(node):
                push((child, func, cls if t is cst.IndentedBlock or t is cst.SimpleStatementLine
                      or t is cst.SimpleStatementSuite else None, self_cls))


# ----------------------------------------------------------------------------- transform args

def _literal_int(node: cst.BaseExpression) -> Optional[int]:
    if isinstance(node, cst.Integer):
        return int(node.evaluated_value)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus) \
            and isinstance(node.expression, cst.Integer):
        return -int(node.expression.evaluated_value)
    return None


def _literal_str(node: cst.BaseExpression) -> Optional[str]:
    if isinstance(node, cst.SimpleString) and isinstance(node.evaluated_value, str):
        return node.evaluated_value
    return None


def _literal_set(node: cst.BaseExpression, element) -> Optional[set]:
    """The values of a literal, or of a literal tuple/list of them (``static_argnums=(0, 2)``), as
    ``element`` reads one; None when any part is not such a literal."""
    single = element(node)
    if single is not None:
        return {single}
    if isinstance(node, (cst.Tuple, cst.List)):
        out: set = set()
        for el in node.elements:
            sub = _literal_set(el.value, element)
            if sub is None:
                return None
            out |= sub
        return out
    return None


def _literal_ints(node: cst.BaseExpression) -> Optional[Set[int]]:
    return _literal_set(node, _literal_int)


def _literal_strs(node: cst.BaseExpression) -> Optional[Set[str]]:
    return _literal_set(node, _literal_str)


def _apply_kwargs(spec: RootSpec, args: Sequence[cst.Arg]) -> None:
    for a in args:
        if a.keyword is None:
            if a.star == "**":
                spec.all_unknown = True
            continue
        kw = a.keyword.value
        if kw in ("static_argnums", "static_broadcasted_argnums"):
            nums = _literal_ints(a.value)
            if nums is None:
                spec.all_unknown = True
            else:
                spec.static_nums |= nums
        elif kw == "static_argnames":
            names = _literal_strs(a.value)
            if names is None:
                spec.all_unknown = True
            else:
                spec.static_names |= names
        elif kw == "argnums" and spec.sig.params == "argnums":
            nums = _literal_ints(a.value)
            if nums is None:
                spec.all_unknown = True
            else:
                spec.traced_nums = nums
        elif kw == "in_axes":
            v = a.value
            if isinstance(v, (cst.Tuple, cst.List)):
                for i, el in enumerate(v.elements):
                    if isinstance(el.value, cst.Name) and el.value.value == "None":
                        spec.unknown_nums.add(i)
            elif isinstance(v, cst.Name) and v.value == "None":
                spec.all_unknown = True
    if spec.sig.params == "argnums" and spec.traced_nums is None:
        spec.traced_nums = {0}
    elif spec.sig.params == "first":
        spec.traced_nums = {0}


def _new_spec(sig: TransformSig, args: Sequence[cst.Arg]) -> RootSpec:
    spec = RootSpec(sig)
    _apply_kwargs(spec, args)
    return spec


class _Resolver:
    def __init__(self, info: ModuleInfo, extra_decorators: FrozenSet[str]) -> None:
        self.info = info
        self.extra = extra_decorators

    def transform_of(self, expr: cst.BaseExpression) -> Optional[TransformSig]:
        raw = dotted_name(expr)
        if raw is None:
            return None
        q = self.info.imports.resolve_dotted(raw)
        if q is not None:
            sig = TRANSFORMS.get(q)
            if sig is not None:
                return sig
        if is_int8ify(q, raw):
            return int8ify_sig()
        if self.extra and (raw in self.extra or (q is not None and q in self.extra)
                           or raw.rsplit(".", 1)[-1] in self.extra):
            return TRANSFORMS["jax.jit"]
        return None

    def is_partial(self, expr: cst.BaseExpression) -> bool:
        q = self.info.imports.resolve(expr)
        return q in _PARTIAL

    def add_root(self, fi: FuncInfo, spec: RootSpec) -> None:
        fi.roots.append(spec)
        fi.traced = True

    def decorator_root(self, fi: FuncInfo, dec: cst.BaseExpression) -> Optional[RootSpec]:
        sig = self.transform_of(dec)
        if sig is not None:
            return RootSpec(sig)
        if isinstance(dec, cst.Call):
            sig = self.transform_of(dec.func)
            if sig is not None:
                return _new_spec(sig, dec.args)
            if self.is_partial(dec.func) and dec.args and dec.args[0].keyword is None:
                sig = self.transform_of(dec.args[0].value)
                if sig is not None:
                    return _new_spec(sig, dec.args[1:])
        return None

    def function_args(self, call: cst.Call, scope: Optional[FuncInfo]) -> None:
        """Register the function arguments of a transform call as roots."""
        sig = self.transform_of(call.func)
        if sig is None:
            return
        args = call.args
        positional = [a for a in args if a.keyword is None and not a.star]
        targets: List[cst.BaseExpression] = []
        for i in sig.fun_pos:
            if i < len(positional):
                targets.append(positional[i].value)
        for a in args:
            if a.keyword is not None and a.keyword.value in sig.fun_kw:
                targets.append(a.value)
        if sig.list_pos is not None and sig.list_pos < len(positional):
            seq = positional[sig.list_pos].value
            if isinstance(seq, (cst.List, cst.Tuple)):
                targets.extend(el.value for el in seq.elements)
        for target in targets:
            spec = _new_spec(sig, args)
            self._register_target(target, spec, scope)

    def _register_target(self, target: cst.BaseExpression, spec: RootSpec,
                         scope: Optional[FuncInfo]) -> None:
        if isinstance(target, cst.Call) and self.is_partial(target.func) and target.args:
            first = target.args[0]
            spec.bound_pos = sum(1 for a in target.args[1:] if a.keyword is None)
            spec.bound_names = {a.keyword.value for a in target.args[1:] if a.keyword is not None}
            target = first.value
        if isinstance(target, cst.Lambda):
            fi = self.info.lambda_roots.get(id(target))
            if fi is None:
                fi = FuncInfo(target, "<lambda>", scope, None, scope.cls if scope else None)
                self.info.lambda_roots[id(target)] = fi
                self.info.functions.append(fi)
                self.info.by_node[id(target)] = fi
        else:
            fi = self.info.lookup_expr(target, scope)
        if fi is None:
            return
        if scope is not None and not spec.sig.int8ify:
            spec.inherit_from = scope
        self.add_root(fi, spec)


def _resolve_flax(info: ModuleInfo) -> None:
    by_name = {c.name: c for c in info.classes}
    changed = True
    while changed:
        changed = False
        for c in info.classes:
            if c.is_flax:
                continue
            for raw in c.base_names:
                q = info.imports.resolve_dotted(raw)
                if q in FLAX_MODULE_BASES or (raw in by_name and by_name[raw].is_flax):
                    c.is_flax = True
                    changed = True
                    break


def discover(module: cst.Module, extra_decorators: FrozenSet[str] = frozenset()) -> ModuleInfo:
    info = ModuleInfo()
    walker = _Walker(info)
    walker.walk(module, None, None, None)
    resolver = _Resolver(info, extra_decorators)
    _resolve_flax(info)
    for fi, decorators in walker.decorated:
        for d in decorators:
            spec = resolver.decorator_root(fi, d.decorator)
            if spec is not None:
                resolver.add_root(fi, spec)
            elif fi.method_of is not None and fi.method_of.is_flax:
                q = info.imports.resolve(d.decorator)
                if q in FLAX_COMPACT:
                    spec = RootSpec(TRANSFORMS["jax.jit"])
                    spec.flax = True
                    resolver.add_root(fi, spec)
    for c in info.classes:
        if c.is_flax:
            call = c.methods.get("__call__")
            if call is not None and not any(r.flax for r in call.roots):
                spec = RootSpec(TRANSFORMS["jax.jit"])
                spec.flax = True
                resolver.add_root(call, spec)
    for call in info.module_calls:
        resolver.function_args(call, None)
    for fi in list(info.functions):
        for call in fi.calls:
            resolver.function_args(call, fi)
    return info
