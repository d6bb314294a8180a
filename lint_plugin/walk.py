"""The per-function data flow and the single rule-dispatching walk.

For each function that runs as traced code (and, when the file has an int8 matmul to check, for
the other functions too, for the rules that apply anywhere) a :class:`FunctionWalk` executes the
body abstractly: it keeps an environment ``name -> kind`` (see :mod:`lint_plugin.kinds`), evaluates
every expression once, bottom-up, and calls the rules registered for each node type right after
the node's kind is known. Control flow is handled simply: both arms of an ``if`` run from the same
environment and are joined afterwards; loop bodies run once and are joined with the state before
the loop.

Calls into module-local functions are reported to a :class:`CallGraph` (the cross-function fixpoint
of :mod:`lint_plugin.fixpoint`), which decides what to walk next.
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Protocol, Sequence, Set, Tuple, Union

import libcst as cst

from .array_api import (
    ARRAY_ATTRS_SAME,
    ARRAY_ATTRS_TRACED,
    COMBINE_BUILTINS,
    STATIC_ATTRS,
    STATIC_BUILTINS,
    api_call_kind,
    method_call_kind,
)
from .aliases import dotted_name
from .annotations import AnnotationReader, annotated_class
from .cstwalk import STRING_NODES, iter_children
from .kinds import INT8, MODULE_SELF, STATIC, TRACED, UNKNOWN, VARIABLE, combine, is_traced, join, truth
from .module_classes import attribute_kind
from .module_info import FuncInfo, ModuleInfo, named_params
from .names import LINEN, host_callable_keyword

__all__ = ["CallGraph", "CaseLeaf", "FunctionWalk", "Hook", "Report"]

Hook = Callable[[cst.CSTNode, "FunctionWalk"], None]
Report = Tuple[cst.CSTNode, str, str]  # node, code, message


class CallGraph(Protocol):
    """What a walk tells the cross-function analysis."""

    def call_edge(self, callee: FuncInfo, call: Optional[cst.Call], arg_kinds: List[int],
                  walk: "FunctionWalk") -> None:
        """``walk`` calls ``callee`` (``call`` is None when it passes it as a callback)."""

    def closure(self, node: cst.CSTNode, walk: "FunctionWalk") -> None:
        """``walk`` reached the definition ``node`` of a nested function or lambda."""


def _container(k: int) -> int:
    """A Python container of values of kind ``k``: its truthiness and ``len()`` are static."""
    return STATIC if k == STATIC else UNKNOWN


_COMPREHENSIONS = (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)
_LITERALS = (cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString, cst.Ellipsis)
_INT_PRESERVING_OPS = (cst.Add, cst.Subtract, cst.Multiply, cst.BitAnd, cst.BitOr, cst.BitXor,
                       cst.LeftShift, cst.RightShift, cst.FloorDivide, cst.Modulo)
# ``A = B`` at module level: how many such renamings a constant is followed through
_MAX_RENAMES = 4


def _is_constant_name(name: str) -> bool:
    """An UPPER_CASE name of two letters or more: a constant by PEP 8's convention (``X`` is often a matrix)."""
    return name.isupper() and sum(c.isalpha() for c in name) > 1


class CaseLeaf(NamedTuple):
    """A part of a ``case`` pattern that binds or compares, with the part of the subject it meets."""

    name: Optional[cst.Name]  # a capture (``case (n, m)``, ``*rest``, ``**rest``, ``0 as z``), or None
    value: Optional[cst.BaseExpression]  # the value of a value pattern (``case 0``), or None
    node: Optional[cst.BaseExpression]  # the part of the subject it meets, where the source shows it
    kind: int
    # whether Python compares a value pattern with that part: not inside a structure (a sequence, mapping or
    # class pattern) that the source does not show the subject to have (an array is not a sequence)
    compared: bool


_Pending = Tuple[cst.CSTNode, Optional[cst.BaseExpression], int, bool]


