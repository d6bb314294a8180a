"""Roots of traced code: functions decorated with or passed to a transform (or registered as the
derivative rules of a ``jax.custom_vjp``/``custom_jvp`` function), and how the transform's arguments
(``static_argnums``, ``nondiff_argnums``/``nondiff_argnames``, ``argnums``, ``in_axes``, ``in_specs``,
``functools.partial`` bindings) trace their parameters."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Set, TypeVar

import libcst as cst

from .aliases import dotted_name
from .call_args import positional as positional_args
from .module_info import FuncInfo, ModuleInfo, RootSpec
from .names import CUSTOM_RULES, INT8IFY, PARTIAL, TRANSFORMS, TransformSig, is_int8ify
from .traced_decorators import TracedDecorators

__all__ = ["RootFinder", "add_root", "transform_sig"]

T = TypeVar("T")


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


def _literal_set(node: cst.BaseExpression, element: Callable[[cst.BaseExpression], Optional[T]]) -> Optional[Set[T]]:
    """The values of a literal, or of a literal tuple/list of them (``static_argnums=(0, 2)``), as
    ``element`` reads one; None when any part is not such a literal."""
    single = element(node)
    if single is not None:
        return {single}
    if isinstance(node, (cst.Tuple, cst.List)):
        out: Set[T] = set()
        for el in node.elements:
            sub = _literal_set(el.value, element)
            if sub is None:
                return None
            out |= sub
        return out
    return None


def _is_none(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Name) and node.value == "None"


def _none_positions(node: cst.BaseExpression) -> Set[int]:
    """Indices of the ``None`` entries of a literal tuple/list (``in_axes=(0, None)``)."""
    if isinstance(node, (cst.Tuple, cst.List)):
        return {i for i, el in enumerate(node.elements) if _is_none(el.value)}
    return set()


def _read_transform_args(spec: RootSpec, args: Sequence[cst.Arg]) -> None:
    """Fill ``spec`` from the transform's own arguments (``jax.jit(f, static_argnums=...)``)."""
    for a in args:
        if a.keyword is None:
            if a.star == "**":
                spec.all_unknown = True
            continue
        kw = a.keyword.value
        if kw in ("static_argnums", "static_broadcasted_argnums", "nondiff_argnums"):
            nums = _literal_set(a.value, _literal_int)
            if nums is None:
                spec.all_unknown = True
            else:
                spec.static_nums |= nums
        elif kw in ("static_argnames", "nondiff_argnames"):
            names = _literal_set(a.value, _literal_str)
            if names is None:
                spec.all_unknown = True
            else:
                spec.static_names |= names
        elif kw == "argnums" and spec.sig.params == "argnums":
            nums = _literal_set(a.value, _literal_int)
            if nums is None:
                spec.all_unknown = True
            else:
                spec.traced_nums = nums
        elif kw == "in_axes":
            if _is_none(a.value):
                spec.all_unknown = True
            else:
                spec.unknown_nums |= _none_positions(a.value)
        elif kw == "in_specs" and spec.sig.in_specs_pos is not None:
            # shard_map passes the arguments whose in_specs entry is None through as Python values
            spec.static_nums |= _none_positions(a.value)
    if spec.sig.params == "argnums" and spec.traced_nums is None:
        spec.traced_nums = {0}
    elif spec.sig.params == "first":
        spec.traced_nums = {0}
    elif spec.sig.params == "bound_module":
        spec.unknown_nums.add(0)


def _new_spec(sig: TransformSig, args: Sequence[cst.Arg]) -> RootSpec:
    spec = RootSpec(sig)
    _read_transform_args(spec, args)
    return spec


def transform_sig(raw: str, q: Optional[str], extra: TracedDecorators) -> Optional[TransformSig]:
    """The transform a name spelled ``raw`` (resolving to ``q`` through the imports) stands for: a JAX transform,
    ``int8ify``, or an extra traced decorator (traced as ``jax.jit``); ``None`` for any other name."""
    if q is not None:
        sig = TRANSFORMS.get(q)
        if sig is not None:
            return sig
    if is_int8ify(q, raw):
        return INT8IFY
    if extra.matches(raw, q):
        return TRANSFORMS["jax.jit"]
    return None


