"""``report``: one row per ``dot_general`` of a program -- where it comes from, what it multiplies, whether
the rewrite turns it into int8 (and why not), and, given real inputs, how much accuracy int8 costs there.

The report traces the function (``jax.make_jaxpr``, nothing runs), asks the :class:`~.rewrite.Rewriter` which
float dots it rewrites under the function's options, and lists every dot of the traced program, the ones in
nested jaxprs (``jit``, ``scan``, ``cond``, ``while_loop``, ``remat``, ``custom_jvp``/``custom_vjp``, ...)
included. Integer dots are listed too (they are left as they are).

When the inputs are concrete arrays, the float program is evaluated once by an interpreter that records the
operands of every dot; each float dot is then computed both ways on those operands and its *measured error*
is ``||int8 - float||_F / ||float||_F``. Dots inside ``jit``/``pjit``, ``closed_call``, ``remat``,
``custom_jvp``/``custom_vjp`` (their primal), the taken branch of ``cond``, and the bodies of ``scan`` and
``while_loop`` (every iteration; the error is over all iterations together) are measured; a dot in a branch
that was not taken, in a loop that ran zero times, or inside another higher-order primitive (e.g.
``shard_map``) gets a note such as ``n/a (inside shard_map)`` instead.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.extend  # noqa: F401
import numpy as np
from jax import lax
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxprs_in_params

from .api import Int8ified, int8ify
from .params import is_quantized
from .rewrite import Rewriter, is_float_dot, join_scope, rewrite_dot, skip_reason

__all__ = ["DotRow", "Report", "report", "source_location", "trace"]

_SUMMARY = re.compile(r"^(?P<file>.*?):(?P<line>\d+)(?::\d+)? \((?P<function>[^()]*)\)$")


def source_location(eqn) -> tuple[str | None, int | None, str | None]:
    """``(file, line, function)`` of the user code that created ``eqn`` (``None``s when unknown)."""
    summary = source_info_util.summarize(eqn.source_info)
    match = _SUMMARY.match(summary)
    if match is None:
        return None, None, None
    return match["file"], int(match["line"]), match["function"]


def short_path(path: str | None) -> str:
    """``path`` relative to the working directory when it lies below it, else its base name."""
    if not path:
        return "?"
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return os.path.basename(path)
    return os.path.basename(path) if rel.startswith("..") else rel


def _format_dims(dimension_numbers) -> str:
    (lc, rc), (lb, rb) = dimension_numbers
    return f"(({list(lc)}, {list(rc)}), ({list(lb)}, {list(rb)}))"


@dataclasses.dataclass(frozen=True)
class DotRow:
    """One ``dot_general`` of the program.

    Attributes:
        index: position in the report (program order, nested jaxprs in place).
        file, line, function: the user's source of the dot (``None`` when unknown).
        scope: its full name scope (``jax.named_scope`` / module path, nested scopes joined by ``/``).
        lhs, rhs, out: operand and result types in jaxpr notation (``f32[8,64]``).
        dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.
        rewritten: whether the rewrite computes it in int8.
        reason: why it is not rewritten (``"integer dot"``, a skip option), ``None`` when it is.
        error: measured relative Frobenius error of the int8 result against the float result on the same
            operands (``None`` when not measured). For a float dot that an option keeps in float, it is the
            error rewriting it *would* cost.
        note: why ``error`` is missing when inputs were concrete (e.g. ``"n/a (branch not taken)"``).
        path: position in the nested program (equation and sub-jaxpr indices), identifying the dot.
        eqn: the ``dot_general`` equation itself.
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
    reason: str | None
    error: float | None = None
    note: str | None = None
    path: tuple = dataclasses.field(default=(), repr=False, compare=False)
    eqn: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def source(self) -> str:
        """``file:line (function)``, the file relative to the working directory when below it."""
        if self.line is None:
            return "?"
        return f"{short_path(self.file)}:{self.line} ({self.function})"


_COLUMNS = ("#", "source", "scope", "operands", "dimension numbers", "int8", "error", "why not")


class Report:
    """The rows of :func:`report`: iterable, indexable, and printable as an aligned table."""

    def __init__(self, rows: Sequence[DotRow], measured: bool):
        self.rows = list(rows)
        self.measured = measured

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
        """The dots that are not rewritten (skipped float dots and integer dots)."""
        return [r for r in self.rows if not r.rewritten]

    def worst(self) -> DotRow | None:
        """The rewritten dot with the largest measured error."""
        measured = [r for r in self.rewritten if r.error is not None]
        return max(measured, key=lambda r: r.error) if measured else None

    def _cells(self, row: DotRow) -> tuple[str, ...]:
        if row.error is not None:
            error = f"{row.error:.2e}"
        elif self.measured and row.note:
            error = row.note
        else:
            error = "-"
        return (
            str(row.index),
            row.source,
            row.scope or "-",
            f"{row.lhs} x {row.rhs} -> {row.out}",
            _format_dims(row.dimension_numbers),
            "yes" if row.rewritten else "no",
            error,
            row.reason or "",
        )

    def summary(self) -> str:
        n_float = sum(1 for r in self.rows if r.reason != "integer dot")
        n_int = len(self.rows) - n_float
        text = f"{len(self.rows)} dot_general(s): {len(self.rewritten)} rewritten to int8"
        text += f", {n_float - len(self.rewritten)} kept in float, {n_int} integer"
        worst = self.worst()
        if worst is not None:
            text += f"; largest int8 error {worst.error:.2e} at #{worst.index} ({worst.source})"
        return text

    def __str__(self) -> str:
        table = [_COLUMNS] + [self._cells(r) for r in self.rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(_COLUMNS))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table]
        return "\n".join(lines + [self.summary()])

    def __repr__(self) -> str:
        return f"<Report: {self.summary()}>"


