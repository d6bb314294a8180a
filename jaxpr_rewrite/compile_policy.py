"""How the programs many call sites share are compiled (the rewritten dots, the report's measurements)."""

from __future__ import annotations

import jax

from . import _compat

__all__ = ["inlined_late", "shared_jit"]


def inlined_late() -> bool:
    """Whether the programs :func:`shared_jit` makes are inlined late on the default backend (CPU, JAX 0.11+)."""
    return jax.default_backend() == "cpu" and _compat.can_inline_late()


def shared_jit(fn, **jit_kwargs):
    """``jax.jit(fn)`` for a program that many call sites share (one per layer of a model).

    On CPU, where JAX 0.11+ can say so (``jax.Inline.XLA_LATE``), XLA inlines its calls late instead of first,
    optimizing each call's body as a small computation of its own: about half the compile time of a deep model's
    first call, and as fast or faster to run (``benchmarks/overhead.py``, ``benchmarks/speed.py``). Other backends
    keep XLA's default early inlining, which lets the epilogue fuse with what follows; the late form has not been
    measured on a GPU.
    """
    early = jax.jit(fn, **jit_kwargs)
    late = _compat.jit_inlined_late(fn, **jit_kwargs)
    if late is None:
        return early

    def call(*args):
        return (late if inlined_late() else early)(*args)

    call.__name__ = call.__qualname__ = fn.__name__
    return call