class RootFinder:
    """Resolves decorators and calls of one file to transforms and registers the functions they trace."""

    def __init__(self, info: ModuleInfo, extra: TracedDecorators) -> None:
        self.info = info
        self.extra = extra

    def transform_of(self, expr: cst.BaseExpression) -> Optional[TransformSig]:
        raw = dotted_name(expr)
        return None if raw is None else transform_sig(raw, self.info.imports.resolve_dotted(raw), self.extra)

    def is_partial(self, expr: cst.BaseExpression) -> bool:
        return self.info.imports.resolve(expr) == PARTIAL

    def decorator_root(self, dec: cst.BaseExpression, scope: Optional[FuncInfo] = None) -> Optional[RootSpec]:
        """The root spec of ``@transform``, ``@transform(...)``, ``@partial(transform, ...)`` or ``@f.defjvp``
        (``scope``: the function the decorated ``def`` is in)."""
        sig = self.transform_of(dec)
        if sig is not None:
            return RootSpec(sig)
        if isinstance(dec, cst.Attribute):
            primal = self._custom_primal(dec, scope)
            rules = [s for s in CUSTOM_RULES.get(dec.attr.value, ()) if 0 in s.fun_pos]
            return _rule_spec(rules[0], primal) if primal is not None and rules else None
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
        """Register the function arguments of a transform call (or of ``f.defvjp(fwd, bwd)``) as roots."""
        sig = self.transform_of(call.func)
        if sig is None:
            self._custom_rules(call, scope)
            return
        args = call.args
        positional = positional_args(call)
        targets = _function_targets(sig, call, positional)
        if sig.list_pos is not None and sig.list_pos < len(positional):
            seq = positional[sig.list_pos]
            if isinstance(seq, (cst.List, cst.Tuple)):
                targets.extend(el.value for el in seq.elements)
        for target in targets:
            spec = _new_spec(sig, args)
            if sig.in_specs_pos is not None and sig.in_specs_pos < len(positional):
                spec.static_nums |= _none_positions(positional[sig.in_specs_pos])
            self._register_target(target, spec, scope, call)

    def _custom_rules(self, call: cst.Call, scope: Optional[FuncInfo]) -> None:
        """``f.defvjp(fwd, bwd)``/``f.defjvp(jvp)`` of a ``jax.custom_vjp``/``custom_jvp`` function ``f``: the
        rule functions run on traced values."""
        func = call.func
        if not isinstance(func, cst.Attribute) or func.attr.value not in CUSTOM_RULES:
            return
        primal = self._custom_primal(func, scope)
        if primal is None:
            return
        positional = positional_args(call)
        for sig in CUSTOM_RULES[func.attr.value]:
            for target in _function_targets(sig, call, positional):
                self._register_target(target, _rule_spec(sig, primal), scope, call)

    def _custom_primal(self, method: cst.Attribute, scope: Optional[FuncInfo]) -> Optional[RootSpec]:
        """The root spec of ``f`` in ``f.defvjp``/``f.defjvp`` when ``f`` is a function of this file made a
        ``jax.custom_vjp``/``custom_jvp`` (decorated, or ``f = jax.custom_vjp(g, ...)`` at module level)."""
        primal, name = method.value, method.attr.value
        if not isinstance(primal, cst.Name):
            return None
        fi = self.info.lookup(primal.value, scope)
        for spec in fi.roots if fi is not None else ():
            if spec.sig.rule_method == name:
                return spec
        wrapped = self.info.module_assigns.get(primal.value)
        if isinstance(wrapped, cst.Call):
            sig = self.transform_of(wrapped.func)
            if sig is not None and sig.rule_method == name:
                return _new_spec(sig, wrapped.args)
        return None

    def _register_target(self, target: cst.BaseExpression, spec: RootSpec, scope: Optional[FuncInfo],
                         call: cst.Call) -> None:
        if isinstance(target, cst.Name):
            # ``g = partial(f, ...)`` or ``g = lambda ...`` (also ``f = partial(f, ...)``), then ``jit(g)``
            bound = self.info.bound_function_at(target.value, scope, call)
            if bound is not None:
                target = bound
        if isinstance(target, cst.Call) and self.is_partial(target.func) and target.args:
            # values bound by ``functools.partial`` are Python values fixed before tracing
            bound_args = target.args[1:]
            spec.bound_pos = sum(1 for a in bound_args if a.keyword is None and not a.star)
            spec.static_names |= {a.keyword.value for a in bound_args if a.keyword is not None}
            target = target.args[0].value
        if scope is not None and not spec.sig.int8ify:
            spec.inherit_from = scope
        for fi in self._functions(target, scope, call):
            add_root(fi, spec)

    def _functions(self, target: cst.BaseExpression, scope: Optional[FuncInfo], call: cst.Call) -> List[FuncInfo]:
        """The functions an argument names: a lambda, ``self.method``, or every ``def`` of a bare name
        in its scope."""
        if isinstance(target, cst.Lambda):
            fi = self.info.lambda_roots.get(id(target))
            if fi is None:
                fi = FuncInfo(target, "<lambda>", scope, None, scope.cls if scope else None)
                self.info.lambda_roots[id(target)] = fi
                self.info.functions.append(fi)
                self.info.by_node[id(target)] = fi
            return [fi]
        if isinstance(target, cst.Name):
            return self.info.lookup_all(target.value, scope, call)
        fi = self.info.lookup_expr(target, scope)
        return [fi] if fi is not None else []


def _function_targets(sig: TransformSig, call: cst.Call,
                      positional: List[cst.BaseExpression]) -> List[cst.BaseExpression]:
    """The arguments of ``call`` at the function positions and keywords of ``sig``."""
    targets = [positional[i] for i in sig.fun_pos if i < len(positional)]
    targets.extend(a.value for a in call.args if a.keyword is not None and a.keyword.value in sig.fun_kw)
    return targets


def _rule_spec(sig: TransformSig, primal: RootSpec) -> RootSpec:
    """How a derivative rule of the custom_vjp/custom_jvp primal traced by ``primal`` traces its parameters:
    ``fwd`` as the primal (its ``nondiff_argnums`` are static), ``bwd``/``jvp`` from ``sig.params``."""
    spec = RootSpec(sig)
    if sig.params == "all":
        spec.static_nums = set(primal.static_nums)
        spec.static_names = set(primal.static_names)
        spec.all_unknown = primal.all_unknown
    return spec


def add_root(fi: FuncInfo, spec: RootSpec) -> None:
    fi.roots.append(spec)
    fi.traced = True
