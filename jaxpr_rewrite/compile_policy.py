"""How the programs many call sites share are compiled (the rewritten dots, the report's measurements)."""

from __future__ import annotations

import jax

from . import _compat
from .quantized import is_quantized

__all__ = ["inlined_late", "shared_jit"]


def inlined_late(operands=()) -> bool:
    """Whether a :func:`shared_jit` program called with ``operands`` is inlined late: on CPU with JAX 0.11+,
    unless an operand is a weight with a static activation scale (:func:`shared_jit` says why)."""
    static = any(is_quantized(x) and x.static_scale is not None for x in operands)
    return jax.default_backend() == "cpu" and _compat.can_inline_late() and not static


def shared_jit(fn, **jit_kwargs):
    """``jax.jit(fn)`` for a program that many call sites share (one per layer of a model).

    On CPU, where JAX 0.11+ can say so (``jax.Inline.XLA_LATE``), XLA inlines its calls late instead of first,
    optimizing each call's body as a small computation of its own: about half the compile time of a deep model's
    first call (``benchmarks/overhead.py``). A dot with a weight's static activation scale keeps the early form,
    which ran it faster on JAX 0.12 (the MLP of ``benchmarks/peers.py`` 7% at batch 32 and 10% at batch 1, the
    MiniLM encoder 13%), and in which XLA:CPU runs the check of its activation's codes for NaN beside the dot.
    Other backends keep XLA's default early inlining, which lets the epilogue fuse with what follows; the late
    form has not been measured on a GPU.
    """
    early = jax.jit(fn, **jit_kwargs)
    late = _compat.jit_inlined_late(fn, **jit_kwargs)
    if late is None:
        return early

    def call(*args):
        return (late if inlined_late(args) else early)(*args)

    call.__name__ = call.__qualname__ = fn.__name__
    return call