class FunctionWalk:
    """Abstract execution of one function body (or the module body) with rule dispatch."""

    def __init__(self, info: ModuleInfo, func: Optional[FuncInfo], dispatch: Dict[type, List[Hook]],
                 traced: bool, plain: bool, graph: Optional[CallGraph] = None) -> None:
        self.info = info
        self.func = func
        self.dispatch = dispatch
        self.traced = traced
        self.plain = plain
        self.graph = graph
        self.env: Dict[str, int] = {}
        # the expression each name was last bound to, for rules that look through a variable
        # (``prod = a[:, None] * b; prod.sum(1)``); None when no single expression was assigned
        # (a loop target, unpacking a call's result)
        self.values: Dict[str, Optional[cst.BaseExpression]] = {}
        self.memo: Dict[int, int] = {}
        self.test_nodes: Set[int] = set()
        self.reports: List[Report] = []
        self.ret: Optional[int] = None
        self.ret_elts: Optional[List[int]] = None
        self.ret_seen = False
        self.call_elts: Dict[int, List[int]] = {}
        self.param_classes: Optional[Dict[str, str]] = None  # see _param_classes
        module_cls = func.cls if func is not None and func.cls is not None and func.cls.framework else None
        self.module_cls = module_cls  # the linen/nnx/equinox module whose ``self`` is visible

    # ------------------------------------------------------------------ helpers for rules
    def report(self, node: cst.CSTNode, code: str, message: str) -> None:
        self.reports.append((node, code, message))

    def kind(self, node: cst.BaseExpression) -> int:
        k = self.memo.get(id(node))
        if k is None:
            k = self.ev(node)
        return k

    def qualname(self, node: cst.BaseExpression) -> Optional[str]:
        """The imported name ``node`` stands for, through a local alias too (``einsum = jnp.einsum``)."""
        if isinstance(node, cst.Name) and node.value in self.env:
            bound = self.values.get(node.value)
            return self.info.imports.resolve(bound) if isinstance(bound, (cst.Name, cst.Attribute)) else None
        return self.info.imports.resolve(node)

    def is_builtin(self, node: cst.BaseExpression, *names: str) -> bool:
        return (isinstance(node, cst.Name) and node.value in names
                and not self.info.imports.is_imported(node.value) and node.value not in self.env)

    def in_test(self, node: cst.CSTNode) -> bool:
        return id(node) in self.test_nodes

    def bound_value(self, name: str) -> Optional[cst.BaseExpression]:
        """The expression ``name`` was last assigned, if it was a plain ``name = expr``."""
        return self.values.get(name)

    # ------------------------------------------------------------------ entry points
    def run_function(self, fi: FuncInfo) -> None:
        node = fi.node
        for param in named_params(node.params):
            if isinstance(param.default, (cst.Name, cst.Attribute)):
                self.values[param.name.value] = param.default  # dot_general=lax.dot_general: the default's call
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
                k = self.ev(s.value)  # type: ignore[attr-defined]
                for tgt in s.targets:  # type: ignore[attr-defined]
                    self.bind(tgt.target, k, s.value)  # type: ignore[attr-defined]
            elif t is cst.Expr:
                self.ev(s.value)  # type: ignore[attr-defined]
            elif t is cst.Return:
                self._record_return(s.value)  # type: ignore[attr-defined]
            elif t is cst.AugAssign:
                k = combine(self.ev(s.target), self.ev(s.value))  # type: ignore[attr-defined]
                self.bind(s.target, k, None)  # type: ignore[attr-defined]
            elif t is cst.AnnAssign:
                if s.value is not None:  # type: ignore[attr-defined]
                    self.bind(s.target, self.ev(s.value), s.value)  # type: ignore[attr-defined]
            elif t is cst.Assert:
                self._mark_test(s.test)  # type: ignore[attr-defined]
                self.ev(s.test)  # type: ignore[attr-defined]
                if s.msg is not None:  # type: ignore[attr-defined]
                    self.ev(s.msg)  # type: ignore[attr-defined]
                self._hooks(s)
            elif t is cst.Raise:
                if s.exc is not None:  # type: ignore[attr-defined]
                    self.ev(s.exc)  # type: ignore[attr-defined]
            elif t is cst.Del or t is cst.Import or t is cst.ImportFrom:
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
            if self.graph is not None:
                self.graph.closure(stmt, self)
        elif t is cst.ClassDef:
            self.env[stmt.name.value] = STATIC  # type: ignore[attr-defined]
        elif t is cst.With:
            for item in stmt.items:  # type: ignore[attr-defined]
                self.ev(item.item)
                if item.asname is not None:
                    self.bind(item.asname.name, UNKNOWN, None)
            self.exec_block(stmt.body)  # type: ignore[attr-defined]
        elif t is cst.Try or t is cst.TryStar:
            self.exec_block(stmt.body)  # type: ignore[attr-defined]
            for h in stmt.handlers:  # type: ignore[attr-defined]
                if h.type is not None:
                    self.ev(h.type)
                if h.name is not None:
                    self.bind(h.name.name, STATIC, None)
                self.exec_block(h.body)
            if stmt.orelse is not None:  # type: ignore[attr-defined]
                self.exec_block(stmt.orelse.body)  # type: ignore[attr-defined]
            if stmt.finalbody is not None:  # type: ignore[attr-defined]
                self.exec_block(stmt.finalbody.body)  # type: ignore[attr-defined]
        elif t is cst.Match:
            self._exec_match(stmt)  # type: ignore[arg-type]
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

    def _exec_match(self, stmt: cst.Match) -> None:
        """A ``match``: its subject (a value pattern compares it in Python), then each case with its captures
        bound to the kinds of the parts of the subject they capture and its guard a test, as an ``if``'s."""
        self.ev(stmt.subject)
        self._hooks(stmt)
        before = dict(self.env)
        for case in stmt.cases:
            for leaf in self.case_leaves(case.pattern, stmt.subject):
                if leaf.name is not None:
                    self.bind(leaf.name, leaf.kind, None)
            if case.guard is not None:
                self._mark_test(case.guard)
                self.ev(case.guard)
                self._hooks(case)
            self.exec_block(case.body)
        self._join_into(before)

    def case_leaves(self, pattern: cst.MatchPattern, subject: cst.BaseExpression) -> List[CaseLeaf]:
        """The captures and value patterns of ``pattern`` with the parts of ``subject`` they meet: a sequence
        pattern meets the items of a literal tuple or list subject (``match (x, x.sum()): case (a, 0):``
        compares ``x.sum()`` with ``0``), also through a name bound to one or a module-local function's
        tuple; any other structure is not shown, and its parts have the subject's kind."""
        leaves: List[CaseLeaf] = []
        pending: List[_Pending] = [(pattern, subject, self.kind(subject), True)]
        while pending:
            pat, node, kind, shown = pending.pop()
            if isinstance(pat, cst.MatchValue):
                leaves.append(CaseLeaf(None, pat.value, node, kind, shown))
            elif isinstance(pat, (cst.MatchAs, cst.MatchStar)):
                if pat.name is not None:
                    leaves.append(CaseLeaf(pat.name, None, node, kind, shown))
                if isinstance(pat, cst.MatchAs) and pat.pattern is not None:
                    pending.append((pat.pattern, node, kind, shown))
            elif isinstance(pat, cst.MatchOr):
                pending.extend((el.pattern, node, kind, shown) for el in pat.patterns)
            elif isinstance(pat, (cst.MatchTuple, cst.MatchList)):
                pending.extend(self._sequence_parts(pat, node if shown else None, kind))
            elif isinstance(pat, cst.MatchMapping):  # the parts a mapping or class pattern meets are not shown
                if pat.rest is not None:
                    leaves.append(CaseLeaf(pat.rest, None, None, kind, False))
                pending.extend((el.pattern, None, kind, False) for el in pat.elements)
            elif isinstance(pat, cst.MatchClass):
                pending.extend((el.value, None, kind, False) for el in pat.patterns)
                pending.extend((el.pattern, None, kind, False) for el in pat.kwds)
        return leaves

    def _sequence_parts(self, pat: Union[cst.MatchTuple, cst.MatchList], node: Optional[cst.BaseExpression],
                        kind: int) -> List[_Pending]:
        """The element patterns of a sequence pattern paired with the items of the subject part ``node`` they
        meet; each with no shown item (and ``kind``) when the items are not shown, none compared when their
        number cannot match."""
        elements = [el if isinstance(el, cst.MatchStar) else el.value for el in pat.patterns]
        items = self._sequence_items(node) if node is not None else None
        stars = [i for i, el in enumerate(elements) if isinstance(el, cst.MatchStar)]
        if items is None:
            return [(el, None, kind, False) for el in elements]
        if len(items) < len(elements) - len(stars) or (not stars and len(items) != len(elements)):
            return [(el, None, UNKNOWN, False) for el in elements]  # the case never matches
        star = stars[0] if stars else len(elements)
        after = len(elements) - star - 1 if stars else 0
        out: List[_Pending] = [(el, item, k, True) for el, (item, k) in zip(elements[:star], items)]
        if stars:
            rest = items[star:len(items) - after]
            out.append((elements[star], None, _container(combine(*(k for _, k in rest))), True))
            out.extend((el, item, k, True) for el, (item, k) in zip(elements[star + 1:], items[len(items) - after:]))
        return out

    def _sequence_items(self, node: cst.BaseExpression) -> Optional[List[Tuple[Optional[cst.BaseExpression], int]]]:
        """The items, with their kinds, of a subject part the source shows to be a tuple or list: a literal
        one without ``*`` (its items are parts of the subject), a name bound to one, or the call of a
        module-local function that returns one (their items are shown as kinds only)."""
        renamed = False
        for _ in range(_MAX_RENAMES):
            if not isinstance(node, cst.Name) or self.values.get(node.value) is None:
                break
            node, renamed = self.values[node.value], True  # type: ignore[assignment]
        if isinstance(node, (cst.Tuple, cst.List)):
            if any(isinstance(el, cst.StarredElement) for el in node.elements):
                return None
            return [(None if renamed else el.value, self.kind(el.value)) for el in node.elements]
        elts = self.call_elts.get(id(node))
        return [(None, k) for k in elts] if elts is not None else None

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
                self.bind(target, STATIC, None)
                return
            if self.is_builtin(it.func, "enumerate") and it.args and isinstance(target, (cst.Tuple, cst.List)) \
                    and len(target.elements) == 2:
                self.bind(target.elements[0].value, STATIC, None)
                self._bind_loop_target(target.elements[1].value, it.args[0].value)
                return
            if self.is_builtin(it.func, "zip") and isinstance(target, (cst.Tuple, cst.List)) \
                    and len(target.elements) == len(it.args) and all(a.keyword is None and not a.star for a in it.args):
                for el, a in zip(target.elements, it.args):
                    self._bind_loop_target(el.value, a.value)
                return
        k = self.kind(it)
        if k == MODULE_SELF:
            k = STATIC
        elif k == VARIABLE:
            k = TRACED  # the rows of the array it holds
        self.bind(target, k, None)

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

    def bind(self, target: cst.BaseExpression, kind: int, value: Optional[cst.BaseExpression]) -> None:
        t = type(target)
        if t is cst.Name:
            name = target.value  # type: ignore[attr-defined]
            self.env[name] = kind
            self.values[name] = value
        elif t is cst.Tuple or t is cst.List:
            elements = target.elements  # type: ignore[attr-defined]
            if isinstance(value, (cst.Tuple, cst.List)) and len(value.elements) == len(elements) \
                    and not any(isinstance(e, cst.StarredElement) for e in value.elements):
                for el, v in zip(elements, value.elements):
                    self.bind(el.value, self.kind(v.value), v.value)
            elif value is not None and id(value) in self.call_elts \
                    and len(self.call_elts[id(value)]) == len(elements):
                for el, k in zip(elements, self.call_elts[id(value)]):
                    self.bind(el.value, k, None)
            else:
                sub = kind if kind != MODULE_SELF else STATIC
                for el in elements:
                    self.bind(el.value, sub, None)
        elif t is cst.StarredElement:
            self.bind(target.value, kind, None)  # type: ignore[attr-defined]
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
        """Mark the condition of an ``if``/``while``/``assert``/ternary/comprehension filter/``case`` guard and
        its ``and``/``or``/``not`` parts: JX201 reports the statement, not each part."""
        pending = [test]
        while pending:
            node = pending.pop()
            self.test_nodes.add(id(node))
            if isinstance(node, cst.BooleanOperation):
                pending.append(node.left)
                pending.append(node.right)
            elif isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Not):
                pending.append(node.expression)

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
        elif t in _LITERALS:
            k = STATIC
        elif t is cst.Comparison:
            k = self._ev_comparison(node)  # type: ignore[arg-type]
        elif t is cst.UnaryOperation:
            k = self.ev(node.expression)  # type: ignore[attr-defined]
            if k == MODULE_SELF:
                k = STATIC
            elif isinstance(node.operator, cst.Not):  # type: ignore[attr-defined]
                k = TRACED if k == INT8 else truth(k)
            elif k == VARIABLE:
                k = TRACED
        elif t is cst.BooleanOperation:
            k = combine(truth(self.ev(node.left)), truth(self.ev(node.right)))  # type: ignore[attr-defined]
        elif t is cst.IfExp:
            self._mark_test(node.test)  # type: ignore[attr-defined]
            self.ev(node.test)  # type: ignore[attr-defined]
            k = join(self.ev(node.body), self.ev(node.orelse))  # type: ignore[attr-defined]
        elif t is cst.Tuple or t is cst.List or t is cst.Set:
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
            self.bind(node.target, k, None)  # type: ignore[attr-defined]
        elif t is cst.FormattedString or t is cst.ConcatenatedString:
            self._ev_parts(node)
            k = STATIC
        else:
            self._ev_parts(node)
            k = UNKNOWN
        self.memo[id(node)] = k
        hooks = self.dispatch.get(t)
        if hooks:
            for h in hooks:
                h(node, self)
        return k

    def _ev_parts(self, node: cst.CSTNode) -> None:
        """Evaluate the expressions inside a node this walk has no rule for (f-strings, slices)."""
        pending = list(iter_children(node))
        pending.reverse()  # a stack, popped in source order
        while pending:
            child = pending.pop()
            if isinstance(child, cst.BaseExpression):
                self.ev(child)
            else:
                pending.extend(reversed(list(iter_children(child))))

    def _ev_name(self, node: cst.Name) -> int:
        name = node.value
        k = self.env.get(name)
        if k is not None:
            return k
        if name in ("True", "False", "None"):
            return STATIC
        info = self.info
        if info.imports.is_imported(name) or name in info.module_funcs or name in info.module_static:
            return STATIC
        return UNKNOWN

    def _ev_attribute(self, node: cst.Attribute) -> int:
        v = self.ev(node.value)
        attr = node.attr.value
        if attr in STATIC_ATTRS:
            return STATIC
        if v == MODULE_SELF:
            cls = self.module_cls
            return attribute_kind(cls, attr, self.info) if cls is not None else UNKNOWN
        if v == TRACED or v == INT8:
            if attr in ARRAY_ATTRS_SAME:
                return v
            if attr in ARRAY_ATTRS_TRACED:
                return TRACED
            return UNKNOWN
        if v == VARIABLE:
            return TRACED if attr == "value" else UNKNOWN
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
        if v == VARIABLE:
            return TRACED
        if v == MODULE_SELF:
            return STATIC
        if v == STATIC:
            return STATIC if idx == STATIC else UNKNOWN
        return UNKNOWN

    def _ev_comparison(self, node: cst.Comparison) -> int:
        k = self.ev(node.left)
        only_is = True
        only_equality = True
        membership = False
        for ct in node.comparisons:
            k = combine(k, self.ev(ct.comparator))
            if isinstance(ct.operator, (cst.In, cst.NotIn)):
                membership = True
            if not isinstance(ct.operator, (cst.Is, cst.IsNot)):
                only_is = False
            if not isinstance(ct.operator, (cst.Equal, cst.NotEqual)):
                only_equality = False
        if only_is:
            return STATIC
        operands = [node.left, *(ct.comparator for ct in node.comparisons)]
        if not membership and any(self._is_label(o, operands) for o in operands):
            return STATIC  # a traced array is never compared with a string or an enum member
        if only_equality and k != STATIC and self._parameter_against_foreign_constant(operands):
            return UNKNOWN
        if membership and k != STATIC:
            return UNKNOWN  # ``key in params``: dicts and lists of tracers are fine
        return k

    def equality_kind(self, subject: Optional[cst.BaseExpression], subject_kind: int,
                      value: cst.BaseExpression) -> int:
        """The kind of ``subject == value`` for a ``case`` value pattern (``case "train":``, ``case Mode.TRAIN:``),
        read as :meth:`_ev_comparison` reads a comparison (``subject``: the part of the subject compared, None
        where the source does not show it)."""
        operands = [value] if subject is None else [subject, value]
        if self._is_label(value, operands):
            return STATIC
        if is_traced(subject_kind) and self._parameter_against_foreign_constant(operands):
            return UNKNOWN
        return combine(subject_kind, self.kind(value))

    def _parameter_against_foreign_constant(self, operands: List[cst.BaseExpression]) -> bool:
        """Whether ``==``/``!=`` compares a parameter, as the caller passed it, with a constant of another
        module (``model_mode != MODEL_MODE_TRAIN`` after ``from common_types import MODEL_MODE_TRAIN``, or
        ``common_types.MODEL_MODE_TRAIN``) and nothing else: such a constant is almost always a mode label, a
        string whose value this file does not show, so the comparison may be a Python bool (unknown, not
        traced). A value the function computed (``x.sum() == PAD_ID``) is an array whatever it is compared with."""
        foreign = {id(o) for o in operands if self._is_foreign_constant(o)}
        return bool(foreign) and all(id(o) in foreign or self._is_parameter(o) or self.kind(o) == STATIC
                                     for o in operands)

    def _is_foreign_constant(self, node: cst.BaseExpression) -> bool:
        """An UPPER_CASE constant of another module: a name this file imports (absolutely, relatively or with
        ``*``) or binds at module level to such a constant, or an attribute of an imported module
        (``common_types.MODEL_MODE_TRAIN``; a CamelCase owner is a class, whose members need the compared
        parameter's annotation, see :meth:`_is_label`)."""
        info = self.info
        for _ in range(_MAX_RENAMES):
            if isinstance(node, cst.Attribute):
                owner = dotted_name(node.value)
                return owner is not None and _is_constant_name(node.attr.value) \
                    and info.imports.is_imported(owner.partition(".")[0]) and owner.rpartition(".")[2].islower()
            if not isinstance(node, cst.Name) or not _is_constant_name(node.value) or node.value in self.env \
                    or node.value in info.module_funcs or node.value in info.classes_by_name:
                return False
            value = info.module_assigns.get(node.value)
            if value is None:
                return True  # not defined in this file: imported
            node = value  # ``MODE_TRAIN = common_types.MODEL_MODE_TRAIN``
        return False

    def _is_parameter(self, node: cst.BaseExpression) -> bool:
        """A parameter of this function, not rebound in its body so far (what the caller passed), and not
        annotated as an array (``x: jax.Array``)."""
        if not isinstance(node, cst.Name) or self.func is None or node.value in self.values:
            return False
        reader = AnnotationReader.of(self.info)
        return any(p.name.value == node.value and reader.kind(p.annotation) != TRACED
                   for p in named_params(self.func.node.params))

    def _is_label(self, node: cst.BaseExpression, operands: List[cst.BaseExpression]) -> bool:
        """A string (a literal or a module-level string constant) or an enum member: an enum class of
        this file's, or the class a compared parameter is annotated with (``mode == Mode.TRAIN`` for
        ``mode: Mode``)."""
        if isinstance(node, STRING_NODES):
            return True
        info = self.info
        if isinstance(node, cst.Name):
            return node.value in info.module_strings and node.value not in self.env
        if not isinstance(node, cst.Attribute):
            return False
        owner = dotted_name(node.value)
        if owner is None:
            return False
        local = info.classes_by_name.get(owner)
        if local is not None and local.is_enum:
            return True
        annotations = self._param_classes()
        return any(isinstance(o, cst.Name) and annotations.get(o.value) == owner for o in operands)

    def _param_classes(self) -> Dict[str, str]:
        """The class each parameter of this function is annotated with, where one is named."""
        if self.param_classes is None:
            params = named_params(self.func.node.params) if self.func is not None else []
            self.param_classes = {p.name.value: c for p in params
                                  if (c := annotated_class(p.annotation)) is not None}
        return self.param_classes

    def _ev_binop(self, node: cst.BinaryOperation) -> int:
        left = self.ev(node.left)
        right = self.ev(node.right)
        if (left == INT8 or right == INT8) and left in (INT8, STATIC) and right in (INT8, STATIC) \
                and isinstance(node.operator, _INT_PRESERVING_OPS):
            return INT8
        return combine(left, right)

    def _ev_lambda(self, node: cst.Lambda) -> int:
        if id(node) in self.info.lambda_roots:
            if self.graph is not None:
                self.graph.closure(node, self)
            return STATIC
        saved = self.env
        self.env = dict(saved)
        for p in named_params(node.params):
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
            for cond in comp.ifs:  # a filter is a Python branch per item, as an ``if`` is
                self._mark_test(cond.test)
                self.ev(cond.test)
                self._hooks(cond)
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
        q = self.qualname(func)
        host = _host_callable(node, q)
        arg_kinds: List[int] = []
        for a in node.args:
            if a.value is host:
                # the host function of a callback runs in Python, outside the trace: no rule
                # looks inside it and it does not become traced
                self.memo[id(a.value)] = STATIC
                arg_kinds.append(STATIC)
            else:
                arg_kinds.append(self.ev(a.value))
        any_traced = any(is_traced(k) for k in arg_kinds)

        if isinstance(func, cst.Name) and func.value not in self.env and not self.info.imports.is_imported(func.value):
            name = func.value
            if name in STATIC_BUILTINS:
                return STATIC
            if name in COMBINE_BUILTINS:
                return combine(*arg_kinds) if arg_kinds else STATIC
        local = self.info.lookup_callee(func, self.func)
        if local is not None:
            if self.graph is not None and self.traced:
                self.graph.call_edge(local, node, arg_kinds, self)
                if local.ret is None:
                    # not walked yet: unknown rather than a guess, which would reach the seeds of the
                    # functions this result is passed to (they only grow); this walk runs again once
                    # the callee's return kind is known
                    return UNKNOWN
            if local.ret_elts is not None:
                self.call_elts[id(node)] = local.ret_elts
            if local.ret == INT8:
                return INT8
            if local.ret == STATIC:
                # a Python value even from traced arguments (``def is_sharded(a): return a.shape[0] > 1``):
                # the callee was walked with the kinds its call sites pass, this one's included
                return STATIC
            return TRACED if any_traced else UNKNOWN
        if self.graph is not None and self.traced:
            # module-local functions passed as callbacks (``jax.tree.map(f, ...)``, ``emit_pipeline(f)``) run at
            # trace time; passed again once this walk is known to be outside @int8ify, they are too
            for a in node.args:
                if isinstance(a.value, cst.Name) and a.value is not host:
                    f = self.info.lookup(a.value.value, self.func)
                    if f is not None and (not f.traced or (self.plain and not f.plain)):
                        self.graph.call_edge(f, None, [], self)
        if q is not None:
            return api_call_kind(q, node, arg_kinds, self.info.imports)
        if isinstance(func, cst.Attribute):
            recv = self.memo.get(id(func.value), UNKNOWN)
            linen_self = recv == MODULE_SELF and self.module_cls is not None and self.module_cls.framework == LINEN
            return method_call_kind(recv, func.attr.value, node, arg_kinds, self.info.imports, linen_self)
        if isinstance(func, cst.Call) and any_traced:
            return TRACED  # ``nn.Dense(4)(x)``: a module applied to a traced value
        return UNKNOWN


def _host_callable(call: cst.Call, q: Optional[str]) -> Optional[cst.BaseExpression]:
    """The function argument of ``jax.pure_callback`` and friends, which runs on the host."""
    keyword = host_callable_keyword(q)
    if keyword is None:
        return None
    for i, a in enumerate(call.args):
        if (a.keyword is None and i == 0 and not a.star) or (a.keyword is not None and a.keyword.value == keyword):
            return a.value
    return None
