"""Intra-function data flow and the single rule-dispatching walk.

For each function that runs as traced code (and, when the file mentions ``int8``, for the other
functions too, for the rules that apply anywhere) the :class:`FunctionWalk` executes the body
abstractly: it keeps an environment ``name -> kind`` (see :mod:`lint_plugin.kinds`), evaluates
every expression once, bottom-up, and calls the rules registered for each node type right after
the node's kind is known. Control flow is handled simply: both arms of an ``if`` run from the same
environment and are joined afterwards; loop bodies run once and are joined with the state before
the loop.

:func:`analyze` drives the walks to a fixpoint: a call from traced code to a module-local function
makes that function traced, with each parameter's kind merged from the arguments at the call sites.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import libcst as cst

from .aliases import dotted_name
from .cstwalk import iter_children
from .discovery import FuncInfo, ModuleInfo, RootSpec
from .kinds import FLAX_SELF, INT8, STATIC, TRACED, UNKNOWN, combine, is_traced, join, merge_seed
from .names import STATIC_RESULT_FUNCS, is_array_api

__all__ = ["FunctionWalk", "Report", "analyze", "is_int8_dtype", "is_int32_dtype"]

Hook = Callable[[cst.CSTNode, "FunctionWalk"], None]
Report = Tuple[cst.CSTNode, str, str]  # node, code, message

_STATIC_ATTRS = frozenset({"shape", "ndim", "dtype", "size", "sharding", "aval", "weak_type",
                           "itemsize", "nbytes", "named_shape"})
_ARRAY_ATTRS_SAME = frozenset({"T", "mT"})
_ARRAY_ATTRS_TRACED = frozenset({"real", "imag", "at", "value"})
_PRESERVING_METHODS = frozenset({"reshape", "transpose", "swapaxes", "squeeze", "ravel", "flatten",
                                 "clip", "T", "copy", "repeat", "take", "__getitem__"})
_ARRAY_METHODS = frozenset({
    "sum", "mean", "max", "min", "any", "all", "prod", "std", "var", "argmax", "argmin", "cumsum",
    "cumprod", "round", "conj", "conjugate", "nonzero", "sort", "argsort", "dot", "trace",
    "diagonal", "set", "add", "multiply", "divide", "power", "apply", "get", "clip", "view",
    "block_until_ready", "squeeze", "reshape", "transpose", "swapaxes", "ravel", "flatten", "copy",
    "repeat", "take", "astype",
}) | _PRESERVING_METHODS
_STATIC_BUILTINS = frozenset({"len", "isinstance", "issubclass", "hasattr", "callable", "type", "id",
                              "str", "repr", "range", "int", "float", "bool", "complex", "print",
                              "format", "hash", "dir", "vars", "slice"})
_COMBINE_BUILTINS = frozenset({"abs", "max", "min", "sum", "round", "pow", "divmod", "list", "tuple",
                               "sorted", "reversed", "set", "frozenset"})
_PRESERVING_FUNCS = frozenset(
    ["jax.numpy." + n for n in ("reshape", "transpose", "swapaxes", "moveaxis", "expand_dims",
                                "squeeze", "broadcast_to", "ravel", "clip", "flip", "roll", "tile",
                                "repeat", "negative", "abs", "atleast_1d", "atleast_2d", "take",
                                "asarray", "array")]
    + ["jax.lax." + n for n in ("reshape", "transpose", "broadcast_in_dim", "squeeze",
                                "expand_dims", "dynamic_slice", "slice", "stop_gradient",
                                "dynamic_slice_in_dim", "slice_in_dim", "index_in_dim")]
)
_FLAX_TRACED_METHODS = frozenset({"param", "variable", "get_variable", "perturb", "make_rng",
                                  "sow", "get_variables"})


def _dtype_name(node: cst.BaseExpression, walk: "FunctionWalk") -> Optional[str]:
    """``"int8"`` for ``jnp.int8``, ``np.int8``, ``"int8"``, ``jnp.dtype("int8")`` etc."""
    if isinstance(node, cst.SimpleString):
        v = node.evaluated_value
        return v if isinstance(v, str) else None
    if isinstance(node, cst.Call) and node.args:
        q = walk.qualname(node.func)
        if q in ("jax.numpy.dtype", "numpy.dtype"):
            return _dtype_name(node.args[0].value, walk)
        return None
    raw = dotted_name(node)
    if raw is None:
        return None
    q = walk.info.imports.resolve_dotted(raw)
    if q is None:
        return None
    head, _, last = q.rpartition(".")
    if head in ("jax.numpy", "numpy", "jax.dtypes", "ml_dtypes"):
        return last
    return None


def is_int8_dtype(node: cst.BaseExpression, walk: "FunctionWalk") -> bool:
    return _dtype_name(node, walk) == "int8"


def is_int32_dtype(node: cst.BaseExpression, walk: "FunctionWalk") -> bool:
    return _dtype_name(node, walk) == "int32"


def _kwarg(call: cst.Call, name: str) -> Optional[cst.BaseExpression]:
    for a in call.args:
        if a.keyword is not None and a.keyword.value == name:
            return a.value
    return None


class FunctionWalk:
    """Abstract execution of one function body (or the module body) with rule dispatch."""

    def __init__(self, info: ModuleInfo, func: Optional[FuncInfo], dispatch: Dict[type, List[Hook]],
                 traced: bool, plain: bool, engine: "Optional[_Fixpoint]" = None) -> None:
        self.info = info
        self.func = func
        self.dispatch = dispatch
        self.traced = traced
        self.plain = plain
        self.engine = engine
        self.env: Dict[str, int] = {}
        self.memo: Dict[int, int] = {}
        self.bcast: Set[str] = set()
        self.test_nodes: Set[int] = set()
        self.reports: List[Report] = []
        self.ret: Optional[int] = None
        self.ret_elts: Optional[List[int]] = None
        self.ret_seen = False
        self.call_elts: Dict[int, List[int]] = {}
        self.in_flax = func is not None and func.cls is not None and func.cls.is_flax

    # ------------------------------------------------------------------ helpers for rules
    def report(self, node: cst.CSTNode, code: str, message: str) -> None:
        self.reports.append((node, code, message))

    def kind(self, node: cst.BaseExpression) -> int:
        k = self.memo.get(id(node))
        if k is None:
            k = self.ev(node)
        return k

    def qualname(self, node: cst.BaseExpression) -> Optional[str]:
        return self.info.imports.resolve(node)

    def is_builtin(self, node: cst.BaseExpression, *names: str) -> bool:
        return (isinstance(node, cst.Name) and node.value in names
                and not self.info.imports.is_imported(node.value) and node.value not in self.env)

    def in_test(self, node: cst.CSTNode) -> bool:
        return id(node) in self.test_nodes

    # ------------------------------------------------------------------ entry points
    def run_function(self, fi: FuncInfo) -> None:
        node = fi.node
        if isinstance(node, cst.Lambda):
            self.ev(node.body)
        else:
            self.exec_block(node.body)

    def run_module(self, module: cst.Module) -> None:
        self.exec_stmts(module.body)

    # ------------------------------------------------------------------ statements
    def exec_block(self, block: cst.BaseSuite) -> None:
        if isinstance(block, cst.IndentedBlock):
            self.exec_stmts(block.body)
        else:  # SimpleStatementSuite
            self.exec_small(block.body)  # type: ignore[attr-defined]

    def exec_stmts(self, stmts: Sequence[cst.CSTNode]) -> None:
        for stmt in stmts:
            self.exec_stmt(stmt)

    def exec_small(self, smalls: Sequence[cst.CSTNode]) -> None:
        for s in smalls:
            t = type(s)
            if t is cst.Assign:
                k = self.ev(s.value)
                bc = self._is_bcast_product(s.value)
                for tgt in s.targets:
                    self.bind(tgt.target, k, s.value, bc)
            elif t is cst.Expr:
                self.ev(s.value)
            elif t is cst.Return:
                self._record_return(s.value)
            elif t is cst.AugAssign:
                k = combine(self.ev(s.target), self.ev(s.value))
                self.bind(s.target, k, None, False)
            elif t is cst.AnnAssign:
                if s.value is not None:
                    k = self.ev(s.value)
                    self.bind(s.target, k, s.value, self._is_bcast_product(s.value))
            elif t is cst.Assert:
                self._mark_test(s.test)
                self.ev(s.test)
                if s.msg is not None:
                    self.ev(s.msg)
                self._hooks(s)
            elif t is cst.Raise:
                if s.exc is not None:
                    self.ev(s.exc)
            elif t is cst.Del:
                pass
            elif t is cst.Import or t is cst.ImportFrom:
                pass
            else:
                for c in iter_children(s):
                    if isinstance(c, cst.BaseExpression):
                        self.ev(c)

    def exec_stmt(self, stmt: cst.CSTNode) -> None:
        t = type(stmt)
        if t is cst.SimpleStatementLine:
            self.exec_small(stmt.body)  # type: ignore[attr-defined]
        elif t is cst.If:
            self._exec_if(stmt)  # type: ignore[arg-type]
        elif t is cst.For:
            self._exec_for(stmt)  # type: ignore[arg-type]
        elif t is cst.While:
            self._mark_test(stmt.test)  # type: ignore[attr-defined]
            self.ev(stmt.test)  # type: ignore[attr-defined]
            self._hooks(stmt)
            before = dict(self.env)
            self.exec_block(stmt.body)  # type: ignore[attr-defined]
            self._join_into(before)
            if stmt.orelse is not None:  # type: ignore[attr-defined]
                self.exec_block(stmt.orelse.body)  # type: ignore[attr-defined]
        elif t is cst.FunctionDef:
            self.env[stmt.name.value] = STATIC  # type: ignore[attr-defined]
            if self.engine is not None:
                self.engine.closure(stmt, self)
        elif t is cst.ClassDef:
            self.env[stmt.name.value] = STATIC  # type: ignore[attr-defined]
        elif t is cst.With:
            for item in stmt.items:  # type: ignore[attr-defined]
                self.ev(item.item)
                if item.asname is not None:
                    self.bind(item.asname.name, UNKNOWN, None, False)
            self.exec_block(stmt.body)  # type: ignore[attr-defined]
        elif t is cst.Try or t is cst.TryStar:
            self.exec_block(stmt.body)  # type: ignore[attr-defined]
            for h in stmt.handlers:  # type: ignore[attr-defined]
                if h.type is not None:
                    self.ev(h.type)
                if h.name is not None:
                    self.bind(h.name.name, STATIC, None, False)
                self.exec_block(h.body)
            if stmt.orelse is not None:  # type: ignore[attr-defined]
                self.exec_block(stmt.orelse.body)  # type: ignore[attr-defined]
            if stmt.finalbody is not None:  # type: ignore[attr-defined]
                self.exec_block(stmt.finalbody.body)  # type: ignore[attr-defined]
        elif t is cst.Match:
            self.ev(stmt.subject)  # type: ignore[attr-defined]
            before = dict(self.env)
            for case in stmt.cases:  # type: ignore[attr-defined]
                self.exec_block(case.body)
            self._join_into(before)
        else:
            for c in iter_children(stmt):
                if isinstance(c, cst.BaseExpression):
                    self.ev(c)
                elif isinstance(c, cst.BaseSuite):
                    self.exec_block(c)

    def _exec_if(self, stmt: cst.If) -> None:
        self._mark_test(stmt.test)
        self.ev(stmt.test)
        self._hooks(stmt)
        before = dict(self.env)
        self.exec_block(stmt.body)
        after_body = self.env
        self.env = before
        orelse = stmt.orelse
        if isinstance(orelse, cst.If):
            self._exec_if(orelse)
        elif orelse is not None:
            self.exec_block(orelse.body)
        self._join_with(after_body)

    def _exec_for(self, stmt: cst.For) -> None:
        self.ev(stmt.iter)
        self._bind_loop_target(stmt.target, stmt.iter)
        before = dict(self.env)
        self.exec_block(stmt.body)
        self._join_into(before)
        if stmt.orelse is not None:
            self.exec_block(stmt.orelse.body)

    def _bind_loop_target(self, target: cst.BaseExpression, it: cst.BaseExpression) -> None:
        if isinstance(it, cst.Call):
            if self.is_builtin(it.func, "range"):
                self.bind(target, STATIC, None, False)
                return
            if self.is_builtin(it.func, "enumerate") and it.args and isinstance(target, (cst.Tuple, cst.List)) \
                    and len(target.elements) == 2:
                self.bind(target.elements[0].value, STATIC, None, False)
                self._bind_loop_target(target.elements[1].value, it.args[0].value)
                return
            if self.is_builtin(it.func, "zip") and isinstance(target, (cst.Tuple, cst.List)) \
                    and len(target.elements) == len(it.args) and all(a.keyword is None and not a.star for a in it.args):
                for el, a in zip(target.elements, it.args):
                    self._bind_loop_target(el.value, a.value)
                return
        k = self.kind(it)
        if k == FLAX_SELF:
            k = STATIC
        self.bind(target, k, None, False)

    def _join_into(self, before: Dict[str, int]) -> None:
        """After a loop body: a name's kind is the join of before and after."""
        env = self.env
        for name, k in list(env.items()):
            old = before.get(name)
            if old is not None and old != k:
                env[name] = join(old, k)

    def _join_with(self, other: Dict[str, int]) -> None:
        env = self.env
        for name, k in other.items():
            mine = env.get(name)
            if mine is None:
                env[name] = k
            elif mine != k:
                env[name] = join(mine, k)

    def bind(self, target: cst.BaseExpression, kind: int, value: Optional[cst.BaseExpression],
             bcast: bool) -> None:
        t = type(target)
        if t is cst.Name:
            name = target.value  # type: ignore[attr-defined]
            self.env[name] = kind
            if bcast:
                self.bcast.add(name)
            else:
                self.bcast.discard(name)
        elif t is cst.Tuple or t is cst.List:
            elements = target.elements  # type: ignore[attr-defined]
            if isinstance(value, (cst.Tuple, cst.List)) and len(value.elements) == len(elements) \
                    and not any(isinstance(e, cst.StarredElement) for e in value.elements):
                for el, v in zip(elements, value.elements):
                    self.bind(el.value, self.kind(v.value), v.value, self._is_bcast_product(v.value))
            elif value is not None and id(value) in self.call_elts \
                    and len(self.call_elts[id(value)]) == len(elements):
                for el, k in zip(elements, self.call_elts[id(value)]):
                    self.bind(el.value, k, None, False)
            else:
                sub = kind if kind != FLAX_SELF else STATIC
                for el in elements:
                    self.bind(el.value, sub, None, False)
        elif t is cst.StarredElement:
            self.bind(target.value, kind, None, False)  # type: ignore[attr-defined]
        else:
            # attribute / subscript targets: evaluate the parts for rule hooks, bind nothing
            for c in iter_children(target):
                if isinstance(c, cst.BaseExpression):
                    self.ev(c)

    def _record_return(self, value: Optional[cst.BaseExpression]) -> None:
        k = STATIC if value is None else self.ev(value)
        elts: Optional[List[int]] = None
        if isinstance(value, cst.Tuple) and not any(isinstance(e, cst.StarredElement) for e in value.elements):
            elts = [self.kind(e.value) for e in value.elements]
        elif value is not None:
            elts = self.call_elts.get(id(value))
        if not self.ret_seen:
            self.ret_seen = True
            self.ret, self.ret_elts = k, elts
            return
        self.ret = join(self.ret if self.ret is not None else k, k)
        if self.ret_elts is not None and elts is not None and len(elts) == len(self.ret_elts):
            self.ret_elts = [join(a, b) for a, b in zip(self.ret_elts, elts)]
        else:
            self.ret_elts = None

    def _mark_test(self, test: cst.BaseExpression) -> None:
        self.test_nodes.add(id(test))
        while True:
            if isinstance(test, cst.BooleanOperation):
                self.test_nodes.add(id(test))
                self._mark_test(test.right)
                test = test.left
            elif isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
                self.test_nodes.add(id(test))
                test = test.expression
            else:
                self.test_nodes.add(id(test))
                return

    def _hooks(self, node: cst.CSTNode) -> None:
        hooks = self.dispatch.get(type(node))
        if hooks:
            for h in hooks:
                h(node, self)

    # ------------------------------------------------------------------ expressions
    def ev(self, node: cst.BaseExpression) -> int:
        t = type(node)
        if t is cst.Name:
            k = self._ev_name(node)  # type: ignore[arg-type]
        elif t is cst.Attribute:
            k = self._ev_attribute(node)  # type: ignore[arg-type]
        elif t is cst.Call:
            k = self._ev_call(node)  # type: ignore[arg-type]
        elif t is cst.BinaryOperation:
            k = self._ev_binop(node)  # type: ignore[arg-type]
        elif t is cst.Subscript:
            k = self._ev_subscript(node)  # type: ignore[arg-type]
        elif t is cst.Integer or t is cst.Float or t is cst.Imaginary or t is cst.SimpleString \
                or t is cst.Ellipsis:
            k = STATIC
        elif t is cst.Comparison:
            k = self._ev_comparison(node)  # type: ignore[arg-type]
        elif t is cst.UnaryOperation:
            k = self.ev(node.expression)  # type: ignore[attr-defined]
            if k == FLAX_SELF:
                k = STATIC
            elif k == INT8 and isinstance(node.operator, cst.Not):  # type: ignore[attr-defined]
                k = TRACED
        elif t is cst.BooleanOperation:
            k = combine(self.ev(node.left), self.ev(node.right))  # type: ignore[attr-defined]
        elif t is cst.IfExp:
            self._mark_test(node.test)  # type: ignore[attr-defined]
            self.ev(node.test)  # type: ignore[attr-defined]
            k = join(self.ev(node.body), self.ev(node.orelse))  # type: ignore[attr-defined]
        elif t is cst.Tuple or t is cst.List or t is cst.Set:
            # a Python container: its truthiness and len() are static even if it holds tracers
            k = STATIC
            for el in node.elements:  # type: ignore[attr-defined]
                k = combine(k, self.ev(el.value))
            k = _container(k)
        elif t is cst.Dict:
            k = STATIC
            for el in node.elements:  # type: ignore[attr-defined]
                if isinstance(el, cst.DictElement):
                    self.ev(el.key)
                k = combine(k, self.ev(el.value))
            k = _container(k)
        elif t is cst.Lambda:
            k = self._ev_lambda(node)  # type: ignore[arg-type]
        elif t in _COMPREHENSIONS:
            k = self._ev_comprehension(node)
        elif t is cst.NamedExpr:
            k = self.ev(node.value)  # type: ignore[attr-defined]
            self.bind(node.target, k, None, False)  # type: ignore[attr-defined]
        elif t is cst.FormattedString or t is cst.ConcatenatedString:
            for c in iter_children(node):
                self._ev_any(c)
            k = STATIC
        else:
            k = UNKNOWN
            for c in iter_children(node):
                self._ev_any(c)
        self.memo[id(node)] = k
        hooks = self.dispatch.get(t)
        if hooks:
            for h in hooks:
                h(node, self)
        return k

    def _ev_any(self, node: cst.CSTNode) -> None:
        if isinstance(node, cst.BaseExpression):
            self.ev(node)
        else:
            for c in iter_children(node):
                self._ev_any(c)

    def _ev_name(self, node: cst.Name) -> int:
        name = node.value
        k = self.env.get(name)
        if k is not None:
            return k
        if name in ("True", "False", "None"):
            return STATIC
        if self.info.imports.is_imported(name) or name in self.info.module_funcs:
            return STATIC
        return UNKNOWN

    def _ev_attribute(self, node: cst.Attribute) -> int:
        v = self.ev(node.value)
        attr = node.attr.value
        if attr in _STATIC_ATTRS:
            return STATIC
        if v == FLAX_SELF:
            return TRACED if attr == "variables" else STATIC
        if v == TRACED or v == INT8:
            if attr in _ARRAY_ATTRS_SAME:
                return v
            if attr in _ARRAY_ATTRS_TRACED:
                return TRACED
            return UNKNOWN
        if v == STATIC:
            return STATIC
        return UNKNOWN

    def _ev_subscript(self, node: cst.Subscript) -> int:
        v = self.ev(node.value)
        idx = STATIC
        for el in node.slice:
            s = el.slice
            if isinstance(s, cst.Index):
                idx = combine(idx, self.ev(s.value))
            else:
                for part in (s.lower, s.upper, s.step):  # type: ignore[attr-defined]
                    if part is not None:
                        idx = combine(idx, self.ev(part))
        if v == TRACED or v == INT8:
            return v
        if v == FLAX_SELF:
            return STATIC
        if v == STATIC:
            return STATIC if idx == STATIC else UNKNOWN
        return UNKNOWN

    def _ev_comparison(self, node: cst.Comparison) -> int:
        k = self.ev(node.left)
        only_is = True
        membership = False
        for ct in node.comparisons:
            k = combine(k, self.ev(ct.comparator))
            if isinstance(ct.operator, (cst.In, cst.NotIn)):
                membership = True
            if not isinstance(ct.operator, (cst.Is, cst.IsNot)):
                only_is = False
        if only_is:
            return STATIC
        if membership and k != STATIC:
            return UNKNOWN  # ``key in params``: dicts and lists of tracers are fine
        return k

    def _ev_binop(self, node: cst.BinaryOperation) -> int:
        left = self.ev(node.left)
        right = self.ev(node.right)
        if (left == INT8 or right == INT8) and left in (INT8, STATIC) and right in (INT8, STATIC) \
                and isinstance(node.operator, _INT_PRESERVING_OPS):
            return INT8
        return combine(left, right)

    def _ev_lambda(self, node: cst.Lambda) -> int:
        root = self.info.lambda_roots.get(id(node))
        if root is not None:
            if self.engine is not None:
                self.engine.closure(node, self)
            return STATIC
        saved = self.env
        self.env = dict(saved)
        for p in list(node.params.params) + list(node.params.posonly_params) + list(node.params.kwonly_params):
            self.env[p.name.value] = UNKNOWN
            if p.default is not None:
                self.ev(p.default)
        self.ev(node.body)
        self.env = saved
        return STATIC

    def _ev_comprehension(self, node: cst.CSTNode) -> int:
        saved = self.env
        self.env = dict(saved)
        comp = node.for_in  # type: ignore[attr-defined]
        while comp is not None:
            self.ev(comp.iter)
            self._bind_loop_target(comp.target, comp.iter)
            for cond in comp.ifs:
                self.ev(cond.test)
            comp = comp.inner_for_in
        if isinstance(node, cst.DictComp):
            self.ev(node.key)
            k = self.ev(node.value)
        else:
            k = self.ev(node.elt)  # type: ignore[attr-defined]
        self.env = saved
        return _container(k)

    def _ev_call(self, node: cst.Call) -> int:
        func = node.func
        self.ev(func)
        arg_kinds: List[int] = []
        for a in node.args:
            arg_kinds.append(self.ev(a.value))
        any_traced = any(is_traced(k) for k in arg_kinds)

        if isinstance(func, cst.Name) and func.value not in self.env and not self.info.imports.is_imported(func.value):
            name = func.value
            if name in _STATIC_BUILTINS:
                return STATIC
            if name in _COMBINE_BUILTINS:
                return combine(*arg_kinds) if arg_kinds else STATIC
        local = self.info.lookup_expr(func, self.func)
        if local is not None:
            if self.engine is not None and self.traced:
                self.engine.call_edge(local, node, arg_kinds, self)
            if local.ret_elts is not None:
                self.call_elts[id(node)] = local.ret_elts
            if local.ret == INT8:
                return INT8
            if local.ret == STATIC and not any_traced:
                return STATIC
            return TRACED if any_traced else UNKNOWN
        if self.engine is not None and self.traced:
            # module-local functions passed as callbacks (``jax.tree.map(f, ...)``) run at trace time
            for a in node.args:
                if isinstance(a.value, cst.Name):
                    f = self.info.lookup(a.value.value, self.func)
                    if f is not None and not f.traced:
                        self.engine.call_edge(f, None, [], self)
        q = self.qualname(func)
        if q is not None:
            if q in STATIC_RESULT_FUNCS:
                return STATIC
            last = q.rpartition(".")[2]
            if last == "int8" and q.startswith(("jax.", "numpy.")):
                return INT8
            if q == "jax.lax.convert_element_type":
                dt = _kwarg(node, "new_dtype")
                if dt is None and len(node.args) > 1 and node.args[1].keyword is None:
                    dt = node.args[1].value
                return INT8 if dt is not None and is_int8_dtype(dt, self) else TRACED
            if is_array_api(q):
                dt = _kwarg(node, "dtype")
                if dt is not None and is_int8_dtype(dt, self):
                    return INT8
                if q in _PRESERVING_FUNCS and arg_kinds and arg_kinds[0] == INT8 and dt is None:
                    return INT8
                return TRACED
            return TRACED if any_traced and q.startswith(("jax.", "flax.", "equinox.", "optax.")) \
                and not q.startswith(("jax.tree", "jax.device_get")) else UNKNOWN
        if isinstance(func, cst.Attribute):
            recv = self.memo.get(id(func.value), UNKNOWN)
            meth = func.attr.value
            if meth == "astype":
                if node.args and is_int8_dtype(node.args[0].value, self):
                    return INT8
                if is_traced(recv):
                    return TRACED
                return STATIC if recv == STATIC else UNKNOWN
            if recv == FLAX_SELF:
                if meth in _FLAX_TRACED_METHODS:
                    return TRACED
                return TRACED if any_traced else UNKNOWN
            if is_traced(recv):
                if meth in ("item", "tolist"):
                    return STATIC
                if meth in _ARRAY_METHODS:
                    if recv == INT8 and meth in _PRESERVING_METHODS:
                        return INT8
                    return TRACED
                return UNKNOWN
            if recv == STATIC:
                return STATIC if all(k == STATIC for k in arg_kinds) else UNKNOWN
            return UNKNOWN
        if isinstance(func, cst.Call) and any_traced:
            return TRACED  # ``nn.Dense(4)(x)``: a module applied to a traced value
        return UNKNOWN

    # ------------------------------------------------------------------ patterns used by rules
    def _is_bcast_product(self, node: cst.BaseExpression) -> bool:
        return is_broadcast_product(node, self)


