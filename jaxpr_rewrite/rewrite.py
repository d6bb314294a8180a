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

import contextlib
import dataclasses
import fnmatch
from typing import Callable, Sequence

import jax
import jax.extend  # noqa: F401  (makes jax.extend.core importable)
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var, jaxprs_in_params

from . import _compat
from .errors import Int8ifyError, describe_operands, describe_source
from .int8_dot import Scheme, contraction_size, int8_dot_general
from .quantize import MAX_INT32_SAFE_CONTRACTION, Quantized


GRANULARITIES = ("per-channel", "per-tensor")

# Backends a float dot can be rewritten to: name -> fn(lhs, rhs, float_params, out_dtype, config).
dot_backends: dict[str, Callable] = {}
# Names that stand for a backend chosen when the rewrite runs (e.g. "auto"): name -> fn() -> backend name.
backend_aliases: dict[str, Callable[[], str]] = {}


@dataclasses.dataclass(frozen=True)
class RewriteConfig:
    """The options of :func:`int8ify`; hashable, part of the cache key of every rewritten program.

    Attributes:
        skip: name-scope patterns (``fnmatch`` syntax, e.g. ``"*attention*"``); a dot whose scope
            (``jax.named_scope`` / module path, nested scopes joined by ``/``) matches one stays float.
        skip_if: a predicate on the ``dot_general`` equation; the dots it returns true for stay float.
        min_contracting_size: dots that sum fewer products than this stay float (tiny dots cost more to
            quantize than they save).
        granularity: ``"per-channel"`` (the contract) or ``"per-tensor"``.
        block_size: one scale per block of this many elements along the contraction (sub-channel).
        backend: what a float dot becomes: ``"int8"`` (the contract), or a registered backend.
    """

    skip: tuple[str, ...] = ()
    skip_if: Callable | None = None
    min_contracting_size: int = 0
    granularity: str = "per-channel"
    block_size: int | None = None
    backend: str = "int8"

    def __post_init__(self):
        skip = (self.skip,) if isinstance(self.skip, str) else tuple(self.skip)
        if not all(isinstance(p, str) for p in skip):
            raise Int8ifyError(f"skip must be name-scope patterns (strings), got {self.skip!r}")
        object.__setattr__(self, "skip", skip)
        if self.skip_if is not None and not callable(self.skip_if):
            raise Int8ifyError(f"skip_if must be a predicate on the dot_general equation, got {self.skip_if!r}")
        if not isinstance(self.min_contracting_size, (int, np.integer)) or self.min_contracting_size < 0:
            raise Int8ifyError(f"min_contracting_size must be a non-negative int, got {self.min_contracting_size!r}")
        if self.granularity not in GRANULARITIES:
            raise Int8ifyError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.block_size is not None:
            is_int = isinstance(self.block_size, (int, np.integer))
            if not is_int or not 1 <= self.block_size <= MAX_INT32_SAFE_CONTRACTION:
                raise Int8ifyError(
                    f"block_size must be an int in [1, {MAX_INT32_SAFE_CONTRACTION}] (int32 partial sums of a "
                    f"block must not overflow), got {self.block_size!r}"
                )
            if self.granularity != "per-channel":
                raise Int8ifyError("block_size refines per-channel scales; it cannot be combined with per-tensor")
        if self.backend not in dot_backends and self.backend not in backend_aliases:
            known = sorted([*dot_backends, *backend_aliases])
            raise Int8ifyError(f"backend must be one of {known}, got {self.backend!r}")

    @property
    def resolved_backend(self) -> str:
        """The backend dots are rewritten to, aliases such as ``"auto"`` resolved for this machine."""
        alias = backend_aliases.get(self.backend)
        return alias() if alias is not None else self.backend

    @property
    def scheme(self) -> Scheme:
        return Scheme(self.granularity, None if self.block_size is None else int(self.block_size))


