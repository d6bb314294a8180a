"""The jaxpr -> jaxpr rewrite: an interpreter that re-traces a jaxpr with every float matmul replaced.

Like JAX's own interpreters (``batching.py``, ``ad.py``) it looks each equation's primitive up in one registry of
per-primitive rules (:mod:`jaxpr_rewrite.rules`), calls the rule, or falls back:

* ``dot_general`` / ``ragged_dot_general`` go to :meth:`Rewriter.rewrite_matmul` (the configured backend, the int8
  contract by default);
* a higher-order primitive (``jit``, ``scan``, ``cond``, ...) goes to its rule's ``rewrite``, which returns the
  equation's params with only the sub-jaxprs swapped for their rewritten versions, so donation, shardings, names
  and remat policies survive untouched;
* a pre-quantized weight (:class:`~jaxpr_rewrite.quantized.QuantizedArray`) goes to its reader's ``quantized`` rule
  (``scan``, ``while_loop``, ``cond``, a nested ``jit``, a cast, a transpose carry it inside with JAX's public API,
  so the loop body's dot uses the codes); anywhere else it is materialised;
* every other equation is bound again as it is.

A higher-order primitive without a rule is an error when its sub-jaxprs hold a float matmul that the options do
not skip: a matmul is never left in float silently.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.extend  # noqa: F401  (makes jax.extend.core importable)
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Var

from . import _compat
from .config import RewriteConfig, join_scope, skip_reason
from .errors import Int8ifyError
from .evaluate import bind, evaluate
from .int8_dot import supports_ragged
from .jaxprs import (SUBJAXPR_PARAMS, forward_jaxprs, is_float_dot, jaxpr_and_consts, matmul_dimension_numbers,
                     open_jaxpr)
from .quantized import is_quantized, resolve_dot_operands
from .rules import RuleContext, rule_for
from .rules.common import materialised
from .source import UNKNOWN, Location, describe_source, eqn_location

__all__ = ["Rewriter"]


def _is_float_dtype(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


class Rewriter:
    """Rewrites jaxprs under one :class:`RewriteConfig`, sharing the work between identical sub-jaxprs.

    A jitted function called from many places yields the same sub-jaxpr object each time; it is rewritten once,
    and the rewritten equations keep sharing one jaxpr, as the originals did. A rewriter holds no state that
    depends on where it is in a program (the name scope travels as an argument), so the lazy custom_jvp/vjp
    rules it creates can run concurrently.
    """

    def __init__(self, config: RewriteConfig, on_dot: Callable | None = None):
        """
        Arguments:
            config: the rewrite options.
            on_dot: called as ``on_dot(eqn, scope, reason)`` for every float matmul met, ``reason`` being
                ``None`` for a rewritten one and why it stays float otherwise (the report builds on it).
        """
        self.config = config
        self.backend = config.dot_backend
        self.on_dot = on_dot
        self._rewritten: dict = {}
        self._rewrites: dict = {}

    # -- analysis ---------------------------------------------------------------------------------------------
    def rewrites_in(self, jaxpr, scope: str) -> bool:
        """Whether ``jaxpr`` (nested jaxprs included) holds a float matmul that the options rewrite."""
        jaxpr = open_jaxpr(jaxpr)
        key = (id(jaxpr), scope)
        cached = self._rewrites.get(key)
        if cached is not None and cached[0] is jaxpr:
            return cached[1]
        found = any(self.rewrites_at(eqn, scope) for eqn in jaxpr.eqns)
        self._rewrites[key] = (jaxpr, found)
        return found

    def rewrites_at(self, eqn, scope: str) -> bool:
        """Whether ``eqn`` is, or holds in a forward sub-jaxpr, a float matmul that the options rewrite."""
        here = join_scope(scope, eqn.source_info.name_stack)
        if is_float_dot(eqn):
            return skip_reason(eqn, self.config, here) is None
        return any(self.rewrites_in(sub, here) for sub in forward_jaxprs(eqn))

    # -- jaxpr -> jaxpr ---------------------------------------------------------------------------------------
    def closed(self, closed_jaxpr: ClosedJaxpr, scope: str = "", *, keep_float_from: int | None = None,
               context=None, where: Location = UNKNOWN) -> ClosedJaxpr:
        """Rewrite a closed jaxpr; returns it unchanged (the same object) when it holds nothing to rewrite.

        Arguments:
            closed_jaxpr: the jaxpr to rewrite.
            scope: the name scope it runs in.
            keep_float_from: inputs from this index on are tangents: matmuls that depend on them stay float
                (used for custom_jvp rules, whose tangent matmuls form the backward pass).
            context: a context manager to trace under (a shard_map body's axis environment).
            where: the user's source of the enclosing equation, for equations JAX recorded none for.

        Returns:
            A ``ClosedJaxpr`` with the same input and output types.
        """
        jaxpr = closed_jaxpr.jaxpr
        if not self.rewrites_in(jaxpr, scope):
            return closed_jaxpr
        key = (id(closed_jaxpr), scope)
        cached = self._rewritten.get(key)
        if cached is not None and cached[0] is closed_jaxpr and keep_float_from is None:
            return cached[1]
        tangents = frozenset(jaxpr.invars[keep_float_from:]) if keep_float_from is not None else frozenset()
        consts = closed_jaxpr.consts

        def interpret(*args):
            return materialised(self.interpret(jaxpr, consts, args, scope, tangents, where))

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

    def open(self, jaxpr: Jaxpr, scope: str = "", *, context=None, where: Location = UNKNOWN) -> Jaxpr:
        """Rewrite an open jaxpr (``remat``, ``shard_map`` bodies), which cannot gain constants."""
        if not self.rewrites_in(jaxpr, scope):
            return jaxpr
        result = self.closed(ClosedJaxpr(jaxpr, []), scope, context=context, where=where)
        if result.consts:
            raise Int8ifyError(
                "the rewritten body of a primitive that takes an open jaxpr captured constants "
                f"({[np.shape(c) for c in result.consts]}); please report this program"
            )
        return result.jaxpr

    def swap(self, value, scope: str, *, context=None, where: Location = UNKNOWN, keep=()):
        """Rewrite a param value that is a jaxpr, a closed jaxpr, or a (named) tuple of them; keep its type.

        Arguments:
            keep: field names of a named tuple to leave as they are (derivative-only sub-jaxprs).
        """
        if isinstance(value, ClosedJaxpr):
            return self.closed(value, scope, context=context, where=where)
        if isinstance(value, Jaxpr):
            return self.open(value, scope, context=context, where=where)
        fields = getattr(value, "_fields", None)
        if fields is not None:
            return type(value)(*(
                getattr(value, f) if f in keep else self.swap(getattr(value, f), scope, context=context, where=where)
                for f in fields
            ))
        if isinstance(value, tuple):
            return tuple(self.swap(v, scope, context=context, where=where) for v in value)
        return value

    # -- evaluation -------------------------------------------------------------------------------------------
    def interpret(self, jaxpr: Jaxpr, consts: Sequence, args: Sequence, scope: str = "",
                  tangents=frozenset(), where: Location = UNKNOWN) -> list:
        """Evaluate ``jaxpr`` under the current trace, emitting the rewritten program.

        Arguments:
            jaxpr: the program.
            consts: values of its constvars.
            args: values of its invars (arrays, tracers, or :class:`~jaxpr_rewrite.quantized.QuantizedArray`).
            scope: the name scope the program runs in.
            tangents: invars holding tangents; every value computed from them keeps its float matmuls.
            where: the user's source of the enclosing equation, for equations JAX recorded none for.

        Returns:
            The values of its outvars (a pre-quantized input passed straight through stays quantized).
        """
        tangent_vars = set(tangents)
        smoothed: dict = {}  # activations divided by a smoothing group's factors, shared by the group's dots

        def step(eqn, invals):
            here = join_scope(scope, eqn.source_info.name_stack)
            reads_tangents = [isinstance(v, Var) and v in tangent_vars for v in eqn.invars] if tangent_vars else ()
            if any(reads_tangents):
                if rule_for(eqn.primitive.name).inline_call and self.rewrites_at(eqn, scope):
                    # a nested call computing primal and tangent together (jax.jvp of a jitted function, a
                    # jitted helper in the rule) is inlined, so that only its tangent matmuls stay float
                    sub, sub_consts = jaxpr_and_consts(eqn.params[SUBJAXPR_PARAMS[eqn.primitive.name][0]])
                    inner = frozenset(v for v, read in zip(sub.invars, reads_tangents) if read)
                    outs = self.interpret(sub, sub_consts, invals, here, inner, where)
                    tangent_vars.update(v for v, dependent in zip(eqn.outvars, _tangent_outputs(sub, inner))
                                        if dependent)
                    return outs
                tangent_vars.update(eqn.outvars)
                return bind(eqn, materialised(invals))
            if is_float_dot(eqn):
                reason = skip_reason(eqn, self.config, here)
                if self.on_dot is not None:
                    self.on_dot(eqn, here, reason)
                if reason is None:
                    return [self.rewrite_matmul(eqn, invals, eqn_location(eqn, where), smoothed)]
                return bind(eqn, materialised(invals))
            rule = rule_for(eqn.primitive.name)
            if any(is_quantized(v) for v in invals):
                if rule.quantized is not None:
                    outs = rule.quantized(RuleContext(self, here, eqn_location(eqn, where)), eqn, invals)
                    if outs is not None:
                        return outs
                invals = materialised(invals)
            if not self.rewrites_at(eqn, scope):
                return bind(eqn, invals)
            if rule.rewrite is None:
                raise Int8ifyError(
                    f"primitive '{eqn.primitive.name}' at {describe_source(eqn, where)} holds a float matmul in a "
                    "sub-jaxpr, and int8ify has no rule for it; leaving that matmul in float would break the int8 "
                    "contract. Move the matmul out of it, keep it float with skip/skip_if, or report it."
                )
            return bind(eqn, invals, rule.rewrite(RuleContext(self, here, eqn_location(eqn, where)), eqn.params))

        return evaluate(jaxpr, consts, args, step)

    # -- one matmul ---------------------------------------------------------------------------------------------
    def rewrite_matmul(self, eqn, invals: Sequence, where: Location = UNKNOWN, smoothed: dict | None = None):
        """The rewritten program for one float ``dot_general`` / ``ragged_dot_general`` equation.

        Arguments:
            eqn: the equation.
            invals: its operand values; a :class:`~jaxpr_rewrite.quantized.QuantizedArray` is a pre-quantized
                weight, used directly when its scales fit the contraction.
            where: the user's source, for errors about equations JAX recorded none for.
            smoothed: a per-program cache of activations rescaled by a smoothing group's factors, so weights of
                one group reading the same activation share that rescaling (and XLA then its quantization).
        """
        for v in eqn.invars[:2]:
            if jnp.issubdtype(v.aval.dtype, jnp.complexfloating):
                raise Int8ifyError(
                    f"{eqn.primitive.name} at {describe_source(eqn, where)} has complex operands "
                    f"({_operand_types(eqn)}); the int8 contract is defined for real floating matmuls only"
                )
        float_params = tuple(sorted(eqn.params.items()))
        out_dtype = eqn.outvars[0].aval.dtype
        ragged = eqn.primitive.name == "ragged_dot_general"
        if ragged:
            self._check_ragged(eqn, where)
        contractions = matmul_dimension_numbers(eqn)[0]
        lhs, rhs = resolve_dot_operands(invals[:2], contractions, self.config.uses_per_channel_int8, smoothed)
        # an integer operand of a mixed dot is quantized like a float one
        lhs, rhs = (
            x if is_quantized(x) or _is_float_dtype(v.aval.dtype) else lax.convert_element_type(x, np.float32)
            for x, v in zip((lhs, rhs), eqn.invars)
        )
        if ragged:
            return self.backend.ragged_dot(lhs, rhs, invals[2], float_params, out_dtype, self.config)

        def program(lhs, rhs):
            return self.backend.dot(lhs, rhs, float_params, out_dtype, self.config)

        out_sharding = _explicit_sharding(eqn)
        if out_sharding is not None:
            # Under explicit sharding every intermediate would need its sharding spelled out; the int8 program
            # runs with the mesh axes automatic inside and delivers the float dot's output sharding.
            program = jax.sharding.auto_axes(program, axes=out_sharding.mesh.explicit_axes, out_sharding=out_sharding)
        return program(lhs, rhs)

    def _check_ragged(self, eqn, where):
        if not supports_ragged(eqn.params) or self.backend.ragged_dot is None:
            what = (f"backend {self.backend.name!r} has no ragged_dot_general rule" if supports_ragged(eqn.params)
                    else "only a ragged non-contracting lhs dim with a group dim in the rhs is supported")
            raise Int8ifyError(
                f"ragged_dot_general at {describe_source(eqn, where)} ({_operand_types(eqn)}) cannot be rewritten: "
                f"{what}. Keep it float with skip/skip_if."
            )


def _tangent_outputs(jaxpr: Jaxpr, tangents) -> list[bool]:
    """Per outvar of ``jaxpr``, whether :meth:`Rewriter.interpret` computes it from the ``tangents`` invars."""
    dependent = set(tangents)
    for eqn in jaxpr.eqns:
        reads = [isinstance(v, Var) and v in dependent for v in eqn.invars]
        if not any(reads):
            continue
        if rule_for(eqn.primitive.name).inline_call:
            sub = open_jaxpr(eqn.params[SUBJAXPR_PARAMS[eqn.primitive.name][0]])
            flags = _tangent_outputs(sub, {v for v, read in zip(sub.invars, reads) if read})
            dependent.update(v for v, flag in zip(eqn.outvars, flags) if flag)
        else:
            dependent.update(eqn.outvars)
    return [isinstance(v, Var) and v in dependent for v in jaxpr.outvars]


def _explicit_sharding(eqn):
    """The output sharding of a matmul whose operands or result live on a mesh with explicit axes, else None."""
    for v in (*eqn.invars[:2], *eqn.outvars):
        mesh = getattr(getattr(v.aval, "sharding", None), "mesh", None)
        if getattr(mesh, "explicit_axes", ()):
            return eqn.outvars[0].aval.sharding
    return None


def _operand_types(eqn) -> str:
    return ", ".join(v.aval.str_short() for v in eqn.invars[:2])
