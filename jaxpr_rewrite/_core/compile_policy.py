"""How the programs many call sites share are compiled (the rewritten dots, the report's measurements)."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax

from .. import _compat
from .platforms import targeted

__all__ = ["inlined_late", "late_inlining", "shared_jit"]

# int8ify's late_inlining option for the programs traced now (None: decided by the default backend)
_late_inlining: contextvars.ContextVar = contextvars.ContextVar("late_inlining", default=None)


@contextlib.contextmanager
def late_inlining(choice: bool | None):
    """Trace :func:`shared_jit` calls under int8ify's ``late_inlining`` option: ``None`` (late on CPU), ``False``
    (never) or ``True`` (as on CPU, whatever the default backend)."""
    token = _late_inlining.set(choice)
    try:
        yield
    finally:
        _late_inlining.reset(token)


def inlined_late() -> bool:
    """Whether :func:`shared_jit` programs traced now are inlined late: where JAX can say so (0.11+), for a program
    traced for the CPU alone (:func:`~jaxpr_rewrite._core.platforms.targeted`) or as :func:`late_inlining` chose.
    Elsewhere XLA's early inlining lets reductions fuse with what produces their input (the deviceless TPU compile of
    a transformer block inlined late: 1.5x the estimated cycles)."""
    choice = _late_inlining.get()
    wanted = targeted() == ("cpu",) if choice is None else choice
    return wanted and _compat.can_inline_late()


def shared_jit(fn, early_when: Callable[..., bool] | None = None, **jit_kwargs):
    """``jax.jit(fn)`` for a program that many call sites share (one per layer of a model).

    On CPU, where JAX 0.11+ can say so (``jax.Inline.XLA_LATE``), XLA inlines its calls late instead of first,
    optimizing each call's body as a small computation of its own: about half the compile time of a deep model's
    first call (``benchmarks/overhead.py``), except for the calls ``early_when(*args)`` picks. Other backends keep
    XLA's default early inlining, which lets the epilogue fuse with what follows; the late form has not been
    measured on a GPU.

    Arguments:
        fn: the shared program.
        early_when: ``None``, or a predicate of a call's arguments: the calls it is true for keep early inlining
            (the rewritten dots that check int8 codes for NaN beside the dot run faster so).
        **jit_kwargs: passed to ``jax.jit``.
    """
    early = jax.jit(fn, **jit_kwargs)
    late = _compat.jit_inlined_late(fn, **jit_kwargs)
    if late is None:
        return early

    def call(*args):
        keep_early = not inlined_late() or (early_when is not None and early_when(*args))
        return (early if keep_early else late)(*args)

    call.__name__ = call.__qualname__ = fn.__name__
    return call