def _is_float(dtype) -> bool:
    # jnp.issubdtype knows the ml_dtypes floats (bfloat16, float8_*); np.issubdtype does not.
    return jnp.issubdtype(dtype, jnp.floating)


def is_float_dot(eqn) -> bool:
    """Whether ``eqn`` is a ``dot_general`` with a floating (or complex) operand: the ones the rewrite
    replaces, or rejects when it cannot (complex)."""
    return eqn.primitive is lax.dot_general_p and any(jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.invars)


def join_scope(outer: str, inner) -> str:
    inner = str(inner)
    return f"{outer}/{inner}" if outer and inner else outer or inner


def skip_reason(eqn, config: RewriteConfig, scope: str) -> str | None:
    """Why the float dot ``eqn`` stays float under ``config``, or ``None`` when it is rewritten.

    Arguments:
        eqn: a float ``dot_general`` equation.
        config: the rewrite options.
        scope: the dot's full name scope (enclosing scopes included).
    """
    for pattern in config.skip:
        if fnmatch.fnmatchcase(scope, pattern):
            return f"name scope {scope!r} matches skip pattern {pattern!r}"
    if config.skip_if is not None and config.skip_if(eqn):
        return "skip_if returned True"
    (lc, _), _ = eqn.params["dimension_numbers"]
    size = contraction_size(eqn.invars[0].aval.shape, lc)
    if size < config.min_contracting_size:
        return f"contraction of {size} < min_contracting_size={config.min_contracting_size}"
    return None


def _bind(primitive, invals, params):
    out = primitive.bind(*invals, **primitive.get_bind_params(params))
    return out if primitive.multiple_results else [out]


