"""Helpers the rule modules share: the generic higher-order rewrite, sub-jaxpr evaluation, and inline measuring."""

from __future__ import annotations

import jax

from ..._core.jaxprs import DERIVATIVE_ONLY_PARAMS, SUBJAXPR_PARAMS, jaxpr_and_consts, sub_index
from ..._quantized.array import is_quantized, materialise
from .registry import RewriteRule, RuleContext

__all__ = ["carried", "kept_quantized", "materialised", "measure_inline", "sub_interpreter", "swap_forward_params"]


def materialised(values) -> list:
    """``values`` with every pre-quantized weight turned back into its float array."""
    return [materialise(v) for v in values]


def layout(value) -> tuple:
    """A value's layout: its pytree structure (a quantized array's metadata included) and its leaves' shapes and
    dtypes."""
    leaves, structure = jax.tree_util.tree_flatten(value)
    return structure, tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves)


def kept_quantized(values, keep) -> list:
    """``values`` with the quantized ones at the positions ``keep`` marks kept as they are, every other
    materialised."""
    return [v if k and is_quantized(v) else materialise(v) for v, k in zip(values, keep)]


def carried(init: list, step) -> list[bool]:
    """Which loop carries stay quantized: those quantized in ``init`` that ``step(carry) -> new carry`` returns in
    the same layout (a KV cache written into each iteration), found by tracing ``step`` abstractly until no carry
    changes its mind (a carry materialised can make another's output float)."""
    keep = [is_quantized(v) for v in init]
    while any(keep):
        outs = jax.eval_shape(lambda carry: list(step(kept_quantized(carry, keep))), list(init))
        stays = [k and is_quantized(out) and layout(out) == layout(value)
                 for k, out, value in zip(keep, outs, init)]
        if stays == keep:
            break
        keep = stays
    return keep


def swap_forward_params(name: str) -> RewriteRule:
    """The generic rewrite: copy the params and swap the forward sub-jaxprs listed for ``name`` in
    :data:`~jaxpr_rewrite._core.jaxprs.SUBJAXPR_PARAMS`; derivative-only ones stay as they are.

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
