"""How :func:`~jaxpr_rewrite.quantize_params` follows a parameter through a traced program to the matmuls it feeds:
through the primitives whose rule says how (:mod:`jaxpr_rewrite._interpret.rules`: casts, transposes, calls, loops,
branches), every other use keeping the parameter float, with the reason."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.extend.core import Var

from .._core.jaxprs import (VALUE_MOVING_PRIMITIVES, is_float_dot, iter_eqns, matmul_dimension_numbers,
                            open_jaxpr, sub_jaxprs)
from .config import RewriteConfig
from .rules import rule_for
from .rules.dots import is_plain_dot, skip_reason
from .._core.scopes import join_scope
from .._core.source import UNKNOWN, Location, eqn_location

__all__ = ["Use", "plan_uses"]


@dataclasses.dataclass(frozen=True)
class Use:
    """One use of a parameter as a matmul operand."""

    from_end: tuple[int, ...]  # the contracting axes, counted from the end
    casts: tuple  # the float dtypes it is cast to before the matmul, in order (a chain keeps every rounding)
    direct: bool  # an operand of a top-level dot_general (SmoothQuant needs that)
    eqn: object  # the matmul
    side: int  # 0: lhs, 1: rhs
    jaxpr: object  # the jaxpr holding the matmul
    keeps_value: bool = False  # the leaf is also looked up (a tied embedding): its float values are kept too


@dataclasses.dataclass(frozen=True)
class _Trail:
    """Where a parameter is being followed: the state :func:`_uses` passes to each primitive's ``follow`` rule
    (:mod:`jaxpr_rewrite._interpret.rules`).

    Attributes:
        config: the rewrite options (a use in a matmul they keep float refuses the leaf).
        refused: every use that keeps the leaf float, described (shared by the whole walk).
        jaxpr: the jaxpr holding the value followed.
        scope: the name scope of the equation reading it.
        enclosing_scope: the name scope of the equation holding :attr:`jaxpr` (``""`` at the top level): what the
            name stacks of :attr:`jaxpr`'s equations are relative to.
        casts: the float dtypes the value was cast to on the way, in order (a chain keeps every rounding).
        top: whether the value is read at the traced program's top level.
        as_passed: whether the value is the leaf as passed (not followed through a cast, transpose or call).
        axes: ``axes[i]`` is the parameter leaf's axis that axis ``i`` of the value is (a scan over stacked
            layers slices the leading axes off, a transpose permutes them).
        outer: where the equation holding :attr:`jaxpr` is in the user's code: the place named for an equation
            JAX recorded no user frame for (a gather inside a library's jitted ``jnp.take``).
    """

    config: RewriteConfig
    refused: list
    jaxpr: object = None
    scope: str = ""
    enclosing_scope: str = ""
    casts: tuple = ()
    top: bool = True
    as_passed: bool = True
    axes: tuple = ()
    outer: Location = UNKNOWN  # where the equation holding `jaxpr` is in the user's code

    def follow(self, jaxpr, var, *, nested: bool = False, **changes) -> list[Use]:
        """The matmul uses of ``var`` in ``jaxpr``; ``nested``: ``jaxpr`` is a sub-jaxpr of the current one;
        ``changes``: the fields that change on the way (``casts``, ``axes``)."""
        # a value followed within the same jaxpr (a cast, a transpose) is read by equations whose name stacks are
        # relative to the same enclosing equation; a sub-jaxpr's are relative to the equation holding it
        enclosing = self.scope if nested else self.enclosing_scope
        return _uses(jaxpr, var, dataclasses.replace(self, top=self.top and not nested, enclosing_scope=enclosing,
                                                     as_passed=False, **changes))

    def refuse(self, why: str, eqn=None, *, skipped: bool = False, returned: bool = False) -> None:
        """Record a use that keeps the leaf float: by the equation ``eqn`` of :attr:`jaxpr` (which may still lead
        to a matmul), or by none (it is returned); ``skipped``: a matmul the options keep float; ``returned``: the
        traced function returns the leaf as it is."""
        self.refused.append(_Refusal(why, eqn is not None and _reaches_a_float_dot(self.jaxpr, eqn), skipped=skipped,
                                     returned=returned))

    def refuse_unfollowed(self, eqn, where: str) -> None:
        """Record a use by ``eqn``, a primitive without a rule to follow a parameter through (a slice, a
        reshape): said to feed a matmul where its result does, since the leaf then feeds one but stays float."""
        feeds = _reaches_a_float_dot(self.jaxpr, eqn)
        follows = " (quantize_params follows casts, transposes, calls, loops, branches and a scan's slices)"
        self.refused.append(_Refusal(
            f"it is used by {eqn.primitive.name} at {where}" + (", whose result feeds a matmul" + follows if feeds
                                                                else ""), feeds,
            lookup=eqn.primitive.name in LOOKUP_PRIMITIVES))


# Primitives that read some of a leaf's rows (an embedding's lookup of its tokens): a leaf that matmuls read too (a
# tied embedding's LM head) is quantized for them with its float values kept for these reads
LOOKUP_PRIMITIVES = frozenset({"gather", "dynamic_slice"})


@dataclasses.dataclass(frozen=True)
class _Refusal:
    why: str
    feeds_matmul: bool  # the refused use leads to a float matmul: the leaf feeds one, but stays float
    lookup: bool = False  # a lookup of some of its rows (an embedding's): its result is an activation
    skipped: bool = False  # a matmul the options keep float
    returned: bool = False  # returned as it is by the traced function (a step returning its model)


def _reaches_a_float_dot(jaxpr, start) -> bool:
    """Whether equation ``start`` of ``jaxpr`` holds a float matmul, or moves the values it reads (a slice, a split,
    a cast: :data:`~jaxpr_rewrite._core.jaxprs.VALUE_MOVING_PRIMITIVES`) into one, through any number of such moves. A
    value computed from the leaf (a bias added to an activation) is not the leaf: the matmul it feeds does not
    make the leaf a weight."""
    reached = set()
    for eqn in jaxpr.eqns[jaxpr.eqns.index(start):]:
        if eqn is not start and not any(v in reached for v in eqn.invars if isinstance(v, Var)):
            continue
        if is_float_dot(eqn) or any(is_float_dot(e) for sub in sub_jaxprs(eqn) for e in iter_eqns(sub)):
            return True
        if eqn.primitive.name in VALUE_MOVING_PRIMITIVES:
            reached.update(eqn.outvars)
    return False


def _uses(jaxpr, var, trail: _Trail) -> list[Use]:
    """Every matmul use of ``var`` in ``jaxpr``, followed through the primitives whose rule says how (casts,
    transposes, the higher-order primitives the rewrite carries pre-quantized weights through); every other use
    is described in ``trail.refused``."""
    jaxpr = open_jaxpr(jaxpr)
    found: list[Use] = []
    if any(v is var for v in jaxpr.outvars):
        trail.refuse("it is returned" + ("" if trail.top else " from a nested call or loop body"),
                     returned=trail.top and trail.as_passed)
    for eqn in jaxpr.eqns:
        positions = [k for k, v in enumerate(eqn.invars) if v is var]
        if not positions:
            continue
        location = eqn_location(eqn, trail.outer)
        here = dataclasses.replace(trail, jaxpr=jaxpr, outer=location,
                                   scope=join_scope(trail.enclosing_scope, eqn.source_info.name_stack))
        where = str(location)
        if is_float_dot(eqn) and positions[0] < 2:
            found += _matmul_use(eqn, positions, here, where)
            continue
        follow = rule_for(eqn.primitive.name).follow
        uses = follow(here, eqn, positions, where) if follow is not None else None
        if uses is None:
            here.refuse_unfollowed(eqn, where)
        else:
            found += uses
    return found


def _matmul_use(eqn, positions, trail: _Trail, where: str) -> list[Use]:
    """The use of a parameter as operand ``positions[0]`` of the float matmul ``eqn`` (none, refused, when it is
    both operands or the options keep the matmul float)."""
    if len(positions) > 1:
        trail.refuse(f"it is both operands of the matmul at {where}", eqn)
        return []
    reason = skip_reason(eqn, trail.config, trail.scope)
    if reason is not None:
        trail.refuse(f"its matmul at {where} stays float ({reason})", eqn, skipped=True)
        return []
    dims = matmul_dimension_numbers(eqn)
    side = positions[0]
    axes = trail.axes
    leaf_ndim = max(axes) + 1 if axes else 0  # axes are the leaf's trailing axes, permuted
    contracted = [axes[a] for a in dims[0][side]]  # the leaf's axes, in the order the dot contracts them
    if trail.config.int8_block_size is not None and contracted != sorted(contracted):
        # block scales run over the contraction flattened in the leaf's axis order (docs/deploy.md), and the dot
        # cuts its own in its order: stored codes would fit no block of the dot
        trail.refuse(f"its matmul at {where} contracts its axes in the order {tuple(contracted)}, and block scales "
                     "follow the axes' own order", eqn)
        return []
    from_end = tuple(sorted(a - leaf_ndim for a in contracted))
    direct = trail.top and is_plain_dot(eqn) and axes == tuple(range(len(axes)))
    return [Use(from_end, trail.casts, direct, eqn, side, trail.jaxpr)]


def plan_uses(jaxpr, var, config: RewriteConfig) -> tuple[list[Use], str]:
    """The uses of a parameter input and how it is quantized, or ``([], reason)`` when it stays float.

    A leaf read by matmuls and otherwise only by lookups of its rows (a tied embedding: its lookup and its LM head)
    is quantized for its matmuls with its float values kept for the lookups (each use's ``keeps_value``). A reason
    that starts with ``"kept float"`` is one a matmul would run faster without: the leaf feeds a rewritten matmul,
    which then quantizes it on every call."""
    if not jnp.issubdtype(var.aval.dtype, jnp.floating):
        return [], f"not a float array ({var.aval.str_short()})"
    refused: list[_Refusal] = []
    uses = _uses(jaxpr, var, _Trail(config, refused, axes=tuple(range(len(var.aval.shape)))))
    if not uses:
        # a lookup's rows are an activation, which its matmuls quantize on every call anyway
        feeding = [r for r in refused if r.feeds_matmul and not (r.skipped or r.lookup)]
        if feeding:
            return [], f"kept float: {feeding[0].why}"
        skipped = [r for r in refused if r.skipped]
        if skipped:
            return [], f"float: {skipped[0].why}"
        return [], "kept float: it feeds no matmul" + (f" ({refused[0].why})" if refused else "")
    # a leaf the function returns as it is (a step returning its model or params with them) comes back from an
    # int8ify'd call quantized, in the layout it was passed in: returning it asks for no float values
    refused = [r for r in refused if not r.returned]
    if refused and all(r.lookup for r in refused):
        uses = [dataclasses.replace(use, keeps_value=True) for use in uses]
    elif refused:
        return [], f"kept float: {refused[0].why}"
    if len({u.from_end for u in uses}) > 1:
        return [], "kept float: its matmuls contract different axes"
    if len({u.casts for u in uses}) > 1:
        return [], "kept float: it is cast to different dtypes before its matmuls"
    return uses, ""