def _equation_context(eqn):
    """New equations inherit ``eqn``'s source line, name scope and context, as in ``jax.core.eval_jaxpr``."""
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

    def __init__(self, config: RewriteConfig, on_dot: Callable | None = None):
        """
        Arguments:
            config: the rewrite options.
            on_dot: called as ``on_dot(eqn, scope, reason)`` for every float dot met, ``reason`` being
                ``None`` for a rewritten dot and why it stays float otherwise (the report builds on it).
        """
        self.config = config
        self.on_dot = on_dot
        self.scope = ""
        self._rewritten: dict[int, tuple[object, object]] = {}
        self._has_float_dot: dict[int, tuple[object, bool]] = {}

    @contextlib.contextmanager
    def within(self, scope: str):
        """Rewrite sub-jaxprs as nested in name scope ``scope``."""
        outer, self.scope = self.scope, scope
        try:
            yield
        finally:
            self.scope = outer

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
        key = (id(closed_jaxpr), self.scope)
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

    def with_quantized_inputs(self, closed_jaxpr: ClosedJaxpr, quantized: dict) -> ClosedJaxpr:
        """Rewrite a program whose inputs ``quantized`` arrive as pre-quantized weights.

        Arguments:
            closed_jaxpr: the program, traced with float inputs of the weights' original types.
            quantized: input index -> the :class:`~jaxpr_rewrite.params.QuantizedArray` passed there
                (its structure and the types of its arrays are used).

        Returns:
            A ``ClosedJaxpr`` taking, for each such input, the arrays of the ``QuantizedArray`` (codes,
            scales, smoothing factors) instead of one. Dots with a matching contraction use the codes
            directly; any other use sees the dequantized value.
        """
        jaxpr = closed_jaxpr.jaxpr
        in_avals, structures = [], {}
        for i, v in enumerate(jaxpr.invars):
            if i in quantized:
                leaves, treedef = jax.tree_util.tree_flatten(quantized[i])
                structures[i] = (treedef, len(leaves))
                in_avals += [jax.core.ShapedArray(leaf.shape, leaf.dtype) for leaf in leaves]
            else:
                in_avals.append(v.aval)

        def interpret(*flat):
            flat = iter(flat)
            args = []
            for i in range(len(jaxpr.invars)):
                if i in structures:
                    treedef, n = structures[i]
                    args.append(jax.tree_util.tree_unflatten(treedef, [next(flat) for _ in range(n)]))
                else:
                    args.append(next(flat))
            return self.interpret(jaxpr, closed_jaxpr.consts, args)

        new_jaxpr, consts = _compat.trace_to_jaxpr(interpret, in_avals, jaxpr.debug_info)
        return ClosedJaxpr(new_jaxpr, consts)

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
        from .params import QuantizedArray

        env: dict = {}
        tangent_vars = set(tangents)
        dequantized: dict = {}
        smoothed: dict = {}  # (activation, axis, smoothing group) -> activation / smooth, shared by its dots

        def read_raw(atom):
            return atom.val if isinstance(atom, Literal) else env[atom]

        def read(atom):
            """An atom's value; pre-quantized weights read as ``codes * scales`` (once per variable)."""
            value = read_raw(atom)
            if not isinstance(value, QuantizedArray):
                return value
            if atom not in dequantized:
                dequantized[atom] = value.dequantize()
            return dequantized[atom]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            on_tangent = bool(tangent_vars) and any(isinstance(v, Var) and v in tangent_vars for v in eqn.invars)
            with _equation_context(eqn):
                if on_tangent or not self.needs_rewrite(eqn):
                    outs = _bind(eqn.primitive, [read(v) for v in eqn.invars], eqn.params)
                elif eqn.primitive is lax.dot_general_p:
                    scope = join_scope(self.scope, eqn.source_info.name_stack)
                    reason = skip_reason(eqn, self.config, scope)
                    if self.on_dot is not None:
                        self.on_dot(eqn, scope, reason)
                    if reason is None:
                        # raw: a pre-quantized weight reaches the dot rule as codes and scales
                        outs = [rewrite_dot(eqn, [read_raw(v) for v in eqn.invars], self.config, smoothed)]
                    else:
                        outs = _bind(eqn.primitive, [read(v) for v in eqn.invars], eqn.params)
                else:
                    rule = higher_order_rules.get(eqn.primitive.name)
                    if rule is None:
                        raise Int8ifyError(
                            f"primitive '{eqn.primitive.name}' at {describe_source(eqn)} holds a float "
                            "dot_general in a sub-jaxpr, and int8ify has no rule for it; leaving that dot in "
                            "float would break the int8 contract. Move the matmul out of it, or report it."
                        )
                    with self.within(join_scope(self.scope, eqn.source_info.name_stack)):
                        new_params = rule(self, eqn.params)
                    outs = _bind(eqn.primitive, [read(v) for v in eqn.invars], new_params)
            if on_tangent:
                tangent_vars.update(eqn.outvars)
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]


def rewrite_dot(eqn, invals, config: RewriteConfig, smoothed: dict | None = None):
    """The rule for one float ``dot_general`` equation: the configured backend (the int8 contract by
    default), with a straight-through gradient.

    Arguments:
        eqn: the ``dot_general`` equation.
        invals: its operand values; a :class:`~jaxpr_rewrite.params.QuantizedArray` is a pre-quantized weight.
        config: the rewrite options.
        smoothed: a per-program cache of activations rescaled by a smoothing group's factors, so weights of
            one group reading the same activation share that rescaling (and XLA then its quantization).
    """
    for v in eqn.invars:
        if jnp.issubdtype(v.aval.dtype, jnp.complexfloating):
            raise Int8ifyError(
                f"dot_general at {describe_source(eqn)} has complex operands ({describe_operands(eqn)}); "
                "the int8 contract is defined for real floating dots only"
            )
    lhs, rhs = _prequantized_operands(eqn, invals, config, smoothed)
    # an integer operand of a mixed dot is quantized like a float one
    lhs, rhs = (
        x if isinstance(x, Quantized) or _is_float(v.aval.dtype) else lax.convert_element_type(x, np.float32)
        for x, v in zip((lhs, rhs), eqn.invars)
    )
    float_params = tuple(sorted(eqn.params.items()))
    return dot_backends[config.resolved_backend](lhs, rhs, float_params, eqn.outvars[0].aval.dtype, config)


