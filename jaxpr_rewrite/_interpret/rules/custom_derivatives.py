"""``jax.custom_jvp``, ``jax.custom_vjp`` and ``custom_vmap``: the primal is rewritten, and so is the user's rule
for the forward pass (the jvp rule's primal part, ``fwd``, the batching rule); derivative matmuls stay float."""

from __future__ import annotations

import jax
from jax.extend.core import ClosedJaxpr

from ... import _compat
from .common import materialised, measure_inline
from .registry import RuleContext, register

__all__ = []


def _custom_jvp_rule(context: RuleContext, params: dict) -> dict:
    """Rewrite the primal, and the primal part of the user's jvp rule; its tangent matmuls stay float.

    Under differentiation JAX takes the primal output from the jvp rule, so rewriting only ``call_jaxpr`` would
    make ``grad`` run the float forward pass. The jvp rule is wrapped lazily (at differentiation time), which
    also keeps a rule that calls its own primal from recursing.
    """
    new_params = dict(params)
    call_jaxpr = params["call_jaxpr"]
    new_params["call_jaxpr"] = context.closed(call_jaxpr)
    n_primals = len(call_jaxpr.in_avals) - params["num_consts"]

    def rewrite_jvp(result):
        jvp_jaxpr, jvp_consts, *rest = result
        new = context.closed(ClosedJaxpr(jvp_jaxpr, jvp_consts), keep_float_from=n_primals)
        return (new.jaxpr, new.consts, *rest)

    new_params["jvp_jaxpr_fun"] = _compat.wrap_jaxpr_thunk(params["jvp_jaxpr_fun"], rewrite_jvp)
    return new_params


def _custom_vjp_rule(context: RuleContext, params: dict) -> dict:
    """Rewrite the primal and the user's ``fwd`` (the forward pass under ``grad``); ``bwd`` stays as written."""
    new_params = dict(params)
    new_params["call_jaxpr"] = context.closed(params["call_jaxpr"])

    def rewrite_fwd(result):
        fwd_jaxpr, fwd_consts, *rest = result
        new = context.closed(ClosedJaxpr(fwd_jaxpr, fwd_consts))
        return (new.jaxpr, new.consts, *rest)

    new_params["fwd_jaxpr_thunk"] = _compat.wrap_jaxpr_thunk(params["fwd_jaxpr_thunk"], rewrite_fwd)
    return new_params


def _custom_vmap_rule(context: RuleContext, params: dict) -> dict:
    """Rewrite the primal, and the user's batching rule when ``vmap`` calls it: the rule is Python code run at
    batching time, so it is traced there and its matmuls rewritten, as for a custom_jvp rule."""
    new_params = dict(params)
    new_params["call"] = context.closed(params["call"])
    rule = params["rule"]

    def rewritten_rule(axis_size, in_batched, *args):
        leaves, args_tree = jax.tree_util.tree_flatten(args)
        results = []

        def flat_rule(*flat):
            out, out_batched = rule(axis_size, in_batched, *jax.tree_util.tree_unflatten(args_tree, flat))
            out_leaves, out_tree = jax.tree_util.tree_flatten(out)
            results.append((out_tree, out_batched))
            return out_leaves

        traced = jax.make_jaxpr(flat_rule)(*leaves)
        outs = context.interpret(traced.jaxpr, traced.consts, leaves)
        out_tree, out_batched = results[-1]
        return jax.tree_util.tree_unflatten(out_tree, materialised(outs)), out_batched

    new_params["rule"] = rewritten_rule
    return new_params


def _label_primal_name(params) -> list[str]:
    """The diff names a custom_jvp/custom_vjp function after its primal."""
    func = getattr(getattr(params["call_jaxpr"].jaxpr, "debug_info", None), "func_name", None)
    return [f"name={func}"] if func else []


# the report measures a custom_jvp/custom_vjp through its primal, evaluated inline
register("custom_jvp_call", subjaxprs=("call_jaxpr",), rewrite=_custom_jvp_rule, measure=measure_inline,
         label=_label_primal_name)
register("custom_vjp_call", subjaxprs=("call_jaxpr",), rewrite=_custom_vjp_rule, measure=measure_inline,
         label=_label_primal_name)
register("custom_vmap_call", subjaxprs=("call",), rewrite=_custom_vmap_rule)
