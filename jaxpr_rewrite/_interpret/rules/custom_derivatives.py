"""``jax.custom_jvp``, ``jax.custom_vjp`` and ``custom_vmap``: the primal is rewritten, and so is the user's rule
for the forward pass (the jvp rule's primal part, ``fwd``, the batching rule); derivative matmuls stay float.

A pre-quantized weight passed to a custom_jvp or custom_vjp function is carried into its primal, whose dots read
its codes (and static activation scale) as they are, as in any other call: materialised at the boundary, it was
quantized again, to 8 bits with dynamic scales, other numbers than the weight's own. The function is then a
``jax.custom_jvp`` / ``jax.custom_vjp`` of its own whose derivative is the user's rule, applied to the float
operands with the weight at its value inside the dot; no tangent flows into the weight's codes, as for any
pre-quantized weight (:mod:`jaxpr_rewrite._dots.straight_through`).
"""

from __future__ import annotations

import jax
from jax import lax
from jax.extend.core import ClosedJaxpr

from ... import _compat
from ..._quantized.array import is_quantized
from ..evaluate import bind
from .calls import follow_call
from .common import materialised, measure_inline, sub_interpreter
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


def _quantized_custom_jvp(context: RuleContext, eqn, invals):
    """A custom_jvp function with a pre-quantized operand: its primal rewritten with the weight's codes, its
    tangents the user's jvp rule's at the float operands (the weight's dot value, with a zero tangent)."""
    primal = sub_interpreter(context, eqn.params["call_jaxpr"])
    n_consts = eqn.params["num_consts"]

    @jax.custom_jvp
    def call(*values):
        return materialised(primal(list(values)))

    @call.defjvp
    def call_jvp(primals, tangents):
        floats = materialised(primals)
        float_tangents = [_zero_tangent(value) if is_quantized(x) else tangent
                          for x, value, tangent in zip(primals, floats, tangents)]
        _, out_tangents = jax.jvp(lambda *values: bind(eqn, [*floats[:n_consts], *values]), floats[n_consts:],
                                  float_tangents[n_consts:])
        return call(*primals), out_tangents

    return call(*invals)


def _quantized_custom_vjp(context: RuleContext, eqn, invals):
    """A custom_vjp function with a pre-quantized operand: its primal rewritten with the weight's codes, its
    cotangents the user's ``fwd`` and ``bwd`` rules' at the float operands (the weight's dot value), run again in
    the backward pass (the residuals of a ``fwd`` are those of its float operands); the weight's own is zero."""
    primal = sub_interpreter(context, eqn.params["call_jaxpr"])
    n_consts = eqn.params["num_consts"]

    @jax.custom_vjp
    def call(*values):
        return materialised(primal(list(values)))

    def call_fwd(*values):
        return call(*values), materialised(values)

    def call_bwd(floats, cotangents):
        consts = floats[:n_consts]
        _, vjp = jax.vjp(lambda *values: bind(eqn, [*consts, *values]), *floats[n_consts:])
        cts = vjp(list(cotangents))
        return (*(None,) * n_consts, *(None if is_quantized(x) else ct for x, ct in zip(invals[n_consts:], cts)))

    call.defvjp(call_fwd, call_bwd)
    return call(*invals)


def _zero_tangent(value):
    return lax.full_like(value, 0)


def _label_primal_name(params) -> list[str]:
    """The diff names a custom_jvp/custom_vjp function after its primal."""
    func = getattr(getattr(params["call_jaxpr"].jaxpr, "debug_info", None), "func_name", None)
    return [f"name={func}"] if func else []


# the report measures a custom_jvp/custom_vjp through its primal, evaluated inline
# a weight passed to a custom_jvp/custom_vjp function is followed into its primal, where its dots read its codes
register("custom_jvp_call", subjaxprs=("call_jaxpr",), rewrite=_custom_jvp_rule, quantized=_quantized_custom_jvp,
         follow=follow_call, measure=measure_inline, label=_label_primal_name)
register("custom_vjp_call", subjaxprs=("call_jaxpr",), rewrite=_custom_vjp_rule, quantized=_quantized_custom_vjp,
         follow=follow_call, measure=measure_inline, label=_label_primal_name)
register("custom_vmap_call", subjaxprs=("call",), rewrite=_custom_vmap_rule)