def _prequantized_operands(eqn, invals, config: RewriteConfig, smoothed: dict | None) -> list:
    """Resolve pre-quantized weights among a dot's operands.

    A :class:`~jaxpr_rewrite.params.QuantizedArray` whose scales fit this dot (int8 per-channel, same
    contraction) goes on as its codes and scales; any other is dequantized. A usable smoothed weight stands
    for ``smooth * w``, so the other operand is multiplied by ``1 / smooth`` first.
    """
    from .params import QuantizedArray

    contractions = eqn.params["dimension_numbers"][0]
    direct = config.resolved_backend == "int8" and config.scheme == Scheme()
    usable = [
        isinstance(x, QuantizedArray) and direct and x.contracting == tuple(sorted(contract))
        for x, contract in zip(invals, contractions)
    ]
    for side, x in enumerate(invals):
        if usable[side] and x.smooth is not None and isinstance(invals[1 - side], QuantizedArray):
            usable[side] = False  # two weights: the smoothing cannot move into the other one
    operands = [
        x.quantized if use else x.dequantize() if isinstance(x, QuantizedArray) else x
        for x, use in zip(invals, usable)
    ]
    for side in (0, 1):
        weight = invals[side]
        if not usable[side] or weight.smooth is None:
            continue
        (other_axis,) = contractions[1 - side]
        other = operands[1 - side]
        key = (id(other), other_axis, weight.smooth_group)
        shareable = weight.smooth_group is not None and smoothed is not None
        if shareable and key in smoothed:
            operands[1 - side] = smoothed[key][1]
            continue
        # the reciprocal is taken once on the small factor vector; each element then costs one multiply
        inverse = lax.div(np.float32(1), lax.convert_element_type(weight.smooth, np.float32))
        inverse = lax.convert_element_type(inverse, other.dtype)
        operands[1 - side] = lax.mul(other, lax.broadcast_in_dim(inverse, other.shape, (other_axis,)))
        if shareable:
            smoothed[key] = (other, operands[1 - side])  # holds `other`, so no other value reuses its id
    return operands


def _int8_backend(lhs, rhs, float_params, out_dtype, config: RewriteConfig):
    return int8_dot_general(lhs, rhs, float_params, out_dtype, config.scheme)


dot_backends["int8"] = _int8_backend


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

    scope = rewriter.scope

    def rewrite_jvp(result):
        jvp_jaxpr, jvp_consts, *rest = result
        with rewriter.within(scope):
            new = rewriter.closed(ClosedJaxpr(jvp_jaxpr, jvp_consts), keep_float_from=n_primals)
        return (new.jaxpr, new.consts, *rest)

    new_params["jvp_jaxpr_fun"] = _compat.wrap_jaxpr_thunk(params["jvp_jaxpr_fun"], rewrite_jvp)
    return new_params


higher_order_rules["custom_jvp_call"] = _custom_jvp_rule


def _custom_vjp_rule(rewriter: Rewriter, params: dict) -> dict:
    """Rewrite the primal and the user's ``fwd`` (the forward pass under ``grad``); ``bwd`` stays as written."""
    new_params = dict(params)
    new_params["call_jaxpr"] = rewriter.closed(params["call_jaxpr"])

    scope = rewriter.scope

    def rewrite_fwd(result):
        fwd_jaxpr, fwd_consts, *rest = result
        with rewriter.within(scope):
            new = rewriter.closed(ClosedJaxpr(fwd_jaxpr, fwd_consts))
        return (new.jaxpr, new.consts, *rest)

    new_params["fwd_jaxpr_thunk"] = _compat.wrap_jaxpr_thunk(params["fwd_jaxpr_thunk"], rewrite_fwd)
    return new_params


higher_order_rules["custom_vjp_call"] = _custom_vjp_rule