def _container(k: int) -> int:
    return STATIC if k == STATIC else UNKNOWN


_COMPREHENSIONS = (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)
_INT_PRESERVING_OPS = (cst.Add, cst.Subtract, cst.Multiply, cst.BitAnd, cst.BitOr, cst.BitXor,
                       cst.LeftShift, cst.RightShift, cst.FloorDivide, cst.Modulo)


def _strip_casts(node: cst.BaseExpression, walk: FunctionWalk) -> cst.BaseExpression:
    while isinstance(node, cst.Call):
        f = node.func
        if isinstance(f, cst.Attribute) and f.attr.value == "astype":
            node = f.value
            continue
        q = walk.qualname(f)
        if q in ("jax.lax.convert_element_type", "jax.numpy.asarray") and node.args:
            node = node.args[0].value
            continue
        break
    return node


def has_new_axis(node: cst.BaseExpression, walk: FunctionWalk) -> bool:
    """``x[:, None]``, ``x[..., jnp.newaxis]``, ``jnp.expand_dims(x, 1)`` (through casts)."""
    node = _strip_casts(node, walk)
    if isinstance(node, cst.Subscript):
        for el in node.slice:
            s = el.slice
            if isinstance(s, cst.Index):
                v = s.value
                if isinstance(v, cst.Name) and v.value == "None":
                    return True
                raw = dotted_name(v)
                if raw is not None and raw.endswith("newaxis"):
                    return True
        return False
    if isinstance(node, cst.Call):
        q = walk.qualname(node.func)
        return q in ("jax.numpy.expand_dims", "jax.lax.expand_dims", "jax.lax.broadcast_in_dim")
    return False


