"""The registry of per-primitive rules: everything int8ify knows about one primitive, in one entry.

Like JAX's ``batching.py`` (one dict per transform) but with the transforms side by side: a :class:`PrimitiveRule` holds
how an equation of the primitive is rewritten, how a pre-quantized weight passes through it, how
:func:`~jaxpr_rewrite.quantize_params` follows a weight into it, and how the report measures the matmuls inside it. Each
primitive family registers its entry from its own module of :mod:`jaxpr_rewrite._interpret.rules`; registering a
primitive twice is an error, so no rule is silently replaced.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..._core.errors import Int8ifyError
from ..._core.jaxprs import BRANCH_PARAMS, DERIVATIVE_ONLY_PARAMS, HIDDEN_MATMULS, SUBJAXPR_PARAMS
from ..._core.source import UNKNOWN, Location

__all__ = ["PrimitiveRule", "RuleContext", "RULES", "register", "rule_for"]


@dataclasses.dataclass(frozen=True)
class RuleContext:
    """Where a rule runs: the rewriter, and the equation's name scope and user source.

    Attributes:
        rewriter: the :class:`~jaxpr_rewrite._interpret.rewrite.Rewriter` rewriting the program.
        scope: the equation's full name scope (enclosing scopes included).
        where: the user's source of the equation (or of the enclosing one, when JAX recorded none).
    """

    rewriter: Any
    scope: str = ""
    where: Location = UNKNOWN

    def swap(self, value, *, keep=(), context=None):
        """``value`` (a jaxpr, closed jaxpr, or tuple of them) rewritten in this scope; see ``Rewriter.swap``."""
        return self.rewriter.swap(value, self.scope, context=context, where=self.where, keep=keep)

    def closed(self, closed_jaxpr, *, keep_float_from: int | None = None):
        """A closed jaxpr rewritten in this scope; inputs from ``keep_float_from`` on are tangents."""
        return self.rewriter.closed(closed_jaxpr, self.scope, keep_float_from=keep_float_from, where=self.where)

    def interpret(self, jaxpr, consts, args) -> list:
        """``jaxpr`` evaluated through the rewriter under the current trace (its outputs may stay quantized)."""
        return self.rewriter.interpret(jaxpr, consts, args, self.scope, where=self.where)


RewriteRule = Callable[[RuleContext, dict], dict]
"""``rewrite(context, params) -> new params``: a higher-order equation's params with its sub-jaxprs swapped for
rewritten ones, everything else (donation, shardings, names, remat policies) untouched."""

QuantizedRule = Callable[[RuleContext, Any, list], "list | None"]
"""``quantized(context, eqn, invals) -> outvals`` for an equation with a pre-quantized operand, or ``None`` to have
the operands materialised instead."""

FollowRule = Callable[[Any, Any, list, str], "list | None"]
"""``follow(trail, eqn, positions, where) -> uses``: the matmul uses of a parameter that ``eqn`` reads at operand
``positions`` (``where``: the equation's source), found through ``trail.follow``/``trail.refuse`` (see
:mod:`jaxpr_rewrite._ptq.params`); ``None`` when the weight cannot be followed through ``eqn``."""

LabelRule = Callable[[dict], "list[str]"]
"""``label(params) -> parts``: the params the command line's side-by-side diff shows for an equation
(``["length=3"]``)."""

MeasureRule = Callable[[Any, Any, list, tuple], "tuple[list, dict]"]
"""``measure(measurer, eqn, invals, path) -> (outvals, sums)``: ``eqn`` evaluated in float with the matmuls inside
it measured (see :mod:`jaxpr_rewrite._inspect.report`); ``path`` is the equation's position in the program."""

HidesRule = Callable[[Any], "str | None"]
"""``hides(eqn) -> what it is, or None``: whether an equation computes float matmuls out of the jaxpr's reach."""


