"""The cross-function analysis: which functions are traced, with which parameter kinds.

:func:`analyze` walks the roots found by the discovery, then every module-local function that
traced code calls (or passes as a callback), with each parameter's kind merged from the arguments
at the call sites, until nothing changes: a :class:`~lint_plugin.walk.FunctionWalk` per function,
re-run when its callers pass new kinds, its closure changes, or a callee's return kind changes.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Set

import libcst as cst

from .kinds import STATIC, UNKNOWN, merge_seed
from .module_info import FuncInfo, ModuleInfo
from .seeds import ParamSeeds
from .walk import FunctionWalk, Hook, Report

__all__ = ["DispatchFor", "analyze"]

# ``dispatch_for(traced, plain)``: the rule hooks per node type for a walk of traced code (``plain``:
# not under ``@int8ify``) or of code that is not traced
DispatchFor = Callable[[bool, bool], Dict[type, List[Hook]]]

# A function is re-walked when its inputs change; kinds only move up a small lattice, so this bound
# is never reached in practice, but it keeps a pathological file from looping.
_MAX_WALKS_PER_FUNCTION = 8


def _int8ified(fi: FuncInfo) -> bool:
    """Decorated with or passed to ``int8ify``: every matmul in it is rewritten."""
    return any(spec.sig.int8ify for spec in fi.roots)


class _Fixpoint:
    """Implements :class:`~lint_plugin.walk.CallGraph` for the walks it runs."""

    def __init__(self, info: ModuleInfo, dispatch_for: DispatchFor) -> None:
        self.info = info
        self.dispatch_for = dispatch_for
        self.seeds = ParamSeeds(info)
        self.queue: Deque[FuncInfo] = deque()
        self.queued: Set[int] = set()
        self.reports: Dict[int, List[Report]] = {}
        self.walks: Dict[int, int] = {}
        self.children: Dict[int, List[FuncInfo]] = {}

    def enqueue(self, fi: FuncInfo) -> None:
        if id(fi) not in self.queued and self.walks.get(id(fi), 0) < _MAX_WALKS_PER_FUNCTION:
            self.queued.add(id(fi))
            self.queue.append(fi)

    # CallGraph -------------------------------------------------------------------
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
        if call is not None and self._seed_params(callee, call, arg_kinds):
            changed = True
        if changed:
            self.enqueue(callee)

    def _seed_params(self, callee: FuncInfo, call: cst.Call, arg_kinds: List[int]) -> bool:
        """Merge the argument kinds of ``call`` into ``callee``'s parameter seeds; True if any changed."""
        changed = False
        params = callee.params
        offset = 1 if (callee.method_of is not None and params and params[0].name.value in ("self", "cls")
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
        return changed

    def closure(self, node: cst.CSTNode, walk: FunctionWalk) -> None:
        fi = self.info.by_node.get(id(node))
        if fi is None:
            return
        env = dict(walk.env)
        if fi.closure_env != env:
            fi.closure_env = env
            if fi.traced:
                self.enqueue(fi)

    # driver -------------------------------------------------------------------------
    def run(self) -> List[Report]:
        info = self.info
        for fi in info.functions:
            for spec in fi.roots:
                if spec.inherit_from is not None:
                    self.children.setdefault(id(spec.inherit_from), []).append(fi)
                elif not spec.sig.int8ify and not spec.sig.derivative and not _int8ified(fi):
                    fi.plain = True
            if fi.traced:
                self.enqueue(fi)
        while True:
            while self.queue:
                fi = self.queue.popleft()
                self.queued.discard(id(fi))
                self.walk(fi)
            if not self._plain_roots_of_untraced_parents():
                break
        out: List[Report] = []
        for reps in self.reports.values():
            out.extend(reps)
        return out

    def _plain_roots_of_untraced_parents(self) -> bool:
        """Roots applied inside functions that never became traced are plain roots (not under
        ``@int8ify``); True if that made new work."""
        progressed = False
        for fi in self.info.functions:
            if fi.plain or _int8ified(fi):
                continue
            for spec in fi.roots:
                parent = spec.inherit_from
                if parent is not None and not parent.traced and not spec.sig.derivative:
                    fi.plain = True
                    self.enqueue(fi)
                    progressed = True
                    break
        return progressed

    def walk(self, fi: FuncInfo) -> None:
        self.walks[id(fi)] = self.walks.get(id(fi), 0) + 1
        w = FunctionWalk(self.info, fi, self.dispatch_for(True, fi.plain), True, fi.plain, self)
        w.env = self.seeds.initial_env(fi)
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


def _module_static_names(info: ModuleInfo, module: cst.Module) -> Set[str]:
    """Module-level names bound only to Python values (``_EYE = np.eye(3)``, ``SCALE = 2.0``): under a
    trace they are constants, never tracers."""
    w = FunctionWalk(info, None, {}, False, False)
    w.run_module(module)
    return {name for name, k in w.env.items() if k == STATIC}


def analyze(info: ModuleInfo, module: cst.Module, dispatch_for: DispatchFor, check_anywhere: bool) -> List[Report]:
    """Every rule report in the file; ``check_anywhere``: also run the rules that apply outside traced
    code (over untraced functions and the module body)."""
    info.module_static = _module_static_names(info, module)
    reports = _Fixpoint(info, dispatch_for).run()
    if check_anywhere:
        anywhere = dispatch_for(False, False)
        for fi in info.functions:
            if not fi.traced and not fi.is_lambda:
                w = FunctionWalk(info, fi, anywhere, False, False)
                w.env = {p.name.value: UNKNOWN for p in fi.params}
                w.run_function(fi)
                reports.extend(w.reports)
        w = FunctionWalk(info, None, anywhere, False, False)
        w.run_module(module)
        reports.extend(w.reports)
    return reports