def product_factors(node: cst.BaseExpression, walk: FunctionWalk) -> Optional[List[cst.BaseExpression]]:
    """The factors of ``a * b * c`` or ``jnp.multiply(a, b)``; ``None`` if not a product."""
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Multiply):
        out: List[cst.BaseExpression] = []
        for side in (node.left, node.right):
            sub = product_factors(side, walk) if not side.lpar else None
            if sub is None:
                out.append(side)
            else:
                out.extend(sub)
        return out
    if isinstance(node, cst.Call) and len(node.args) == 2 and walk.qualname(node.func) == "jax.numpy.multiply":
        return [node.args[0].value, node.args[1].value]
    return None


def is_broadcast_product(node: cst.BaseExpression, walk: FunctionWalk) -> bool:
    """A product of at least two non-static arrays, at least one with an inserted axis."""
    if isinstance(node, cst.Name):
        return node.value in walk.bcast
    factors = product_factors(node, walk)
    if factors is None:
        return False
    arrays = [f for f in factors if walk.kind(f) != STATIC]
    if len(arrays) < 2:
        return False
    return any(has_new_axis(f, walk) for f in arrays)


# ============================================================================ fixpoint driver

_MAX_WALKS_PER_FUNCTION = 8


class _Fixpoint:
    def __init__(self, info: ModuleInfo, dispatch_for: Callable[[bool, bool], Dict[type, List[Hook]]],
                 analyze_untraced: bool) -> None:
        self.info = info
        self.dispatch_for = dispatch_for
        self.analyze_untraced = analyze_untraced
        self.queue: "deque[FuncInfo]" = deque()
        self.queued: Set[int] = set()
        self.reports: Dict[int, List[Report]] = {}
        self.walks: Dict[int, int] = {}
        self.children: Dict[int, List[FuncInfo]] = {}

    def enqueue(self, fi: FuncInfo) -> None:
        if id(fi) not in self.queued and self.walks.get(id(fi), 0) < _MAX_WALKS_PER_FUNCTION:
            self.queued.add(id(fi))
            self.queue.append(fi)

    # callbacks from FunctionWalk -------------------------------------------------
    def call_edge(self, callee: FuncInfo, call: Optional[cst.Call], arg_kinds: List[int],
                  walk: FunctionWalk) -> None:
        changed = False
        if walk.func is not None and walk.func not in callee.callers:
            callee.callers.append(walk.func)
        if not callee.traced:
            callee.traced = True
            changed = True
        if walk.plain and not callee.plain and not _int8ified(callee):
            callee.plain = True
            changed = True
        if call is not None:
            params = callee.params
            offset = 1 if (callee.method_of is not None and params
                           and params[0].name.value in ("self", "cls")
                           and isinstance(call.func, cst.Attribute)) else 0
            pos = 0
            for a, k in zip(call.args, arg_kinds):
                if a.star:
                    break
                if a.keyword is not None:
                    name = a.keyword.value
                else:
                    idx = pos + offset
                    pos += 1
                    if idx >= len(params):
                        continue
                    name = params[idx].name.value
                new = merge_seed(callee.seed.get(name), k)
                if callee.seed.get(name) != new:
                    callee.seed[name] = new
                    changed = True
        if changed:
            self.enqueue(callee)

    def closure(self, node: cst.CSTNode, walk: FunctionWalk) -> None:
        fi = self.info.by_node.get(id(node))
        if fi is None:
            return
        env = dict(walk.env)
        if fi.closure_env != env:
            fi.closure_env = env
            if fi.traced:
                self.enqueue(fi)

    # seeds ------------------------------------------------------------------------
    def initial_env(self, fi: FuncInfo) -> Dict[str, int]:
        env: Dict[str, int] = dict(fi.closure_env) if fi.closure_env else {}
        node = fi.node
        params = fi.params
        flax_self = fi.cls is not None and fi.cls.is_flax
        for i, p in enumerate(params):
            name = p.name.value
            if i == 0 and fi.method_of is not None and name in ("self", "cls"):
                env[name] = FLAX_SELF if flax_self else UNKNOWN
                continue
            env[name] = _param_seed(fi, i, p)
        for p in node.params.kwonly_params:
            env[p.name.value] = _param_seed(fi, None, p)
        for star in (node.params.star_arg, node.params.star_kwarg):
            if isinstance(star, cst.Param):
                env[star.name.value] = UNKNOWN
        if flax_self and fi.method_of is None and "self" not in env:
            env["self"] = FLAX_SELF
        return env

    # driver -------------------------------------------------------------------------
    def run(self) -> List[Report]:
        info = self.info
        for fi in info.functions:
            for spec in fi.roots:
                if spec.inherit_from is not None:
                    self.children.setdefault(id(spec.inherit_from), []).append(fi)
                elif not spec.sig.int8ify and not _int8ified(fi):
                    fi.plain = True
            if fi.traced:
                self.enqueue(fi)
        while True:
            while self.queue:
                fi = self.queue.popleft()
                self.queued.discard(id(fi))
                self.walk(fi)
            # roots applied inside functions that never became traced are plain roots
            progressed = False
            for fi in info.functions:
                if fi.plain or _int8ified(fi):
                    continue
                for spec in fi.roots:
                    parent = spec.inherit_from
                    if parent is not None and not parent.traced:
                        fi.plain = True
                        self.enqueue(fi)
                        progressed = True
                        break
            if not progressed:
                break
        out: List[Report] = []
        for reps in self.reports.values():
            out.extend(reps)
        if self.analyze_untraced:
            for fi in info.functions:
                if not fi.traced and not fi.is_lambda:
                    w = FunctionWalk(info, fi, self.dispatch_for(False, False), False, False, None)
                    w.env = {p.name.value: UNKNOWN for p in fi.params}
                    w.run_function(fi)
                    out.extend(w.reports)
        return out

    def walk(self, fi: FuncInfo) -> None:
        self.walks[id(fi)] = self.walks.get(id(fi), 0) + 1
        w = FunctionWalk(self.info, fi, self.dispatch_for(True, fi.plain), True, fi.plain, self)
        w.env = self.initial_env(fi)
        w.run_function(fi)
        self.reports[id(fi)] = w.reports
        ret = w.ret if w.ret_seen else STATIC
        if ret != fi.ret or w.ret_elts != fi.ret_elts:
            fi.ret, fi.ret_elts = ret, w.ret_elts
            for caller in fi.callers:
                self.enqueue(caller)
        for child in self.children.get(id(fi), ()):
            if fi.plain and not child.plain and not _int8ified(child):
                child.plain = True
                self.enqueue(child)


