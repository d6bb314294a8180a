"""Helpers the rule modules share: the generic higher-order rewrite, sub-jaxpr evaluation, and inline measuring."""

from __future__ import annotations

from ..jaxprs import DERIVATIVE_ONLY_PARAMS, SUBJAXPR_PARAMS, jaxpr_and_consts, sub_index
from ..quantized import materialise
from .registry import RewriteRule, RuleContext

__all__ = ["materialised", "measure_inline", "sub_interpreter", "swap_forward_params"]


def materialised(values) -> list:
    """``values`` with every pre-quantized weight turned back into its float array."""
    return [materialise(v) for v in values]


def swap_forward_params(name: str) -> RewriteRule:
    """The generic rewrite: copy the params and swap the forward sub-jaxprs listed for ``name`` in
    :data:`~jaxpr_rewrite.jaxprs.SUBJAXPR_PARAMS`; derivative-only ones stay as they are.

    Arguments:
        name: the primitive's name.

    Returns:
        The rewrite rule.
    """
    keep = DERIVATIVE_ONLY_PARAMS.get(name, ())

    def rewrite(context: RuleContext, params: dict) -> dict:
        new_params = dict(params)
        for param in SUBJAXPR_PARAMS[name]:
            new_params[param] = context.swap(params[param], keep=keep)
        return new_params

    return rewrite


def sub_interpreter(context: RuleContext, closed):
    """A function evaluating a (closed) sub-jaxpr through the rewriter on a flat list of values."""
    jaxpr, consts = jaxpr_and_consts(closed)
    return lambda values: context.interpret(jaxpr, consts, values)


def measure_inline(measurer, eqn, invals, path):
    """Measure the matmuls of an equation evaluated as its one forward sub-jaxpr (a call, a custom derivative's
    primal): that sub-jaxpr run inline on the equation's operands."""
    sub = eqn.params[SUBJAXPR_PARAMS[eqn.primitive.name][0]]
    return measurer.run(sub, invals, path + (sub_index(eqn, sub),))
