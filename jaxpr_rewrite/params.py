"""Weights quantized once: :class:`QuantizedArray` and :func:`quantize_params`.

``quantize_params(fn, params, *example_args)`` finds the parameter leaves that feed a dot as an operand,
quantizes each with the per-channel scales of that dot, and returns the same pytree with those leaves
replaced by :class:`QuantizedArray` (int8 codes + float32 scales, about 4x smaller than float32).
``int8ify(fn)(qparams, *args)`` then uses the codes directly: its program quantizes only the activations,
and computes the same numbers as the dynamic path, bit for bit.

With ``smooth_alpha`` it also moves activation outliers into the weights (SmoothQuant, Xiao et al. 2023):
per contracting index ``k`` a factor ``s_k = max|x_k|**alpha / max|w_k|**(1 - alpha)`` from calibration
inputs; the weight is stored as ``s * w`` and the rewritten dot divides the activation by ``s`` before
quantizing it. ``(x / s) @ (s * w) == x @ w`` in exact arithmetic, so the float function is unchanged,
while a channel that is large in every token no longer dictates every token's scale.
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal

from .errors import Int8ifyError
from .int8_dot import Scheme
from .quantize import Quantized, dequantize, quantize


@jax.tree_util.register_pytree_node_class
class QuantizedArray:
    """A float array stored as int8 codes and per-channel float32 scales.

    Attributes:
        codes: int8, the original shape.
        scales: float32, over the axes not in ``contracting``, in order.
        contracting: the axes one scale covers (the contracting dims of the dot this weight feeds).
        dtype: the original float dtype, which the traced program sees.
        smooth: ``None``, or float32 smoothing factors over the (single) contracting axis: the codes then
            stand for ``smooth * w`` and the dot divides its other operand by ``smooth``.
        smooth_group: weights with the same group (an int) hold the same ``smooth`` values, so a program
            reading one activation through several of them divides and quantizes it once.
    """

    def __init__(self, codes, scales, contracting: tuple[int, ...], dtype, smooth=None, smooth_group=None):
        self.codes = codes
        self.scales = scales
        self.contracting = tuple(int(a) for a in contracting)
        self.dtype = np.dtype(dtype)
        self.smooth = smooth
        self.smooth_group = smooth_group

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(self))

    @property
    def quantized(self) -> Quantized:
        return Quantized(self.codes, self.scales)

    def dequantize(self):
        """The float array this stands for: ``codes * scales`` (divided by ``smooth``), in the original dtype."""
        value = dequantize(self.quantized, self.contracting)
        if self.smooth is not None:
            value = lax.div(value, lax.broadcast_in_dim(self.smooth, self.shape, self.contracting))
        return value.astype(self.dtype)

    def tree_flatten(self):
        return (self.codes, self.scales, self.smooth), (self.contracting, self.dtype, self.smooth_group)

    @classmethod
    def tree_unflatten(cls, aux, children):
        codes, scales, smooth = children
        contracting, dtype, smooth_group = aux
        return cls(codes, scales, contracting, dtype, smooth=smooth, smooth_group=smooth_group)

    def __repr__(self):
        return f"QuantizedArray(i8{list(self.shape)}, contracting={self.contracting}, dtype={self.dtype.name})"


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedArray)


def quantize_array(x, contracting, smooth=None, smooth_group=None) -> QuantizedArray:
    """Quantize one weight with one scale per index of its non-contracting axes (the contract's rule).

    Arguments:
        x: the weight.
        contracting: the axes the dot it feeds contracts.
        smooth: optional smoothing factors over the single contracting axis (``smooth * x`` is quantized).
        smooth_group: see :class:`QuantizedArray`.
    """
    x = jnp.asarray(x)
    contracting = tuple(sorted(a % x.ndim for a in contracting))
    if smooth is not None:
        smooth = jnp.asarray(smooth, jnp.float32)
        x = (x.astype(jnp.float32) * lax.broadcast_in_dim(smooth, x.shape, contracting)).astype(x.dtype)
    q = quantize(x, contracting)
    return QuantizedArray(q.codes, q.scales, contracting, x.dtype, smooth, smooth_group)


def _dot_operand_uses(jaxpr, var):
    """For each use of ``var`` in ``jaxpr``: ``(eqn, side)`` for a dot operand, ``(eqn, None)`` otherwise."""
    uses = []
    for eqn in jaxpr.eqns:
        for side, v in enumerate(eqn.invars):
            if v is var:
                uses.append((eqn, side if eqn.primitive is lax.dot_general_p else None))
    if any(v is var for v in jaxpr.outvars):
        uses.append((None, None))
    return uses


def _quantizable_leaves(jaxpr, n_leaves: int, config) -> dict:
    """Parameter leaf index -> the contracting dims of the dots it feeds, for the leaves ``int8ify`` can
    use pre-quantized: every use an operand of a rewritten dot, all with one contraction."""
    from .rewrite import is_float_dot, skip_reason

    if not (config.resolved_backend == "int8" and config.scheme == Scheme()):
        return {}
    found = {}
    for index, var in enumerate(jaxpr.invars[:n_leaves]):
        uses = _dot_operand_uses(jaxpr, var)
        if not uses or not jnp.issubdtype(var.aval.dtype, jnp.floating):
            continue
        contractions = set()
        for eqn, side in uses:
            if side is None or not is_float_dot(eqn) or skip_reason(eqn, config, str(eqn.source_info.name_stack)):
                break
            contractions.add(tuple(eqn.params["dimension_numbers"][0][side]))
        else:
            if len(contractions) == 1:
                found[index] = contractions.pop()
    return found


def _activation_absmax(closed, n_leaves: int, leaves: dict, flat_args) -> dict:
    """Per weight leaf, the absmax of the activations its dots meet, per contracting index.

    Arguments:
        closed: the float program, traced on one calibration input.
        n_leaves: how many of its inputs are parameter leaves.
        leaves: leaf index -> contracting dims (single-dim contractions only).
        flat_args: the program's flat input values.

    Returns:
        leaf index -> float32 vector over the weight's contracting axis.
    """
    jaxpr = closed.jaxpr
    targets = {}
    for index in leaves:
        for eqn, side in _dot_operand_uses(jaxpr, jaxpr.invars[index]):
            targets[id(eqn)] = (index, side)

    def run(consts, *args):
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        stats = {}
        for eqn in jaxpr.eqns:
            invals = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
            if id(eqn) in targets:
                index, side = targets[id(eqn)]
                activation = jnp.abs(invals[1 - side].astype(jnp.float32))
                (contract,) = eqn.params["dimension_numbers"][0][1 - side]
                others = tuple(a for a in range(activation.ndim) if a != contract)
                amax = jnp.max(activation, axis=others)
                stats[index] = amax if index not in stats else jnp.maximum(stats[index], amax)
            outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
        return stats

    return jax.jit(run)(closed.consts, *flat_args)


def weight_absmax(weight, contracting: int):
    """``max|w_k|`` per index ``k`` of the contracting axis, in float32."""
    w = jnp.abs(jnp.asarray(weight, jnp.float32))
    return jnp.max(w, axis=tuple(a for a in range(w.ndim) if a != contracting))


def _any_scope_matches(jaxpr, var, patterns) -> bool:
    """Whether a dot reading ``var`` sits in a name scope matching one of ``patterns``."""
    scopes = [str(eqn.source_info.name_stack) for eqn, _ in _dot_operand_uses(jaxpr, var)]
    return any(fnmatch.fnmatchcase(scope, p) for scope in scopes for p in patterns)


def _groups_by_activation(jaxpr, leaf_indices) -> list[list[int]]:
    """Parameter leaves grouped by the activations their dots read (same variable, same contracting axis)."""
    groups: dict = {}
    for index in leaf_indices:
        reads = frozenset(
            (eqn.invars[1 - side], eqn.params["dimension_numbers"][0][1 - side])
            for eqn, side in _dot_operand_uses(jaxpr, jaxpr.invars[index])
        )
        groups.setdefault(reads, []).append(index)
    return list(groups.values())


def smoothing_factors(activation_absmax, weight_absmax, alpha: float):
    """SmoothQuant factors ``max|x_k|**alpha / max|w_k|**(1 - alpha)`` per contracting index ``k``.

    Arguments:
        activation_absmax: absmax of the activations per contracting index (from calibration).
        weight_absmax: absmax of the weight(s) per contracting index (see :func:`weight_absmax`).
        alpha: how much of the outliers moves into the weight (0: none, 1: all).

    Returns:
        float32 factors; 1 where either side is all zero.
    """
    a, b = jnp.asarray(activation_absmax, jnp.float32), jnp.asarray(weight_absmax, jnp.float32)
    usable = (a > 0) & (b > 0) & jnp.isfinite(a) & jnp.isfinite(b)
    factors = jnp.power(jnp.where(usable, a, 1.0), alpha) / jnp.power(jnp.where(usable, b, 1.0), 1 - alpha)
    return jnp.where(usable, factors, 1.0)


def quantize_params(fn: Callable, params, *example_args, smooth_alpha: float | None = None, calibration=None,
                    smooth_skip=(), **example_kwargs):
    """Quantize, once, the leaves of ``params`` that ``int8ify(fn)`` would quantize on every call.

    A leaf is quantized when every use of it in ``fn(params, *example_args)`` is as an operand of a dot
    that the rewrite replaces, all with the same contracting dims. A leaf also used otherwise (a bias, an
    embedding table also used as a lookup, a weight used under a transpose or inside a nested ``jit``
    or ``scan``) stays as it is, and the rewrite keeps quantizing it per call, so the numbers never change.

    Arguments:
        fn: the function, plain or already wrapped with :func:`int8ify` (its options are then used:
            a dot the options skip does not get quantized weights).
        params: a pytree, ``fn``'s first argument.
        *example_args, **example_kwargs: the other arguments (only their shapes and dtypes matter, unless
            they are the calibration input).
        smooth_alpha: if set (0 to 1, 0.5 is the usual choice), weights with one contracting dim also get
            SmoothQuant factors from the activations they meet on the calibration inputs. The numbers then
            differ from the dynamic path (that is the point: a smaller int8 error where activations have
            outlier channels); without it they are bit-identical.
        calibration: an iterable of argument tuples (the arguments after ``params``, with
            ``example_kwargs``) to measure activations on; defaults to ``[example_args]``.
        smooth_skip: name-scope patterns (``fnmatch``, as ``int8ify(skip=...)``); weights of dots whose
            scope matches one are quantized without smoothing.

    Returns:
        ``params`` with the quantizable leaves replaced by :class:`QuantizedArray`.
    """
    from .api import Int8ified
    from .rewrite import RewriteConfig

    config = fn.config if isinstance(fn, Int8ified) else RewriteConfig()
    raw_fn = fn.fn if isinstance(fn, Int8ified) else fn
    leaves, tree = jax.tree_util.tree_flatten(params, is_leaf=is_quantized)
    if any(is_quantized(x) for x in leaves):
        raise Int8ifyError("quantize_params got params that are already quantized")
    if smooth_alpha is not None and not 0 <= smooth_alpha <= 1:
        raise Int8ifyError(f"smooth_alpha must be in [0, 1], got {smooth_alpha!r}")

    def trace(args):
        return jax.make_jaxpr(lambda p, *a: raw_fn(p, *a, **example_kwargs))(params, *args)

    example = trace(example_args).jaxpr
    quantizable = _quantizable_leaves(example, len(leaves), config)
    smooth = {}
    if smooth_alpha is not None:
        patterns = (smooth_skip,) if isinstance(smooth_skip, str) else tuple(smooth_skip)
        single = {
            i: c for i, c in quantizable.items()
            if len(c) == 1 and not _any_scope_matches(example, example.invars[i], patterns)
        }
        absmax = {}
        for args in [example_args] if calibration is None else calibration:
            flat = jax.tree_util.tree_leaves((params, tuple(args)))
            for index, value in _activation_absmax(trace(tuple(args)), len(leaves), single, flat).items():
                absmax[index] = value if index not in absmax else jnp.maximum(absmax[index], value)
        # Weights that read the same activation share one factor vector (from the largest of their
        # weights), so the program divides and quantizes that activation once for all of them.
        for group_id, group in enumerate(_groups_by_activation(example, absmax)):
            w_absmax = functools.reduce(jnp.maximum, [
                weight_absmax(leaves[i], single[i][0] % leaves[i].ndim) for i in group
            ])
            factors = smoothing_factors(absmax[group[0]], w_absmax, smooth_alpha)
            smooth.update({i: (factors, group_id) for i in group})
    new_leaves = [
        quantize_array(leaf, quantizable[i], *smooth.get(i, (None, None))) if i in quantizable else leaf
        for i, leaf in enumerate(leaves)
    ]
    return jax.tree_util.tree_unflatten(tree, new_leaves)
