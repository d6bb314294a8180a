"""``jax.checkpoint`` (``remat2``, ``checkpoint``): a call that keeps its boundary and its policy."""

from __future__ import annotations

import jax

from .calls import follow_call
from .common import materialised, measure_inline, sub_interpreter, swap_forward_params
from .registry import RuleContext, register

__all__ = []


def _remat_quantized(context: RuleContext, eqn, invals):
    """``jax.checkpoint`` again (same policy), with the pre-quantized weights passed in."""
    p = eqn.params
    body = sub_interpreter(context, p["jaxpr"])
    run = jax.checkpoint(lambda *values: materialised(body(list(values))), prevent_cse=p["prevent_cse"],
                         policy=p["policy"])
    return list(run(*invals))


for _name in ("remat2", "checkpoint"):
    register(_name, subjaxprs=("jaxpr",), rewrite=swap_forward_params(_name), quantized=_remat_quantized,
             follow=follow_call, measure=measure_inline)
