"""One equation-by-equation evaluator for jaxprs, shared by the rewrite, the report and ``quantize_params``.

:func:`evaluate` walks a jaxpr in program order and hands each equation to a *step* function (by default
:func:`bind`: the primitive applied again, under the current trace). It does the two things every such
interpreter needs and is easy to forget:

* new equations inherit the source line, name scope and context of the equation they come from, so a traced
  rewritten program still points at the user's code (as ``jax.core.eval_jaxpr`` does);
* a value is dropped as soon as its last reader has run, so an eager walk over a real model does not keep
  every intermediate alive.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import jax.extend  # noqa: F401  (makes jax.extend.core importable)
from jax.extend import source_info_util
from jax.extend.core import Jaxpr, Literal, Var

from .. import _compat

__all__ = ["Step", "bind", "equation_context", "evaluate"]

Step = Callable[[object, list], list]
"""``step(eqn, invals) -> outvals``: what to do for one equation (``invals`` are the operand values)."""


def bind(eqn, invals: Sequence, params: dict | None = None) -> list:
    """Apply ``eqn``'s primitive to ``invals`` under the current trace (with ``params`` instead of its own,
    when given). Returns a list of outputs, one per output variable."""
    out = _compat.bind(eqn.primitive, invals, eqn.params if params is None else params)
    return list(out) if eqn.primitive.multiple_results else [out]


def equation_context(eqn) -> contextlib.ExitStack:
    """A context in which new equations inherit ``eqn``'s source line, name scope and context manager."""
    stack = contextlib.ExitStack()
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    stack.enter_context(source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack))
    stack.enter_context(eqn.ctx.manager)
    return stack


def _last_reads(jaxpr: Jaxpr) -> list[list]:
    """For each equation, the variables it reads for the last time (outputs of the jaxpr excluded)."""
    keep = {v for v in jaxpr.outvars if isinstance(v, Var)}
    seen: set = set()
    last: list[list] = [[] for _ in jaxpr.eqns]
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        for v in jaxpr.eqns[i].invars:
            if isinstance(v, Var) and v not in seen and v not in keep:
                seen.add(v)
                last[i].append(v)
    return last


def evaluate(jaxpr: Jaxpr, consts: Sequence, args: Sequence, step: Step = bind, *, with_reader: bool = False) -> list:
    """Evaluate ``jaxpr`` on ``args`` equation by equation, calling ``step`` for each.

    Arguments:
        jaxpr: the program (an open ``Jaxpr``).
        consts: values of its constvars.
        args: values of its invars; any Python objects the step function understands (tracers, arrays, or
            wrapped values such as :class:`~jaxpr_rewrite.quantized.QuantizedArray`).
        step: ``step(eqn, invals) -> outvals``, run inside :func:`equation_context` of ``eqn``.
        with_reader: call ``step(eqn, invals, read)`` instead, ``read(atom)`` giving the value of any variable
            computed so far that a later equation or the result still reads (for a step that computes later
            equations together with this one).

    Returns:
        The values of its outvars.
    """
    env: dict = {}

    def read(atom):
        return atom.val if isinstance(atom, Literal) else env[atom]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn, dead in zip(jaxpr.eqns, _last_reads(jaxpr)):
        invals = [read(v) for v in eqn.invars]
        with equation_context(eqn):
            outs = step(eqn, invals, read) if with_reader else step(eqn, invals)
        for v in dead:
            env.pop(v, None)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]