@dataclasses.dataclass(frozen=True)
class PrimitiveRule:
    """What int8ify does with one primitive; a missing field means "not supported" for that transform.

    Attributes:
        rewrite: how an equation holding a float matmul in a sub-jaxpr is rewritten (none: such an equation is
            an error, a matmul is never left in float silently).
        quantized: how a pre-quantized weight passes through (none: it is materialised first).
        follow: how ``quantize_params`` follows a weight into the primitive (none: the weight stays float).
        measure: how the report measures the matmuls inside (none: they get a ``n/a (inside ...)`` note).
        inline_call: a call that takes its operands one to one and that XLA inlines anyway, so the rewrite may
            evaluate it inline (to keep only the tangent matmuls of a jvp float); a remat keeps its boundary.
        branches: it runs one of its sub-jaxprs, the one its first operand picks, so a matmul the report did not see
            run was in a branch not taken (recorded in :data:`~jaxpr_rewrite._core.jaxprs.BRANCH_PARAMS`, which
            :func:`~jaxpr_rewrite._core.jaxprs.iter_eqns` reads to follow a platform's branch).
        label: what the command line's diff shows of an equation's params (none: its ``axes`` or ``name``).
        hides_matmuls: for a primitive that can compute float matmuls inside a library call, where no jaxpr
            rewrite reaches them: ``hides(eqn)``, what the equation is (a clause) when it computes some, else
            ``None`` (recorded in :data:`~jaxpr_rewrite._core.jaxprs.HIDDEN_MATMULS`). Such an equation is an error
            (JX105) unless a ``skip`` pattern matches its name scope.
    """

    rewrite: RewriteRule | None = None
    quantized: QuantizedRule | None = None
    follow: FollowRule | None = None
    measure: MeasureRule | None = None
    inline_call: bool = False
    branches: bool = False
    label: LabelRule | None = None
    hides_matmuls: HidesRule | None = None


RULES: dict[str, PrimitiveRule] = {}
"""Primitive name -> its :class:`PrimitiveRule`."""

_NO_RULE = PrimitiveRule()


def register(*names: str, subjaxprs: tuple[str, ...] = (), derivative_only: tuple[str, ...] = (),
             rewrite: RewriteRule | None = None, quantized: QuantizedRule | None = None,
             follow: FollowRule | None = None, measure: MeasureRule | None = None,
             inline_call: bool = False, branches: bool = False, label: LabelRule | None = None,
             hides_matmuls: HidesRule | None = None) -> PrimitiveRule:
    """Register one :class:`PrimitiveRule` for the primitives ``names``.

    Arguments:
        names: primitive names (``eqn.primitive.name``).
        subjaxprs: the params holding the primitive's sub-jaxprs that run in the forward pass, recorded in
            :data:`~jaxpr_rewrite._core.jaxprs.SUBJAXPR_PARAMS` for every walker of programs.
        derivative_only: fields of those params that only define derivatives (their matmuls stay float),
            recorded in :data:`~jaxpr_rewrite._core.jaxprs.DERIVATIVE_ONLY_PARAMS`.
        rewrite, quantized, follow, measure, inline_call, branches, label, hides_matmuls: the rule's fields (see
            :class:`PrimitiveRule`).

    Returns:
        The registered rule.

    Raises:
        Int8ifyError: a primitive already has a rule.
    """
    rule = PrimitiveRule(rewrite, quantized, follow, measure, inline_call, branches, label, hides_matmuls)
    taken = sorted(name for name in names if name in RULES)
    if taken:
        raise Int8ifyError(f"primitive(s) {taken} already have a rule; a primitive is registered once")
    for name in names:
        RULES[name] = rule
        if subjaxprs:
            SUBJAXPR_PARAMS[name] = subjaxprs
        if derivative_only:
            DERIVATIVE_ONLY_PARAMS[name] = derivative_only
        if branches:
            BRANCH_PARAMS[name] = subjaxprs
        if hides_matmuls:
            HIDDEN_MATMULS[name] = hides_matmuls
    return rule


def rule_for(name: str) -> PrimitiveRule:
    """The rule registered for primitive ``name``, or an empty one (every field ``None``)."""
    return RULES.get(name, _NO_RULE)
