"""The registry of backends: what a float dot can become, and what each one can take.

A :class:`Backend` says, as values, what it handles (pre-quantized weights, ragged dots, sibling dots), so no caller
compares backend names. Backends are registered with :func:`register_backend` (the int8 contract in
:mod:`~jaxpr_rewrite._backends.int8`, the block-scaled fp8/fp4 formats in
:mod:`~jaxpr_rewrite._backends.scaled_matmul`), and names resolved when a program is rewritten (``"auto"``) with
:func:`register_backend_alias`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

from .errors import Int8ifyError

__all__ = ["BACKENDS", "BACKEND_ALIASES", "Backend", "SiblingDots", "backend_names", "register_backend",
           "register_backend_alias", "resolve_backend_name"]


class SiblingDots(NamedTuple):
    """How a backend computes sibling dots (several ``dot_general`` s reading one activation, such as attention's
    query, key and value projections) as one program.

    Attributes:
        fits: ``fits(lhs, rhs, float_params, out_dtype, config)``, whether a dot (its operands resolved) joins its
            siblings' program.
        program: ``program(lhs, rhss, float_params, out_dtypes, config)``, the results of the fitting dots of the
            activation ``lhs`` (two or more), one per right operand.
    """

    fits: Callable
    program: Callable


@dataclasses.dataclass(frozen=True)
class Backend:
    """What one float matmul becomes under ``int8ify(backend=name)``.

    Attributes:
        name: the option value naming it.
        dot: ``dot(lhs, rhs, float_params, out_dtype, config)``, the program for one ``dot_general``
            (``float_params``: the original params as a sorted tuple of items).
        ragged_dot: ``ragged_dot(lhs, rhs, group_sizes, float_params, out_dtype, config)`` for one
            ``ragged_dot_general``, or ``None`` when the backend has no ragged rule (such a dot is an error).
        takes_prequantized: whether a pre-quantized weight (a :class:`~jaxpr_rewrite.quantized.QuantizedArray`
            with per-channel int8 codes) is passed to ``dot`` as it is; other backends get it materialised.
        sibling_dots: ``None``, or how the backend computes sibling dots of one activation as one program (each
            dot alone otherwise).
        max_symbolic_contraction: ``None``, or the bound a contraction whose length is symbolic (``jax.export``'s
            shapes) must be known to keep: the int8 backends' int32 sums are exact up to a length, and they cut a
            longer contraction into chunks only when its length is known when tracing.
    """

    name: str
    dot: Callable
    ragged_dot: Callable | None = None
    takes_prequantized: bool = False
    sibling_dots: SiblingDots | None = None
    max_symbolic_contraction: int | None = None


BACKENDS: dict[str, Backend] = {}
"""Backend name -> :class:`Backend`."""

BACKEND_ALIASES: dict[str, Callable[[], str]] = {}
"""Alias -> ``resolve() -> backend name``, resolved when a program is rewritten (``"auto"``: the best here)."""


def _check_new(name: str) -> None:
    if name in BACKENDS or name in BACKEND_ALIASES:
        raise Int8ifyError(f"backend {name!r} is already registered; a backend is registered once")


def register_backend(name: str, *, ragged_dot: Callable | None = None, takes_prequantized: bool = False,
                     sibling_dots: SiblingDots | None = None, max_symbolic_contraction: int | None = None):
    """Decorator: ``@register_backend(name)`` registers ``dot(lhs, rhs, float_params, out_dtype, config)`` as
    ``int8ify(backend=name)``.

    Arguments:
        name: the option value.
        ragged_dot, takes_prequantized, sibling_dots, max_symbolic_contraction: what else the backend can take,
            and its bounds (see :class:`Backend`).

    Returns:
        The decorator; it returns the decorated function unchanged.

    Raises:
        Int8ifyError: ``name`` is already registered.
    """

    def decorate(dot: Callable) -> Callable:
        _check_new(name)
        BACKENDS[name] = Backend(name, dot, ragged_dot, takes_prequantized, sibling_dots, max_symbolic_contraction)
        return dot

    return decorate


def register_backend_alias(name: str):
    """Decorator: ``@register_backend_alias(name)`` registers ``resolve() -> backend name`` as
    ``int8ify(backend=name)``, resolved when a program is rewritten.

    Raises:
        Int8ifyError: ``name`` is already registered.
    """

    def decorate(resolve: Callable[[], str]) -> Callable[[], str]:
        _check_new(name)
        BACKEND_ALIASES[name] = resolve
        return resolve

    return decorate


def backend_names() -> list[str]:
    """Every name ``int8ify(backend=...)`` accepts, sorted."""
    return sorted([*BACKENDS, *BACKEND_ALIASES])


def resolve_backend_name(name: str) -> str:
    """The backend ``name`` stands for on this machine (an alias resolved, a backend's own name kept)."""
    alias = BACKEND_ALIASES.get(name)
    return alias() if alias is not None else name
