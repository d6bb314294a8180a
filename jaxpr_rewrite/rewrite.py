"""The jaxpr -> jaxpr rewrite: an interpreter that re-traces a jaxpr with every float dot replaced.

Like JAX's own interpreters (``batching.py``, ``ad.py``) this is one registry of per-primitive rules:

* ``dot_general`` goes to :func:`rewrite_dot` (the int8 contract, :mod:`jaxpr_rewrite.int8_dot`);
* each higher-order primitive (``jit``, ``scan``, ``cond``, ...) has a rule in :data:`higher_order_rules`
  that receives the equation's params and returns a copy in which only the sub-jaxprs are swapped for
  their rewritten versions, so donation, shardings, names and remat policies survive untouched;
* every other equation is bound again as it is.

A higher-order primitive without a rule is an error when its sub-jaxprs hold a float dot: a dot is never
left in float silently.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax.extend  # noqa: F401  (makes jax.extend.core importable)
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var, jaxprs_in_params

from . import _compat
from .errors import Int8ifyError, describe_operands, describe_source
from .int8_dot import int8_dot_general


@dataclasses.dataclass(frozen=True)
class RewriteConfig:
    """What the rewrite does; part of the cache key of every rewritten program. No options yet."""


def _is_float(dtype) -> bool:
    # jnp.issubdtype knows the ml_dtypes floats (bfloat16, float8_*); np.issubdtype does not.
    return jnp.issubdtype(dtype, jnp.floating)


def is_float_dot(eqn) -> bool:
    """Whether ``eqn`` is a ``dot_general`` with a floating operand (the ones the rewrite replaces)."""
    return eqn.primitive is lax.dot_general_p and any(_is_float(v.aval.dtype) for v in eqn.invars)


def _bind(primitive, invals, params):
    out = primitive.bind(*invals, **primitive.get_bind_params(params))
    return out if primitive.multiple_results else [out]


def _equation_context(eqn):
    """New equations inherit ``eqn``'s source line, name scope and context, as in ``jax.core.eval_jaxpr``."""
    import contextlib

    stack = contextlib.ExitStack()
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    stack.enter_context(source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack))
    stack.enter_context(eqn.ctx.manager)
    return stack


