"""``lax.while_loop``: cond and body rewritten in place; pre-quantized consts closed over (decode loops reading the
weights) and a quantized carry kept quantized (an int8 KV cache); the report sums a body matmul's error over every
iteration in the carry."""

from __future__ import annotations

from jax import lax

from ..error_sums import add, zeros
from ..evaluate import evaluate
from ..._core.jaxprs import open_jaxpr, sub_index, while_operands
from ..._quantized.array import materialise
from .common import carried, kept_quantized, sub_interpreter, swap_forward_params
from .registry import RuleContext, register

__all__ = []


def _while_quantized(context: RuleContext, eqn, invals):
    """``lax.while_loop`` again, with pre-quantized consts closed over, and a quantized carry that the body returns
    in its layout (a KV cache written into each decode step) carried quantized."""
    p = eqn.params
    cond_consts, body_consts, init = while_operands(p, invals)
    cond = sub_interpreter(context, p["cond_jaxpr"])
    body = sub_interpreter(context, p["body_jaxpr"])
    keep = carried(init, lambda carry: body([*body_consts, *carry]))
    out = lax.while_loop(
        lambda carry: materialise(cond([*cond_consts, *carry])[0]),
        lambda carry: kept_quantized(body([*body_consts, *carry]), keep),
        kept_quantized(init, keep),
    )
    return list(out)


def _follow_while(trail, eqn, positions, where):
    """A weight that is a const of the cond or the body is followed into it; a carried one stays float."""
    p = eqn.params
    found = []
    for k in positions:
        if k < p["cond_nconsts"]:
            sub, index = open_jaxpr(p["cond_jaxpr"]), k
        elif k < p["cond_nconsts"] + p["body_nconsts"]:
            sub, index = open_jaxpr(p["body_jaxpr"]), k - p["cond_nconsts"]
        else:
            trail.refuse(f"it is carried through the while_loop at {where}", eqn)
            continue
        found += trail.follow(sub, sub.invars[index], nested=True)
    return found


def _measure_while(measurer, eqn, invals, path):
    """The body run by ``lax.while_loop`` with the measured sums accumulated in the carry."""
    p = eqn.params
    cond_consts, body_consts, init = while_operands(p, invals)
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    sub = path + (sub_index(eqn, body),)

    def keep_going(state):
        return evaluate(cond.jaxpr, cond.consts, [*cond_consts, *state[0]])[0]

    def step(state):
        carry, acc = state
        outs, stats = measurer.run(body, [*body_consts, *carry], sub)
        return outs, add(acc, stats)

    carry, acc = lax.while_loop(keep_going, step, (init, zeros(measurer.paths_under(sub))))
    return list(carry), acc


register("while", subjaxprs=("cond_jaxpr", "body_jaxpr"), rewrite=swap_forward_params("while"),
         quantized=_while_quantized, follow=_follow_while, measure=_measure_while)
