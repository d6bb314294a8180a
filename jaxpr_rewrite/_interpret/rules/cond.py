"""``lax.cond``/``lax.switch``: every branch rewritten in place; pre-quantized operands passed to each branch; the
report measures the branch taken."""

from __future__ import annotations

from jax import lax

from ..error_sums import add, zeros
from ..._core.jaxprs import open_jaxpr, sub_index
from ..._quantized.array import materialise
from .common import materialised, sub_interpreter, swap_forward_params
from .registry import RuleContext, register

__all__ = []


def _cond_quantized(context: RuleContext, eqn, invals):
    """``lax.switch`` again, each branch reading the pre-quantized operands."""
    index, *operands = invals
    branches = [sub_interpreter(context, branch) for branch in eqn.params["branches"]]
    fns = [lambda ops, b=b: materialised(b(list(ops))) for b in branches]
    return list(lax.switch(materialise(index), fns, operands))


def _follow_cond(trail, eqn, positions, where):
    """A weight passed to the branches is followed into every branch (operand ``k`` is branch input ``k - 1``,
    after the index); a weight used as the index is not followed."""
    if 0 in positions:
        return None
    branches = [open_jaxpr(branch) for branch in eqn.params["branches"]]
    return [use for sub in branches for k in positions for use in trail.follow(sub, sub.invars[k - 1], nested=True)]


def _measure_cond(measurer, eqn, invals, path):
    """``lax.switch`` over the branches, each measuring its matmuls (the others' sums stay zero)."""
    index, *operands = invals
    every = measurer.paths_under(path)

    def branch_fn(branch):
        def fn(ops):
            outs, stats = measurer.run(branch, list(ops), path + (sub_index(eqn, branch),))
            return outs, add(zeros(every), stats)
        return fn

    outs, stats = lax.switch(index, [branch_fn(b) for b in eqn.params["branches"]], operands)
    return list(outs), stats


register("cond", subjaxprs=("branches",), rewrite=swap_forward_params("cond"), quantized=_cond_quantized,
         follow=_follow_cond, measure=_measure_cond, branches=True)