class Rewriter:
    """Rewrites jaxprs under one :class:`RewriteConfig`, sharing the work between identical sub-jaxprs.

    A jitted function called from many places yields the same sub-jaxpr object each time; it is rewritten
    once, and the rewritten equations keep sharing one jaxpr, as the originals did.
    """

    def __init__(self, config: RewriteConfig):
        self.config = config
        self._rewritten: dict[int, tuple[object, object]] = {}
        self._has_float_dot: dict[int, tuple[object, bool]] = {}

    # -- analysis ---------------------------------------------------------------------------------------
    def has_float_dot(self, jaxpr: Jaxpr) -> bool:
        """Whether ``jaxpr`` or any jaxpr nested in it holds a float ``dot_general``."""
        cached = self._has_float_dot.get(id(jaxpr))
        if cached is not None and cached[0] is jaxpr:
            return cached[1]
        found = any(
            is_float_dot(eqn) or any(self.has_float_dot(sub) for sub in jaxprs_in_params(eqn.params))
            for eqn in jaxpr.eqns
        )
        self._has_float_dot[id(jaxpr)] = (jaxpr, found)
        return found

    def needs_rewrite(self, eqn) -> bool:
        return is_float_dot(eqn) or any(self.has_float_dot(sub) for sub in jaxprs_in_params(eqn.params))

    # -- jaxpr -> jaxpr ---------------------------------------------------------------------------------
    def closed(self, closed_jaxpr: ClosedJaxpr, *, keep_float_from: int | None = None, context=None) -> ClosedJaxpr:
        """Rewrite a closed jaxpr; returns it unchanged (the same object) when it holds no float dot.

        Arguments:
            closed_jaxpr: the jaxpr to rewrite.
            keep_float_from: inputs from this index on are tangents: dots that depend on them stay float
                (used for custom_jvp rules, whose tangent dots form the backward pass).
            context: a context manager to trace under (a shard_map body's axis environment).

        Returns:
            A ``ClosedJaxpr`` with the same input and output types.
        """
        jaxpr = closed_jaxpr.jaxpr
        if not self.has_float_dot(jaxpr):
            return closed_jaxpr
        key = id(closed_jaxpr)
        cached = self._rewritten.get(key)
        if cached is not None and cached[0] is closed_jaxpr and keep_float_from is None:
            return cached[1]
        tangents = frozenset(jaxpr.invars[keep_float_from:]) if keep_float_from is not None else frozenset()
        consts = closed_jaxpr.consts

        def interpret(*args):
            return self.interpret(jaxpr, consts, args, tangents)

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

    def open(self, jaxpr: Jaxpr, *, context=None) -> Jaxpr:
        """Rewrite an open jaxpr (``remat``, ``shard_map`` bodies), which cannot gain constants."""
        if not self.has_float_dot(jaxpr):
            return jaxpr
        result = self.closed(ClosedJaxpr(jaxpr, []), context=context)
        if result.consts:
            raise Int8ifyError(
                "the rewritten body of a primitive that takes an open jaxpr captured constants "
                f"({[np.shape(c) for c in result.consts]}); please report this program"
            )
        return result.jaxpr

    def swap(self, value, *, context=None):
        """Rewrite a param value that is a jaxpr, a closed jaxpr, or a tuple of them; keep its type."""
        if isinstance(value, ClosedJaxpr):
            return self.closed(value, context=context)
        if isinstance(value, Jaxpr):
            return self.open(value, context=context)
        if isinstance(value, tuple):
            return tuple(self.swap(v, context=context) for v in value)
        return value

    # -- evaluation -------------------------------------------------------------------------------------
    def interpret(self, jaxpr: Jaxpr, consts: Sequence, args: Sequence, tangents=frozenset()) -> list:
        """Evaluate ``jaxpr`` under the current trace, emitting the rewritten program.

        Arguments:
            jaxpr: the program.
            consts: values of its constvars.
            args: values of its invars.
            tangents: invars holding tangents; every value computed from them keeps its float dots.

        Returns:
            The values of its outvars.
        """
        env: dict = {}
        tangent_vars = set(tangents)

        def read(atom):
            return atom.val if isinstance(atom, Literal) else env[atom]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            on_tangent = bool(tangent_vars) and any(isinstance(v, Var) and v in tangent_vars for v in eqn.invars)
            with _equation_context(eqn):
                if on_tangent or not self.needs_rewrite(eqn):
                    outs = _bind(eqn.primitive, invals, eqn.params)
                elif eqn.primitive is lax.dot_general_p:
                    outs = [rewrite_dot(eqn, invals, self)]
                else:
                    rule = higher_order_rules.get(eqn.primitive.name)
                    if rule is None:
                        raise Int8ifyError(
                            f"primitive '{eqn.primitive.name}' at {describe_source(eqn)} holds a float "
                            "dot_general in a sub-jaxpr, and int8ify has no rule for it; leaving that dot in "
                            "float would break the int8 contract. Move the matmul out of it, or report it."
                        )
                    outs = _bind(eqn.primitive, invals, rule(self, eqn.params))
            if on_tangent:
                tangent_vars.update(eqn.outvars)
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]


def rewrite_dot(eqn, invals, rewriter: Rewriter):
    """The rule for one float ``dot_general`` equation: the int8 contract with a straight-through gradient."""
    lhs, rhs = invals
    for v in eqn.invars:
        if jnp.issubdtype(v.aval.dtype, jnp.complexfloating):
            raise Int8ifyError(
                f"dot_general at {describe_source(eqn)} has complex operands ({describe_operands(eqn)}); "
                "the int8 contract is defined for real floating dots only"
            )
    lhs = lhs if _is_float(eqn.invars[0].aval.dtype) else lax.convert_element_type(lhs, np.float32)
    rhs = rhs if _is_float(eqn.invars[1].aval.dtype) else lax.convert_element_type(rhs, np.float32)
    float_params = tuple(sorted(eqn.params.items()))
    return int8_dot_general(lhs, rhs, float_params, eqn.outvars[0].aval.dtype)


