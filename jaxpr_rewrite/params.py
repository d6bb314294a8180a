"""Weights quantized once: :class:`QuantizedArray` and :func:`quantize_params`.

``quantize_params(fn, params, *example_args)`` finds the parameter leaves that feed a dot as an operand,
quantizes each with the per-channel scales of that dot, and returns the same pytree with those leaves
replaced by :class:`QuantizedArray` (int8 codes + float32 scales, about 4x smaller than float32).
``int8ify(fn)(qparams, *args)`` then uses the codes directly: its program quantizes only the activations,
and computes the same numbers as the dynamic path, bit for bit.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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
    """

    def __init__(self, codes, scales, contracting: tuple[int, ...], dtype):
        self.codes = codes
        self.scales = scales
        self.contracting = tuple(int(a) for a in contracting)
        self.dtype = np.dtype(dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.codes.shape)) + 4 * int(np.prod(self.scales.shape))

    @property
    def quantized(self) -> Quantized:
        return Quantized(self.codes, self.scales)

    def dequantize(self):
        """``codes * scales`` in the original dtype."""
        return dequantize(self.quantized, self.contracting).astype(self.dtype)

    def tree_flatten(self):
        return (self.codes, self.scales), (self.contracting, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def __repr__(self):
        return f"QuantizedArray(i8{list(self.shape)}, contracting={self.contracting}, dtype={self.dtype.name})"


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedArray)


def quantize_array(x, contracting) -> QuantizedArray:
    """Quantize one weight with one scale per index of its non-contracting axes (the contract's rule)."""
    x = jnp.asarray(x)
    q = quantize(x, contracting)
    return QuantizedArray(q.codes, q.scales, tuple(sorted(a % x.ndim for a in contracting)), x.dtype)


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


def quantize_params(fn: Callable, params, *example_args, **example_kwargs):
    """Quantize, once, the leaves of ``params`` that ``int8ify(fn)`` would quantize on every call.

    A leaf is quantized when every use of it in ``fn(params, *example_args)`` is as an operand of a dot
    that the rewrite replaces, all with the same contracting dims. A leaf also used otherwise (a bias, an
    embedding table also used as a lookup, a weight used under a transpose or inside a nested ``jit``
    or ``scan``) stays as it is, and the rewrite keeps quantizing it per call, so the numbers never change.

    Arguments:
        fn: the function, plain or already wrapped with :func:`int8ify` (its options are then used:
            a dot the options skip does not get quantized weights).
        params: a pytree, ``fn``'s first argument.
        *example_args, **example_kwargs: the other arguments (only their shapes and dtypes matter).

    Returns:
        ``params`` with the quantizable leaves replaced by :class:`QuantizedArray`.
    """
    from .api import Int8ified
    from .rewrite import RewriteConfig, is_float_dot, skip_reason

    config = fn.config if isinstance(fn, Int8ified) else RewriteConfig()
    raw_fn = fn.fn if isinstance(fn, Int8ified) else fn
    leaves, tree = jax.tree_util.tree_flatten(params, is_leaf=is_quantized)
    if any(is_quantized(x) for x in leaves):
        raise Int8ifyError("quantize_params got params that are already quantized")
    closed = jax.make_jaxpr(lambda p, *a: raw_fn(p, *a, **example_kwargs))(params, *example_args)
    jaxpr = closed.jaxpr
    n_leaves = len(leaves)
    new_leaves = []
    for leaf, var in zip(leaves, jaxpr.invars[:n_leaves]):
        uses = _dot_operand_uses(jaxpr, var)
        contracting = set()
        quantizable = bool(uses) and jnp.issubdtype(var.aval.dtype, jnp.floating)
        for eqn, side in uses:
            if side is None or not is_float_dot(eqn) or skip_reason(eqn, config, str(eqn.source_info.name_stack)):
                quantizable = False
                break
            contracting.add(tuple(eqn.params["dimension_numbers"][0][side]))
        per_channel_int8 = config.resolved_backend == "int8" and config.scheme == Scheme()
        if quantizable and len(contracting) == 1 and per_channel_int8:
            new_leaves.append(quantize_array(leaf, next(iter(contracting))))
        else:
            new_leaves.append(leaf)
    return jax.tree_util.tree_unflatten(tree, new_leaves)
