"""The jaxpr -> jaxpr rewrite: an interpreter that re-traces a jaxpr with every float matmul replaced.

Like JAX's own interpreters (``batching.py``, ``ad.py``) it looks each equation's primitive up in one registry of
per-primitive rules (:mod:`jaxpr_rewrite._interpret.rules`), calls the rule, or falls back:

* ``dot_general`` / ``ragged_dot_general`` go to the dot rule (:func:`~jaxpr_rewrite._interpret.rules.dots.rewrite_dot`:
  the configured backend, the int8 contract by default);
* a higher-order primitive (``jit``, ``scan``, ``cond``, ...) goes to its rule's ``rewrite``, which returns the
  equation's params with only the sub-jaxprs swapped for their rewritten versions, so donation, shardings, names
  and remat policies survive untouched;
* a pre-quantized weight (:class:`~jaxpr_rewrite.quantized.QuantizedArray`) goes to its reader's ``quantized`` rule
  (``scan``, ``while_loop``, ``cond``, a nested ``jit``, a cast, a transpose carry it inside with JAX's public API,
  so the loop body's dot uses the codes); anywhere else it is materialised;
* every other equation is bound again as it is.

A higher-order primitive without a rule is an error when its sub-jaxprs hold a float matmul that the options do
not skip: a matmul is never left in float silently.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax.extend  # noqa: F401  (makes jax.extend.core importable)
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Var

from jx_codes import HIDDEN_MATMUL

from .. import _compat
from .._core import platforms
from .._core.compile_policy import late_inlining
from .._core.errors import Int8ifyError
from .._core.jaxprs import (SUBJAXPR_PARAMS, SiblingGroup, forward_jaxprs, hidden_matmuls, is_float_dot,
                            jaxpr_and_consts, open_jaxpr, sibling_groups)
from .config import RewriteConfig
from .evaluate import bind, equation_context, evaluate
from .._quantized.array import is_quantized
from .rules import RuleContext, rule_for
from .rules.common import materialised
from .rules.dots import may_join_siblings, rewrite_dot, rewrite_sibling_dots, skip_reason
from .._core.scopes import join_scope, matching_pattern
from .._core.source import UNKNOWN, Location, describe_source, eqn_location

__all__ = ["Rewriter", "dependents"]


class Rewriter:
    """Rewrites jaxprs under one :class:`RewriteConfig`, sharing the work between identical sub-jaxprs.

    A jitted function called from many places yields the same sub-jaxpr object each time; it is rewritten once,
    and the rewritten equations keep sharing one jaxpr, as the originals did. A rewriter holds no state that
    depends on where it is in a program (the name scope travels as an argument), so the lazy custom_jvp/vjp
    rules it creates can run concurrently.
    """

    def __init__(self, config: RewriteConfig, program: Jaxpr | None = None,
                 constants: Callable[[ClosedJaxpr], list] | None = None):
        """
        Arguments:
            config: the rewrite options.
            program: the top-level program this rewriter runs, whose dots ``config.activation_scales`` were
                calibrated for (checked here).
            constants: what a nested closed jaxpr's constants become before it is rewritten (``None``: themselves);
                ``int8ify`` quantizes the weights among them once (a jitted function called inside that closes
                over its weights).

        The rewritten program is for ``config.platforms``, or else the platforms targeted when the rewriter is made
        (:func:`~jaxpr_rewrite._core.platforms.targeted`: the default device's), also where its rules run later (a
        custom derivative rule that JAX traces when it differentiates).
        """
        self.config = config
        self.targets = config.platforms or platforms.targeted()
        self._constants = constants
        self.backend = config.dot_backend
        scales = config.activation_scales
        # id(top-level dot equation) -> its CalibratedDot (the static scales of its two operands)
        self.static_dots: dict = {} if scales is None or program is None else scales.assign(program)
        self._rewritten: dict = {}
        self._rewrites: dict = {}

    # -- analysis ---------------------------------------------------------------------------------------------
    def rewrites_in(self, jaxpr, scope: str) -> bool:
        """Whether ``jaxpr`` (nested jaxprs included) holds a float matmul that the options rewrite."""
        jaxpr = open_jaxpr(jaxpr)
        key = (id(jaxpr), scope)
        cached = self._rewrites.get(key)
        if cached is not None and cached[0] is jaxpr:
            return cached[1]
        found = any(self.rewrites_at(eqn, scope) for eqn in jaxpr.eqns)
        self._rewrites[key] = (jaxpr, found)
        return found

    def rewrites_at(self, eqn, scope: str) -> bool:
        """Whether ``eqn`` is, or holds in a forward sub-jaxpr, a float matmul that the options rewrite."""
        here = join_scope(scope, eqn.source_info.name_stack)
        if is_float_dot(eqn):
            return skip_reason(eqn, self.config, here) is None
        if hidden_matmuls(eqn) is not None:  # refused, unless the options keep its scope float
            return matching_pattern(here, self.config.skip) is None
        return any(self.rewrites_in(sub, here) for sub in forward_jaxprs(eqn))

    # -- jaxpr -> jaxpr ---------------------------------------------------------------------------------------
    def closed(self, closed_jaxpr: ClosedJaxpr, scope: str = "", *, keep_float_from: int | None = None,
               context=None, where: Location = UNKNOWN) -> ClosedJaxpr:
        """Rewrite a closed jaxpr; returns it unchanged (the same object) when it holds nothing to rewrite.

        Arguments:
            closed_jaxpr: the jaxpr to rewrite.
            scope: the name scope it runs in.
            keep_float_from: inputs from this index on are tangents: matmuls that depend on them stay float
                (used for custom_jvp rules, whose tangent matmuls form the backward pass).
            context: a context manager to trace under (a shard_map body's axis environment).
            where: the user's source of the enclosing equation, for equations JAX recorded none for.

        Returns:
            A ``ClosedJaxpr`` with the same input and output types.
        """
        jaxpr = closed_jaxpr.jaxpr
        if not self.rewrites_in(jaxpr, scope):
            return closed_jaxpr
        key = (id(closed_jaxpr), scope)
        cached = self._rewritten.get(key)
        if cached is not None and cached[0] is closed_jaxpr and keep_float_from is None:
            return cached[1]
        tangents = frozenset(jaxpr.invars[keep_float_from:]) if keep_float_from is not None else frozenset()
        consts = closed_jaxpr.consts if self._constants is None else self._constants(closed_jaxpr)

        def interpret(*args):
            return materialised(self.interpret(jaxpr, consts, args, scope, tangents, where))

        in_avals = [v.aval for v in jaxpr.invars]
        if context is None:
            new_jaxpr, new_consts = _compat.trace_to_jaxpr(interpret, in_avals, jaxpr.debug_info)
        else:
            with context:
                new_jaxpr, new_consts = _compat.trace_to_jaxpr(interpret, in_avals, jaxpr.debug_info)
        result = ClosedJaxpr(new_jaxpr, new_consts)
        if keep_float_from is None:
            self._rewritten[key] = (closed_jaxpr, result)
        return result

    def open(self, jaxpr: Jaxpr, scope: str = "", *, context=None, where: Location = UNKNOWN) -> Jaxpr:
        """Rewrite an open jaxpr (``remat``, ``shard_map`` bodies), which cannot gain constants."""
        if not self.rewrites_in(jaxpr, scope):
            return jaxpr
        result = self.closed(ClosedJaxpr(jaxpr, []), scope, context=context, where=where)
        if result.consts:
            raise Int8ifyError(
                "the rewritten body of a primitive that takes an open jaxpr captured constants "
                f"({[np.shape(c) for c in result.consts]}); please report this program"
            )
        return result.jaxpr

    def swap(self, value, scope: str, *, context=None, where: Location = UNKNOWN, keep=()):
        """Rewrite a param value that is a jaxpr, a closed jaxpr, or a (named) tuple of them; keep its type.

        Arguments:
            keep: field names of a named tuple to leave as they are (derivative-only sub-jaxprs).
        """
        if isinstance(value, ClosedJaxpr):
            return self.closed(value, scope, context=context, where=where)
        if isinstance(value, Jaxpr):
            return self.open(value, scope, context=context, where=where)
        fields = getattr(value, "_fields", None)
        if fields is not None:
            return type(value)(*(
                getattr(value, f) if f in keep else self.swap(getattr(value, f), scope, context=context, where=where)
                for f in fields
            ))
        if isinstance(value, tuple):
            return tuple(self.swap(v, scope, context=context, where=where) for v in value)
        return value

    # -- evaluation -------------------------------------------------------------------------------------------
    def interpret(self, jaxpr: Jaxpr, consts: Sequence, args: Sequence, scope: str = "",
                  tangents=frozenset(), where: Location = UNKNOWN) -> list:
        """Evaluate ``jaxpr`` under the current trace, emitting the rewritten program.

        Arguments:
            jaxpr: the program.
            consts: values of its constvars.
            args: values of its invars (arrays, tracers, or :class:`~jaxpr_rewrite.quantized.QuantizedArray`).
            scope: the name scope the program runs in.
            tangents: invars holding tangents; every value computed from them keeps its float matmuls.
            where: the user's source of the enclosing equation, for equations JAX recorded none for.

        Returns:
            The values of its outvars (a pre-quantized input passed straight through stays quantized).
        """
        with platforms.target(self.targets):
            return self._interpret(jaxpr, consts, args, scope, tangents, where)

    def _interpret(self, jaxpr: Jaxpr, consts: Sequence, args: Sequence, scope: str, tangents, where: Location) -> list:
        tangent_vars = set(tangents)
        smoothed: dict = {}  # activations divided by a smoothing group's factors, shared by the group's dots
        siblings = self._sibling_groups(jaxpr, scope, tangents)
        computed: dict = {}  # id(equation) -> its results, computed early: with an earlier sibling dot, or for one

        def step(eqn, invals, read):
            if id(eqn) in computed:
                return computed.pop(id(eqn))
            if id(eqn) in siblings:
                computed.update(self._rewrite_siblings(siblings[id(eqn)], step, read, eqn_location(eqn, where),
                                                       smoothed))
                if id(eqn) in computed:
                    return computed.pop(id(eqn))
            here = join_scope(scope, eqn.source_info.name_stack)
            reads_tangents = [isinstance(v, Var) and v in tangent_vars for v in eqn.invars] if tangent_vars else ()
            if any(reads_tangents):
                if rule_for(eqn.primitive.name).inline_call and self.rewrites_at(eqn, scope):
                    # a nested call computing primal and tangent together (jax.jvp of a jitted function, a
                    # jitted helper in the rule) is inlined, so that only its tangent matmuls stay float
                    sub, sub_consts = jaxpr_and_consts(eqn.params[SUBJAXPR_PARAMS[eqn.primitive.name][0]])
                    inner = frozenset(v for v, reads in zip(sub.invars, reads_tangents) if reads)
                    outs = self.interpret(sub, sub_consts, invals, here, inner, where)
                    tangent_vars.update(v for v, dependent in zip(eqn.outvars, _tangent_outputs(sub, inner))
                                        if dependent)
                    return outs
                tangent_vars.update(eqn.outvars)
                return bind(eqn, materialised(invals))
            if is_float_dot(eqn):
                if skip_reason(eqn, self.config, here) is None:
                    return [self.rewrite_matmul(eqn, invals, eqn_location(eqn, where), smoothed)]
                return bind(eqn, materialised(invals))
            rule = rule_for(eqn.primitive.name)
            if any(is_quantized(v) for v in invals):
                if rule.quantized is not None:
                    outs = rule.quantized(RuleContext(self, here, eqn_location(eqn, where)), eqn, invals)
                    if outs is not None:
                        return outs
                invals = materialised(invals)
            if not self.rewrites_at(eqn, scope):
                return bind(eqn, invals)
            hidden = hidden_matmuls(eqn)
            if hidden is not None:
                keep = (f"a skip pattern matching its name scope {here!r}" if here
                        else "a skip pattern matching a jax.named_scope around it")
                raise Int8ifyError(f"primitive '{eqn.primitive.name}' at {describe_source(eqn, where)} "
                                   f"{hidden} ({HIDDEN_MATMUL.code}); {HIDDEN_MATMUL.instead}; or keep "
                                   f"it float with {keep}")
            if rule.rewrite is None:
                raise Int8ifyError(
                    f"primitive '{eqn.primitive.name}' at {describe_source(eqn, where)} holds a float matmul in a "
                    "sub-jaxpr, and int8ify has no rule for it; leaving that matmul in float would break the int8 "
                    "contract. Move the matmul out of it, keep it float with skip/skip_if, or report it."
                )
            return bind(eqn, invals, rule.rewrite(RuleContext(self, here, eqn_location(eqn, where)), eqn.params))

        return evaluate(jaxpr, consts, args, step, with_reader=True)

    def _rewrite_siblings(self, group: SiblingGroup, step, read, where: Location, smoothed: dict) -> dict:
        """The results of the sibling dots of ``group`` the backend computes together, and of the equations run
        early for them, ``id(equation) -> its results``; the other dots are rewritten when they are reached."""
        early: dict = {}  # a variable computed early -> its value

        def value(atom):
            return early[atom] if isinstance(atom, Var) and atom in early else read(atom)

        results = {}
        for eqn in group.early:
            with equation_context(eqn):
                outs = step(eqn, [value(v) for v in eqn.invars], read)
            early.update(zip(eqn.outvars, outs))
            results[id(eqn)] = outs
        operands = [[value(v) for v in eqn.invars] for eqn in group.dots]
        with late_inlining(self.config.late_inlining):
            dots = rewrite_sibling_dots(self.config, self.backend, group.dots, operands, where, smoothed)
        return {**results, **{key: [out] for key, out in dots.items()}}

    def _sibling_groups(self, jaxpr: Jaxpr, scope: str, tangents) -> dict:
        """The float matmuls of ``jaxpr`` the backend computes with their siblings, where it can
        (:func:`~jaxpr_rewrite._core.jaxprs.sibling_groups`): rewritten ones, reading no tangent and no calibrated
        static scale of two activations."""
        if self.backend.sibling_dots is None:
            return {}
        tangent_dependent = dependents(jaxpr, tangents) if tangents else set()

        def joins(eqn) -> bool:
            return (is_float_dot(eqn) and may_join_siblings(eqn) and id(eqn) not in self.static_dots
                    and not any(isinstance(v, Var) and v in tangent_dependent for v in eqn.invars)
                    and skip_reason(eqn, self.config, join_scope(scope, eqn.source_info.name_stack)) is None)

        return sibling_groups(jaxpr, joins)

    # -- one matmul ---------------------------------------------------------------------------------------------
    def rewrite_matmul(self, eqn, invals: Sequence, where: Location = UNKNOWN, smoothed: dict | None = None):
        """The rewritten program for one float matmul equation: :func:`~jaxpr_rewrite._interpret.rules.dots.rewrite_dot`
        under this rewriter's options and backend (with its static scales, for a calibrated dot of two
        activations)."""
        calibrated = self.static_dots.get(id(eqn))
        scales = None if calibrated is None else calibrated.scales([v.aval.dtype for v in eqn.invars[:2]])
        with late_inlining(self.config.late_inlining):
            return rewrite_dot(self.config, self.backend, eqn, invals, where, smoothed, scales)


def dependents(jaxpr: Jaxpr, sources) -> set:
    """The variables of ``jaxpr`` computed from its ``sources`` (among them), following a nested call (``jit``) into
    its body output by output, so a value a call only passes through keeps its own dependence; any other equation's
    outputs all depend on any of its inputs."""
    dependent = set(sources)
    for eqn in jaxpr.eqns:
        reads = [isinstance(v, Var) and v in dependent for v in eqn.invars]
        if not any(reads):
            continue
        if rule_for(eqn.primitive.name).inline_call:
            sub = open_jaxpr(eqn.params[SUBJAXPR_PARAMS[eqn.primitive.name][0]])
            inner = dependents(sub, {v for v, read in zip(sub.invars, reads) if read})
            dependent.update(v for v, out in zip(eqn.outvars, sub.outvars) if isinstance(out, Var) and out in inner)
        else:
            dependent.update(eqn.outvars)
    return dependent


def _tangent_outputs(jaxpr: Jaxpr, tangents) -> list[bool]:
    """Per outvar of ``jaxpr``, whether :meth:`Rewriter.interpret` computes it from the ``tangents`` invars."""
    dependent = dependents(jaxpr, tangents)
    return [isinstance(v, Var) and v in dependent for v in jaxpr.outvars]