# -- higher-order primitives ------------------------------------------------------------------------------
HigherOrderRule = Callable[[Rewriter, dict], dict]
higher_order_rules: dict[str, HigherOrderRule] = {}


def swap_params(*names: str) -> HigherOrderRule:
    """A rule that copies the params and swaps the jaxprs found under ``names`` for rewritten ones."""

    def rule(rewriter: Rewriter, params: dict) -> dict:
        new_params = dict(params)
        for name in names:
            new_params[name] = rewriter.swap(params[name])
        return new_params

    return rule


higher_order_rules["jit"] = swap_params("jaxpr")
higher_order_rules["pjit"] = swap_params("jaxpr")
higher_order_rules["closed_call"] = swap_params("call_jaxpr")
higher_order_rules["core_call"] = swap_params("call_jaxpr")
higher_order_rules["remat2"] = swap_params("jaxpr")
higher_order_rules["checkpoint"] = swap_params("jaxpr")
higher_order_rules["scan"] = swap_params("jaxpr")
higher_order_rules["while"] = swap_params("cond_jaxpr", "body_jaxpr")
higher_order_rules["cond"] = swap_params("branches")


def _shard_map_rule(rewriter: Rewriter, params: dict) -> dict:
    new_params = dict(params)
    new_params["jaxpr"] = rewriter.swap(params["jaxpr"], context=_compat.shard_map_body_context(params))
    return new_params


higher_order_rules["shard_map"] = _shard_map_rule


def _custom_jvp_rule(rewriter: Rewriter, params: dict) -> dict:
    """Rewrite the primal, and the primal part of the user's jvp rule; its tangent dots stay float.

    Under differentiation JAX takes the primal output from the jvp rule, so rewriting only ``call_jaxpr``
    would make ``grad`` run the float forward pass. The jvp rule is wrapped lazily (at differentiation
    time), which also keeps a rule that calls its own primal from recursing.
    """
    new_params = dict(params)
    call_jaxpr = params["call_jaxpr"]
    new_params["call_jaxpr"] = rewriter.closed(call_jaxpr)
    n_primals = len(call_jaxpr.in_avals) - params["num_consts"]

    def rewrite_jvp(result):
        jvp_jaxpr, jvp_consts, *rest = result
        new = rewriter.closed(ClosedJaxpr(jvp_jaxpr, jvp_consts), keep_float_from=n_primals)
        return (new.jaxpr, new.consts, *rest)

    new_params["jvp_jaxpr_fun"] = _compat.wrap_jaxpr_thunk(params["jvp_jaxpr_fun"], rewrite_jvp)
    return new_params


higher_order_rules["custom_jvp_call"] = _custom_jvp_rule


def _custom_vjp_rule(rewriter: Rewriter, params: dict) -> dict:
    """Rewrite the primal and the user's ``fwd`` (the forward pass under ``grad``); ``bwd`` stays as written."""
    new_params = dict(params)
    new_params["call_jaxpr"] = rewriter.closed(params["call_jaxpr"])

    def rewrite_fwd(result):
        fwd_jaxpr, fwd_consts, *rest = result
        new = rewriter.closed(ClosedJaxpr(fwd_jaxpr, fwd_consts))
        return (new.jaxpr, new.consts, *rest)

    new_params["fwd_jaxpr_thunk"] = _compat.wrap_jaxpr_thunk(params["fwd_jaxpr_thunk"], rewrite_fwd)
    return new_params


higher_order_rules["custom_vjp_call"] = _custom_vjp_rule
