"""``report``: one row per matmul of a program -- where it comes from, what it multiplies, whether the rewrite
turns it into int8 (and why not), and, given real inputs, how much accuracy int8 costs there.

The report traces the function (nothing runs for that), decides for every matmul of the traced program what the
rewrite does with it under the function's options, and lists them all, the ones in nested jaxprs (``jit``,
``scan``, ``cond``, ``while_loop``, ``remat``, ``custom_jvp``/``custom_vjp``, ...) included. Integer matmuls are
listed too (they are left as they are).

When the inputs are concrete arrays, the float program is compiled once more with every float matmul also computed
the rewritten way on the same operands, and run once: each row's *measured error* is
``||int8 - float||_F / ||float||_F`` of that matmul on its actual operands (every iteration of a loop pooled).
Matmuls inside ``jit``/``pjit``, ``closed_call``, ``remat``, the primal of ``custom_jvp``/``custom_vjp``, the taken
branch of ``cond``, and the bodies of ``scan`` and ``while_loop`` are measured (loops keep running sums in their
carry); one in a branch that was not taken, a loop that ran zero times, or inside another higher-order primitive
(e.g. ``shard_map``) gets a note such as ``n/a (inside shard_map)`` instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.extend  # noqa: F401
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from .._core.compile_policy import shared_jit
from .._core.errors import Int8ifyError
from .._core.jaxprs import (derivative_jaxprs, is_float_convolution, is_float_dot, is_matmul, iter_eqns,
                            jaxpr_and_consts, matmul_dimension_numbers, sub_jaxprs)
from .._interpret.config import RewriteConfig
from .._interpret.error_sums import ERR, REF, RUNS, add, measured_sums, zeros
from .._interpret.evaluate import bind, evaluate
from .plotting import COLORS, bar_chart, new_figure, save
from .._quantized.array import is_quantized, materialise
from .._core.reasons import KeptFloat, Why
from .._interpret.rewrite import Rewriter
from .._interpret.rules import rule_for
from .._interpret.rules.dots import is_plain_dot, is_unsupported_ragged, skip_reason
from .._core.scopes import join_scope
from .._core.source import Location, eqn_location, short_path
from .._interpret.requantized import requantized_arguments
from .._tracing.tracing import leaf_paths, target_of, trace

__all__ = ["DotRow", "Report", "report"]


def _format_dims(dimension_numbers) -> str:
    (lc, rc), (lb, rb) = dimension_numbers
    return f"(({list(lc)}, {list(rc)}), ({list(lb)}, {list(rb)}))"


@dataclasses.dataclass(frozen=True)
class DotRow:
    """One matmul (``dot_general`` or ``ragged_dot_general``) of the program.

    Attributes:
        index: position in the report (program order, nested jaxprs in place).
        file, line, function: the user's source of the matmul (``None`` when unknown).
        scope: its full name scope (``jax.named_scope`` / module path, nested scopes joined by ``/``).
        lhs, rhs, out: operand and result types in jaxpr notation (``f32[8,64]``).
        dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.
        rewritten: whether the rewrite computes it in int8.
        reason: why it is not rewritten (a :class:`~jaxpr_rewrite._core.reasons.KeptFloat`: an integer dot, a skip
            option, ...; ``str()`` gives the sentence), ``None`` when it is.
        error: measured relative Frobenius error of the int8 result against the float result on the same
            operands (``None`` when not measured). For a float matmul that an option keeps in float, it is the
            error rewriting it *would* cost.
        note: why ``error`` is missing when inputs were concrete (e.g. ``"n/a (branch not taken)"``).
        primitive: ``"dot_general"`` or ``"ragged_dot_general"``.
        path: position in the nested program (equation and sub-jaxpr indices), identifying the matmul.
        eqn: the equation itself.
        requantizes: the argument (its path among the call's arguments) that the dot quantizes on every call at too
            few rows to pay for it, so it runs slower than in float
            (:class:`~jaxpr_rewrite._core.errors.RequantizationWarning`); ``None`` for every other dot.
    """

    index: int
    file: str | None
    line: int | None
    function: str | None
    scope: str
    lhs: str
    rhs: str
    out: str
    dimension_numbers: Any
    rewritten: bool
    reason: KeptFloat | None
    error: float | None = None
    note: str | None = None
    primitive: str = "dot_general"
    path: tuple = dataclasses.field(default=(), repr=False, compare=False)
    eqn: Any = dataclasses.field(default=None, repr=False, compare=False)
    requantizes: str | None = None

    @property
    def source(self) -> str:
        """``file:line (function)``, the file relative to the working directory when below it."""
        if self.line is None:
            return "?"
        return f"{short_path(self.file)}:{self.line} ({self.function})"

    @property
    def is_float(self) -> bool:
        return self.reason is None or self.reason.why is not Why.INTEGER_DOT


_COLUMNS = ("#", "source", "scope", "operands", "dimension numbers", "int8", "error", "why not")


class Report:
    """The rows of :func:`report`: iterable, indexable, and printable as an aligned table."""

    def __init__(self, rows: Sequence[DotRow], measured: bool, convolutions: Sequence[str] = ()):
        self.rows = list(rows)
        self.measured = measured
        self.convolutions = list(convolutions)  # where the program's float convolutions are: none is rewritten

    def __iter__(self) -> Iterator[DotRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    @property
    def rewritten(self) -> list[DotRow]:
        return [r for r in self.rows if r.rewritten]

    @property
    def kept(self) -> list[DotRow]:
        """The matmuls that are not rewritten (kept float ones and integer ones)."""
        return [r for r in self.rows if not r.rewritten]

    def worst(self) -> DotRow | None:
        """The rewritten matmul with the largest measured error; a NaN error (outputs holding NaN) counts as the
        largest, as Python's ``max`` would skip it."""
        measured = [r for r in self.rewritten if r.error is not None]
        return max(measured, key=lambda r: (math.isnan(r.error), r.error)) if measured else None

    def _cells(self, row: DotRow) -> tuple[str, ...]:
        if row.error is not None:
            error = f"{row.error:.2e}"
        elif self.measured and row.note:
            error = row.note
        else:
            error = "-"
        operands = f"{row.lhs} x {row.rhs} -> {row.out}"
        if not is_plain_dot(row.eqn):
            operands = f"{row.primitive}: {operands}"
        return (
            str(row.index),
            row.source,
            row.scope or "-",
            operands,
            _format_dims(row.dimension_numbers),
            "yes" if row.rewritten else "no",
            error,
            "" if row.reason is None else str(row.reason),
        )

    def summary(self) -> str:
        n_float = sum(1 for r in self.rows if r.is_float)
        n_int = len(self.rows) - n_float
        text = f"{len(self.rows)} dot_general(s): {len(self.rewritten)} rewritten to int8"
        text += f", {n_float - len(self.rewritten)} kept in float, {n_int} integer"
        worst = self.worst()
        if worst is not None:
            text += f"; largest int8 error {worst.error:.2e} at #{worst.index} ({worst.source})"
        requantizing = [r for r in self.rows if r.requantizes is not None]
        if requantizing:
            shown = ", ".join(f"#{r.index} ({r.requantizes})" for r in requantizing)
            text += (f"; {len(requantizing)} dot(s) quantize a large argument on every call and run slower than in "
                     f"float: {shown}; quantize it once (quantize_cache, quantize_params)")
        if self.convolutions:
            shown = ", ".join(self.convolutions[:3]) + (", ..." if len(self.convolutions) > 3 else "")
            text += (f"; {len(self.convolutions)} float convolution(s) not rewritten (int8ify rewrites matmuls "
                     f"only): {shown}")
        return text

    def __str__(self) -> str:
        table = [_COLUMNS] + [self._cells(r) for r in self.rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table]
        return "\n".join(lines + [self.summary()])

    def __repr__(self) -> str:
        return f"<Report: {self.summary()}>"

    def plot(self, path=None, *, title: str | None = None):
        """The measured error of every matmul as a bar chart, in program order: the place to decide what to
        ``skip``. Bars are coloured rewritten / kept in float; a kept matmul's bar is labelled with the option
        that kept it; integer and unmeasured matmuls leave an empty slot.

        Arguments:
            path: if given, the figure is also written there (PNG, SVG or PDF by suffix).
            title: the figure title (default: the report's summary line).

        Returns:
            The matplotlib ``Figure``.

        Raises:
            Int8ifyError: matplotlib is not installed, or the report holds no measured error (it was made from
                ``jax.ShapeDtypeStruct`` arguments).
        """
        if not self.measured:
            raise Int8ifyError("this report has no measured errors to plot: call report() with arrays, not "
                               "jax.ShapeDtypeStruct")
        fig, (ax,) = new_figure(width=max(6.0, 0.35 * len(self.rows) + 3), height=4.5)
        labels = [f"#{r.index} {r.scope or r.function or ''}".strip() for r in self.rows]
        colors = [COLORS["rewritten"] if r.rewritten else COLORS["kept"] if r.error is not None
                  else COLORS["not measured"] for r in self.rows]
        bar_chart(ax, labels, [r.error for r in self.rows], colors, log=True,
                  title=title or self.summary(), ylabel="relative error of int8 vs float",
                  legend={"rewritten to int8": COLORS["rewritten"], "kept in float (error if rewritten)":
                          COLORS["kept"]})
        bottom = ax.get_ylim()[0]
        for position, row in enumerate(self.rows):
            if not row.rewritten and row.error is not None:  # the option that kept it, written up the bar
                ax.text(position, bottom * 1.15, str(row.reason), rotation=90, fontsize=6, ha="center", va="bottom",
                        clip_on=True)
        if path is not None:
            save(fig, path)
        return fig


# -- the matmuls of a program, and what the rewrite does with each -------------------------------------------
@dataclasses.dataclass
class _Site:
    path: tuple
    eqn: Any
    scope: str
    enclosing: tuple[str, ...]  # primitive names of the enclosing higher-order equations
    reason: KeptFloat | None  # why it is not rewritten (None: rewritten)
    measurable: bool  # a float matmul of the forward program that the rewrite can express


def _site(eqn, path, scope, enclosing, config: RewriteConfig, derivative_only: str | None,
          no_rule: str | None) -> _Site:
    if not is_float_dot(eqn):
        return _Site(path, eqn, scope, enclosing, KeptFloat(Why.INTEGER_DOT, "integer dot"), False)
    if derivative_only is not None:
        return _Site(path, eqn, scope, enclosing,
                     KeptFloat(Why.DERIVATIVE_ONLY, f"runs only for derivatives ({derivative_only})"), False)
    reason = skip_reason(eqn, config, scope)
    if is_unsupported_ragged(eqn):
        unsupported = KeptFloat(Why.UNSUPPORTED_RAGGED, "unsupported ragged layout (int8ify raises an error)")
        return _Site(path, eqn, scope, enclosing, reason or unsupported, False)
    if no_rule is not None and reason is None:
        reason = KeptFloat(Why.NO_RULE, f"inside {no_rule}, which int8ify has no rule for (int8ify raises an error)")
    return _Site(path, eqn, scope, enclosing, reason, True)


def _sites(jaxpr: Jaxpr, config: RewriteConfig, scope: str = "", path: tuple = (), enclosing: tuple = (),
           derivative_only: str | None = None, no_rule: str | None = None) -> list[_Site]:
    """Every matmul of ``jaxpr`` in program order, nested ones included, with the rewrite's decision."""
    sites = []
    for i, eqn in enumerate(jaxpr.eqns):
        here = join_scope(scope, eqn.source_info.name_stack)
        if is_matmul(eqn):
            sites.append(_site(eqn, path + (i,), here, enclosing, config, derivative_only, no_rule))
        derivative_subs = [id(j) for j in derivative_jaxprs(eqn)]
        name = eqn.primitive.name
        for j, sub in enumerate(sub_jaxprs(eqn)):
            sub_derivative = name if id(sub) in derivative_subs else derivative_only
            sub_no_rule = no_rule if no_rule is not None or rule_for(name).rewrite is not None else name
            sites += _sites(sub, config, here, path + (i, j), enclosing + (name,), sub_derivative, sub_no_rule)
    return sites


# -- measuring ------------------------------------------------------------------------------------------------
class _Measurer:
    """Evaluates the float program under ``jax.jit`` and sums, per measured matmul, the squared error of its
    rewritten form, the squared float result, and how many times it ran; a higher-order equation holding a
    measured matmul is evaluated by its primitive's ``measure`` rule (:mod:`jaxpr_rewrite._interpret.rules`)."""

    def __init__(self, rewriter: Rewriter, measured: set):
        self.rewriter = rewriter
        self.measured = measured  # paths of the float matmuls to measure
        self.measurements: dict = {}

    def measurement(self, eqn) -> Callable:
        """``fn(*invals) -> (float result, sums)`` for one matmul, shared by every matmul with the same primitive,
        params and operand types: its program is traced once however many layers call it (see
        :func:`~jaxpr_rewrite._core.compile_policy.shared_jit` for how XLA compiles it)."""
        key = (eqn.primitive, tuple(sorted(eqn.params.items())), tuple(v.aval for v in (*eqn.invars, *eqn.outvars)),
               self.rewriter.static_dots.get(id(eqn)))
        try:
            hash(key)
        except TypeError:  # a param JAX keeps unhashable: this matmul gets a program of its own
            key = id(eqn)
        fn = self.measurements.get(key)
        if fn is None:
            def measure(*invals):
                float_out = bind(eqn, [materialise(v) for v in invals])[0]
                f32 = float_out.astype(jnp.float32)
                q32 = self.rewriter.rewrite_matmul(eqn, invals).astype(jnp.float32)
                return float_out, measured_sums(q32, f32)

            fn = self.measurements[key] = shared_jit(measure)
        return fn

    def paths_under(self, prefix: tuple) -> list:
        """The measured matmuls at or below ``prefix``."""
        return [p for p in self.measured if p[:len(prefix)] == prefix]

    def run(self, closed, args, prefix: tuple = ()) -> tuple[list, dict]:
        """``closed`` evaluated on ``args``; returns its outputs and the sums of the matmuls below ``prefix``."""
        jaxpr, consts = jaxpr_and_consts(closed)
        stats = zeros(self.paths_under(prefix))
        index = iter(range(len(jaxpr.eqns)))

        def step(eqn, invals):
            here = prefix + (next(index),)
            outs, found = self.eqn(eqn, invals, here)
            stats.update(add({p: stats[p] for p in found}, found))
            return outs

        return evaluate(jaxpr, consts, args, step), stats

    def eqn(self, eqn, invals, here) -> tuple[list, dict]:
        if here in self.measured:  # a weight with a static activation scale reaches its dot as it is
            float_out, sums = self.measurement(eqn)(*invals)
            return [float_out], {here: sums}
        invals = [materialise(v) for v in invals]
        measure = rule_for(eqn.primitive.name).measure
        if measure is not None and self.paths_under(here):
            return measure(self, eqn, invals, here)
        return bind(eqn, invals), {}


def _missing_note(site: _Site, ran_zero_times: bool) -> str:
    for name in site.enclosing:
        if rule_for(name).measure is None:
            return f"n/a (inside {name})"
    if ran_zero_times and site.enclosing and rule_for(site.enclosing[-1]).branches:
        return "n/a (branch not taken)"
    return "n/a (not executed)"


# -- entry point ------------------------------------------------------------------------------------------------
def _is_concrete(leaf) -> bool:
    return not isinstance(leaf, (jax.ShapeDtypeStruct, jax.core.Tracer))


def _as_reported(leaf):
    if is_quantized(leaf) and leaf.activation_scale is not None:
        return leaf
    return materialise(leaf)


def report(fn, *args, **kwargs) -> Report:
    """One row per matmul of ``fn``'s program, with the rewrite's decision for each.

    Arguments:
        fn: an ``int8ify``-wrapped function (its options decide what is rewritten), or a plain function
            (reported under the default options).
        *args, **kwargs: the arguments of a call. Arrays give measured errors; ``jax.ShapeDtypeStruct`` leaves
            trace only (no errors). A :class:`~jaxpr_rewrite.quantized.QuantizedArray` is reported through its
            materialised value, except one with a static activation scale: its dots are measured as the program
            runs them (its codes, and the activation quantized with that scale); so are the dots of ``fn``'s
            ``activation_scales``. Non-array leaves are static, as for ``int8ify``.

    Returns:
        A :class:`Report`; ``print`` it for the table.
    """
    function, config, signature_of = target_of(fn, "report")
    _, given = signature_of(args, kwargs)
    args, kwargs = jax.tree_util.tree_map(_as_reported, (args, kwargs), is_leaf=is_quantized)
    signature, dynamic = signature_of(args, kwargs)
    closed = trace(function, signature, dynamic).jaxpr
    paths = leaf_paths(signature)
    requantizing = {id(found.eqn): paths[found.argument] for found in requantized_arguments(
        closed.jaxpr, config, [i for i, x in enumerate(given) if not is_quantized(x)])}
    concrete = all(_is_concrete(x) for x in dynamic)
    sites = _sites(closed.jaxpr, config)

    stats: dict = {}
    if concrete:
        measured = {s.path for s in sites if s.measurable}
        if measured:
            measurer = _Measurer(Rewriter(config, closed.jaxpr), measured)
            stats = jax.jit(lambda consts, flat: measurer.run(ClosedJaxpr(closed.jaxpr, consts), flat)[1])(
                closed.consts, dynamic)
            stats = {p: np.asarray(v, np.float64) for p, v in stats.items()}

    rows = []
    for index, site in enumerate(sites):
        eqn = site.eqn
        error = note = None
        if concrete and site.measurable:
            sums = stats.get(site.path)
            if sums is not None and sums[RUNS] > 0:
                err2, ref2 = sums[ERR], sums[REF]  # both relative to the same scale, which cancels
                error = float(np.sqrt(err2 / ref2)) if ref2 > 0 else (0.0 if err2 == 0 else float("inf"))
            else:
                note = _missing_note(site, sums is not None)
        location: Location = eqn_location(eqn)
        lhs, rhs = (v.aval.str_short(short_dtypes=True) for v in eqn.invars[:2])
        rows.append(DotRow(
            index=index, file=location.file, line=location.line, function=location.function, scope=site.scope,
            lhs=lhs, rhs=rhs, out=eqn.outvars[0].aval.str_short(short_dtypes=True),
            dimension_numbers=matmul_dimension_numbers(eqn), rewritten=site.reason is None, reason=site.reason,
            error=error, note=note, primitive=eqn.primitive.name, path=site.path, eqn=eqn,
            requantizes=requantizing.get(id(eqn)),
        ))
    convolutions = [str(eqn_location(e)) for e in iter_eqns(closed.jaxpr, forward_only=True) if is_float_convolution(e)]
    return Report(rows, measured=concrete, convolutions=convolutions)