def _int8ified(fi: FuncInfo) -> bool:
    """Decorated with or passed to ``int8ify``: every matmul in it is rewritten."""
    return any(spec.sig.int8ify for spec in fi.roots)


def _scalar_annotation(p: cst.Param) -> bool:
    ann = p.annotation
    if ann is None:
        return False
    a = ann.annotation
    if isinstance(a, cst.Name):
        return a.value in ("bool", "int", "str", "float", "Callable")
    if isinstance(a, cst.SimpleString):
        return True  # forward references: do not guess
    raw = dotted_name(a) if isinstance(a, cst.Attribute) else None
    if raw is not None:
        return raw.rsplit(".", 1)[-1] in ("Callable", "Sequence", "Mapping", "Any", "Optional")
    if isinstance(a, cst.BinaryOperation):  # ``int | None``
        return all(isinstance(side, cst.Name) and side.value in ("bool", "int", "str", "float", "None")
                   for side in (a.left, a.right))
    if isinstance(a, cst.Subscript):
        head = dotted_name(a.value)
        return head is not None and head.rsplit(".", 1)[-1] in (
            "Optional", "Callable", "Sequence", "Tuple", "tuple", "Literal", "Union", "Mapping", "Iterable")
    return False


def _param_seed(fi: "FuncInfo", index: Optional[int], param: cst.Param) -> int:
    """The kind a parameter starts with: merged over the roots that trace the function (positional
    ``index``, or None for keyword-only) and the kinds call sites passed; unknown for a scalar annotation."""
    kind: Optional[int] = None
    for spec in fi.roots:
        kind = merge_seed(kind, _root_param_kind(spec, index, param, fi))
    seeded = fi.seed.get(param.name.value)
    if seeded is not None:
        kind = merge_seed(kind, seeded)
    return UNKNOWN if kind is None or _scalar_annotation(param) else kind


