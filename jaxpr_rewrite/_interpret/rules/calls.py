"""Calls: ``jit``/``pjit``, ``closed_call``, ``core_call`` -- one sub-jaxpr taking the operands one to one."""

from __future__ import annotations

from ..._core.jaxprs import SUBJAXPR_PARAMS, open_jaxpr
from .common import measure_inline, sub_interpreter, swap_forward_params
from .registry import RuleContext, register

__all__ = ["CALLS", "follow_call"]

# call primitive -> its one sub-jaxpr param
CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}


def _inline_quantized(context: RuleContext, eqn, invals):
    """A nested call reading a pre-quantized weight is evaluated inline (XLA inlines it anyway)."""
    (param,) = SUBJAXPR_PARAMS[eqn.primitive.name]
    return sub_interpreter(context, eqn.params[param])(invals)


def follow_call(trail, eqn, positions, where):
    """A weight passed to a call is followed into the call's jaxpr (remat's too)."""
    (param,) = SUBJAXPR_PARAMS[eqn.primitive.name]
    sub = open_jaxpr(eqn.params[param])
    return [use for k in positions for use in trail.follow(sub, sub.invars[k], nested=True)]


for _name, _param in CALLS.items():
    register(_name, subjaxprs=(_param,), rewrite=swap_forward_params(_name), quantized=_inline_quantized,
             follow=follow_call, measure=measure_inline, inline_call=True)