# -- tracing ---------------------------------------------------------------------------------------------
def _placeholder(leaf):
    """A zero-strided numpy array standing for a ``jax.ShapeDtypeStruct`` (no memory, traceable)."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape)
    return leaf


def _is_concrete(leaf) -> bool:
    return not isinstance(leaf, (jax.ShapeDtypeStruct, jax.core.Tracer))


def as_int8ified(fn) -> Int8ified:
    """``fn`` itself when it is an :class:`Int8ified`, else ``int8ify(fn)`` with the default options."""
    return fn if isinstance(fn, Int8ified) else int8ify(fn)


def trace(fn, *args, **kwargs) -> tuple[Int8ified, ClosedJaxpr, list, bool]:
    """Trace the float program of ``fn`` (a function or an :class:`Int8ified`) without running it.

    Arguments may be arrays or ``jax.ShapeDtypeStruct``; non-array leaves are static, as for ``int8ify``.
    A :class:`~jaxpr_rewrite.params.QuantizedArray` stands for its dequantized value: the report shows the
    program's dots, and measures each on that value (with the dynamic path's quantization).

    Returns:
        ``(int8ified, float_jaxpr, dynamic_args, concrete)``: the wrapper that holds the options, the traced
        float program over the dynamic leaves, those leaves, and whether all of them are real values.
    """
    wrapped = as_int8ified(fn)
    args, kwargs = jax.tree_util.tree_map(
        lambda x: x.dequantize() if is_quantized(x) else x, (args, kwargs), is_leaf=is_quantized
    )
    abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves((args, kwargs)))
    args, kwargs = jax.tree_util.tree_map(_placeholder, (args, kwargs))
    key, dynamic = wrapped._split(args, kwargs)
    concrete = not abstract and all(_is_concrete(x) for x in dynamic)

    def flat_fn(*flat):
        a, k = wrapped._rebuild(key, flat)
        return jax.tree_util.tree_leaves(wrapped.fn(*a, **k))

    closed = jax.make_jaxpr(flat_fn)(*dynamic)
    return wrapped, closed, dynamic, concrete


# -- the dots of a program -------------------------------------------------------------------------------
@dataclasses.dataclass
class _Site:
    path: tuple
    eqn: Any
    scope: str
    enclosing: tuple[str, ...]  # primitive names of the enclosing higher-order equations


def _dot_sites(jaxpr: Jaxpr, scope: str = "", path: tuple = (), enclosing: tuple = ()) -> list[_Site]:
    sites = []
    for i, eqn in enumerate(jaxpr.eqns):
        eqn_scope = join_scope(scope, eqn.source_info.name_stack)
        if eqn.primitive is lax.dot_general_p:
            sites.append(_Site(path + (i,), eqn, eqn_scope, enclosing))
        for j, sub in enumerate(jaxprs_in_params(eqn.params)):
            sites += _dot_sites(sub, eqn_scope, path + (i, j), enclosing + (eqn.primitive.name,))
    return sites


# -- measuring -------------------------------------------------------------------------------------------
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "remat2": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr"}
MEASURED_PRIMITIVES = frozenset(_CALLS) | {"cond", "scan", "while"}


def _bind(eqn, invals):
    primitive = eqn.primitive
    out = primitive.bind(*invals, **primitive.get_bind_params(eqn.params))
    return list(out) if primitive.multiple_results else [out]


def _sub_index(eqn, jaxpr: Jaxpr) -> int:
    return next(j for j, sub in enumerate(jaxprs_in_params(eqn.params)) if sub is jaxpr)


def _split_closed(value):
    return (value.jaxpr, value.consts) if isinstance(value, ClosedJaxpr) else (value, [])


class _Recorder:
    """Evaluates a float program eagerly, measuring every float dot it meets (see the module docstring)."""

    def __init__(self, measure: Callable[[tuple, Any, list, Any], None]):
        self.measure = measure

    def run(self, jaxpr: Jaxpr, consts, args, path: tuple = ()) -> list:
        env: dict = {}

        def read(atom):
            return atom.val if isinstance(atom, Literal) else env[atom]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        for i, eqn in enumerate(jaxpr.eqns):
            invals = [read(v) for v in eqn.invars]
            here = path + (i,)
            name = eqn.primitive.name
            if eqn.primitive is lax.dot_general_p:
                outs = _bind(eqn, invals)
                if is_float_dot(eqn):
                    self.measure(here, eqn, invals, outs[0])
            elif name in _CALLS:
                sub, sub_consts = _split_closed(eqn.params[_CALLS[name]])
                outs = self.run(sub, sub_consts, invals, here + (_sub_index(eqn, sub),))
            elif name == "cond":
                branch = eqn.params["branches"][int(np.asarray(invals[0]))]
                outs = self.run(branch.jaxpr, branch.consts, invals[1:], here + (_sub_index(eqn, branch.jaxpr),))
            elif name == "scan":
                outs = self._scan(eqn, invals, here)
            elif name == "while":
                outs = self._while(eqn, invals, here)
            else:
                outs = _bind(eqn, invals)
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def _scan(self, eqn, invals, here):
        p = eqn.params
        length, n_consts, n_carry = p["length"], p["num_consts"], p["num_carry"]
        if length == 0:
            return _bind(eqn, invals)
        body = p["jaxpr"]
        sub_path = here + (_sub_index(eqn, body.jaxpr),)
        consts, carry, xs = invals[:n_consts], invals[n_consts:n_consts + n_carry], invals[n_consts + n_carry:]
        ys: list = [None] * length
        steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
        for t in steps:
            outs = self.run(body.jaxpr, body.consts, [*consts, *carry, *(x[t] for x in xs)], sub_path)
            carry, ys[t] = outs[:n_carry], outs[n_carry:]
        stacked = [jax.numpy.stack([y[k] for y in ys]) for k in range(len(eqn.outvars) - n_carry)]
        return [*carry, *stacked]

    def _while(self, eqn, invals, here):
        p = eqn.params
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]
        cond_consts = invals[: p["cond_nconsts"]]
        body_consts = invals[p["cond_nconsts"]: p["cond_nconsts"] + p["body_nconsts"]]
        carry = invals[p["cond_nconsts"] + p["body_nconsts"]:]
        cond_path = here + (_sub_index(eqn, cond.jaxpr),)
        body_path = here + (_sub_index(eqn, body.jaxpr),)
        while bool(self.run(cond.jaxpr, cond.consts, [*cond_consts, *carry], cond_path)[0]):
            carry = self.run(body.jaxpr, body.consts, [*body_consts, *carry], body_path)
        return carry


def _missing_note(site: _Site) -> str:
    for name in site.enclosing:
        if name not in MEASURED_PRIMITIVES:
            return f"n/a (inside {name})"
    if "cond" in site.enclosing:
        return "n/a (branch not taken)"
    return "n/a (not executed)"


def report(fn, *args, **kwargs) -> Report:
    """One row per ``dot_general`` of ``fn``'s program, with the rewrite's decision for each.

    Arguments:
        fn: an :class:`Int8ified` (``int8ify(f, **options)``: its options decide what is rewritten), or a
            plain function (reported under the default options).
        *args, **kwargs: the arguments of a call. Arrays give measured errors; ``jax.ShapeDtypeStruct``
            leaves trace only (no errors). Non-array leaves are static, as for ``int8ify``.

    Returns:
        A :class:`Report`; ``print`` it for the table.
    """
    wrapped, closed, dynamic, concrete = trace(fn, *args, **kwargs)
    config = wrapped.config
    decisions: dict = {}

    def on_dot(eqn, scope, reason):
        decisions[(id(eqn), scope)] = reason

    Rewriter(config, on_dot=on_dot).closed(closed)

    sites = _dot_sites(closed.jaxpr)
    stats: dict[tuple, list[float]] = {}

    def measure(path, eqn, invals, float_out):
        q = np.asarray(rewrite_dot(eqn, invals, config), np.float64)
        f = np.asarray(float_out, np.float64)
        acc = stats.setdefault(path, [0.0, 0.0])
        acc[0] += float(np.sum((q - f) ** 2))
        acc[1] += float(np.sum(f**2))

    if concrete:
        _Recorder(measure).run(closed.jaxpr, closed.consts, dynamic)

    rows = []
    for index, site in enumerate(sites):
        eqn = site.eqn
        if not is_float_dot(eqn):
            reason = "integer dot"
        else:
            key = (id(eqn), site.scope)
            reason = decisions[key] if key in decisions else skip_reason(eqn, config, site.scope)
        error = note = None
        if concrete and reason != "integer dot":
            if site.path in stats:
                err2, ref2 = stats[site.path]
                error = float(np.sqrt(err2 / ref2)) if ref2 > 0 else (0.0 if err2 == 0 else float("inf"))
            else:
                note = _missing_note(site)
        file, line, function = source_location(eqn)
        lhs, rhs = (v.aval.str_short(short_dtypes=True) for v in eqn.invars)
        rows.append(DotRow(
            index=index, file=file, line=line, function=function, scope=site.scope, lhs=lhs, rhs=rhs,
            out=eqn.outvars[0].aval.str_short(short_dtypes=True), dimension_numbers=eqn.params["dimension_numbers"],
            rewritten=reason is None, reason=reason, error=error, note=note, path=site.path, eqn=eqn,
        ))
    return Report(rows, measured=concrete)
