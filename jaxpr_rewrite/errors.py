"""Errors raised by the rewrite. Each names the primitive, shapes/dtypes and the user's source line."""

import jax.extend  # noqa: F401  (makes jax.extend.source_info_util importable)
from jax.extend import source_info_util


class Int8ifyError(Exception):
    """A program, or an option, that the int8 rewrite cannot handle correctly.

    Raised instead of leaving a float matmul behind or computing a wrong number.
    """


def describe_source(eqn) -> str:
    """``file:line (function)`` of the user's code that created ``eqn``."""
    return source_info_util.summarize(eqn.source_info)


def describe_operands(eqn) -> str:
    """The operand types of ``eqn`` in jaxpr notation, e.g. ``f32[8,64], bf16[64,32]``."""
    return ", ".join(v.aval.str_short() for v in eqn.invars)
