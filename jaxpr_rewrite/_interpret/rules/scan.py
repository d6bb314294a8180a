"""``lax.scan``: its body is rewritten in place; pre-quantized consts are closed over and pre-quantized ``xs``
sliced per step; the report sums a body matmul's error over every step in the carry."""

from __future__ import annotations

import jax
from jax import lax

from ..error_sums import add, zeros
from ..._core.jaxprs import open_jaxpr, scan_counts, scan_operands, sub_index
from ..._core.layout import is_static
from ..._quantized.array import is_quantized, materialise
from .common import carried, kept_quantized, sub_interpreter, swap_forward_params
from .registry import RuleContext, register

__all__ = []


def _length(params, xs):
    """``lax.scan``'s ``length`` for a scan run again: ``None`` (read off the ``xs``) where it is a symbolic dim of
    ``jax.export``, which ``lax.scan`` takes only in the shapes of its ``xs``."""
    return None if xs and not is_static(params["length"]) else params["length"]


def _scan_quantized(context: RuleContext, eqn, invals):
    """``lax.scan`` again, with pre-quantized consts closed over and pre-quantized ``xs`` sliced per step (an ``xs``
    scanned along an axis its scales cover has no per-step scales, and is materialised); a quantized carry that the
    body returns in its layout stays quantized, and so do quantized ``ys`` (a KV cache per layer, written into by a
    scan over the layers), stacked along their new leading axis."""
    p = eqn.params
    consts, init, xs = scan_operands(p, invals)
    n_carry = len(init)
    xs = [materialise(x) if is_quantized(x) and 0 in x.contracting else x for x in xs]
    body = sub_interpreter(context, p["jaxpr"])
    empty = is_static(p["length"]) and p["length"] == 0
    keep = [False] * n_carry if empty else carried(init, lambda c: body([*consts, *c, *_first_step(xs)])[:n_carry])

    def step(carry, x):
        outs = body([*consts, *carry, *x])
        return kept_quantized(outs[:n_carry], keep), outs[n_carry:]

    carry, ys = lax.scan(step, kept_quantized(init, keep), xs, length=_length(p, xs), reverse=p["reverse"],
                         unroll=p["unroll"])
    return [*carry, *ys]


def _first_step(xs: list) -> list:
    """What the body gets of ``xs`` at a step (the first), for tracing it abstractly."""
    return jax.tree_util.tree_map(lambda x: lax.index_in_dim(x, 0, keepdims=False), xs)


def _follow_scan(trail, eqn, positions, where):
    """A weight that is a scan const is followed into the body; one scanned as ``xs`` too, with its leading
    (stacked-layers) axis sliced off; a carried one stays float."""
    sub = open_jaxpr(eqn.params["jaxpr"])
    n_consts, n_carry = scan_counts(eqn.params)
    found = []
    for k in positions:
        if n_consts <= k < n_consts + n_carry:
            trail.refuse(f"it is carried through the scan at {where}", eqn)
            continue
        sliced = trail.axes if k < n_consts else trail.axes[1:]  # xs lose their leading (stacked) axis
        if k >= n_consts and trail.axes[0] != min(trail.axes):
            trail.refuse(f"the scan at {where} slices it along a transposed axis", eqn)
            continue
        found += trail.follow(sub, sub.invars[k], nested=True, axes=sliced)
    return found


def _measure_scan(measurer, eqn, invals, path):
    """The body run by ``lax.scan`` with the measured sums accumulated in the carry."""
    p = eqn.params
    consts, init, xs = scan_operands(p, invals)
    n_carry = len(init)
    body = p["jaxpr"]
    sub = path + (sub_index(eqn, body),)

    def step(state, x):
        carry, acc = state
        outs, stats = measurer.run(body, [*consts, *carry, *x], sub)
        return (outs[:n_carry], add(acc, stats)), outs[n_carry:]

    (carry, acc), ys = lax.scan(step, (init, zeros(measurer.paths_under(sub))), xs,
                                length=_length(p, xs), reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys], acc


def _label_scan(params) -> list[str]:
    return [f"length={params['length']}"]


register("scan", subjaxprs=("jaxpr",), rewrite=swap_forward_params("scan"), quantized=_scan_quantized,
         follow=_follow_scan, measure=_measure_scan, label=_label_scan)