def _root_param_kind(spec: RootSpec, index: Optional[int], p: cst.Param, fi: FuncInfo) -> int:
    name = p.name.value
    if spec.all_unknown:
        return UNKNOWN
    if name in spec.static_names or (index is not None and index in spec.static_nums):
        return STATIC
    if index is not None:
        if index < spec.bound_pos or index in spec.unknown_nums:
            return UNKNOWN
        if spec.traced_nums is not None and index not in spec.traced_nums:
            return UNKNOWN
    elif spec.traced_nums is not None:
        return UNKNOWN
    if name in spec.bound_names:
        return UNKNOWN
    if p.default is not None or _scalar_annotation(p):
        return UNKNOWN  # defaults are almost always config (axis=-1, eps=1e-6, dtype=...)
    if fi.method_of is not None and index is not None:
        # methods: static_argnums count ``self``, which the walk handles separately
        pass
    return TRACED


def analyze(info: ModuleInfo, dispatch_for: Callable[[bool, bool], Dict[type, List[Hook]]],
            analyze_untraced: bool, module: Optional[cst.Module] = None) -> List[Report]:
    fp = _Fixpoint(info, dispatch_for, analyze_untraced)
    reports = fp.run()
    if analyze_untraced and module is not None:
        w = FunctionWalk(info, None, dispatch_for(False, False), False, False, None)
        w.run_module(module)
        reports.extend(w.reports)
    return reports
