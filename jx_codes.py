"""The JX codes: one table of what each code means and what to do instead.

The lint plugin's rules (``lint_plugin.rules``), ``verify``'s findings and the ``TracedValueError`` raised while
tracing (``jaxpr_rewrite``) all read their code, title and advice from here, so one cause has one code and one
piece of advice wherever it is found. This module imports neither jax nor libcst: both packages read it.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, NamedTuple

__all__ = [
    "BROADCAST_MULTIPLY_SUM",
    "CODES",
    "CONCRETIZATION",
    "CONVOLUTION",
    "DEBUG_CALLBACK",
    "FLOAT_MATMUL",
    "HIDDEN_MATMUL",
    "HOST_CALLBACK",
    "INT8_ACCUMULATOR",
    "TRACED_CONDITION",
    "Code",
]


class Code(NamedTuple):
    """One JX code.

    Attributes:
        code: ``"JXnnn"``, stable and part of the public interface.
        name: the lint rule's name (``float-matmul``).
        title: what the code flags, as one sentence (the lint rule's docstring starts with it).
        instead: what to do instead, as a clause that can follow a semicolon or a colon.
    """

    code: str
    name: str
    title: str
    instead: str


FLOAT_MATMUL = Code(
    "JX101", "float-matmul",
    "A matmul in traced code that is not an int8 x int8 matmul with an int32 accumulator.",
    "wrap the function with @int8ify or quantize both operands to int8 and pass preferred_element_type=jnp.int32",
)
INT8_ACCUMULATOR = Code(
    "JX102", "int8-accumulator",
    "An int8 x int8 matmul without preferred_element_type=jnp.int32.",
    "pass preferred_element_type=jnp.int32 (for `@`: use jnp.matmul(a, b, preferred_element_type=jnp.int32))",
)
BROADCAST_MULTIPLY_SUM = Code(
    "JX103", "broadcast-multiply-sum",
    "A matmul emulated by a broadcast multiply and a sum over an axis.",
    "use jnp.matmul/lax.dot_general on int8 operands with preferred_element_type=jnp.int32 "
    "(or jnp.einsum under @int8ify)",
)
CONVOLUTION = Code(
    "JX104", "convolution",
    "A convolution in traced code.",
    "express it as an int8 matmul over patches with preferred_element_type=jnp.int32",
)
HIDDEN_MATMUL = Code(
    "JX105", "hidden-matmul",
    "A call whose matmuls run in float inside a library kernel, out of int8ify's reach.",
    "compute the matmuls where int8ify rewrites them: jax.nn.dot_product_attention with implementation='xla' (or "
    "None), a sparse operand made dense (.todense()), a program exported from its int8ified function",
)
TRACED_CONDITION = Code(
    "JX201", "traced-condition",
    "Python control flow on a traced value.",
    "use jnp.where or lax.cond for branches, lax.while_loop/fori_loop for loops, jnp.logical_and/or/not for "
    "and/or/not, jax.experimental.checkify for asserts",
)
CONCRETIZATION = Code(
    "JX202", "concretization",
    "Forcing a traced value to a concrete Python or numpy value.",
    "keep it an array: the jax.numpy equivalent of numpy/math functions, .astype for dtypes, jnp.where or "
    "lax.cond for branches",
)
HOST_CALLBACK = Code(
    "JX301", "host-callback",
    "A host callback in traced code.",
    "compute it with jnp/lax operations",
)
DEBUG_CALLBACK = Code(
    "JX302", "debug-callback",
    "jax.debug.print, jax.debug.breakpoint or jax.debug.callback in traced code.",
    "remove it before shipping",
)

CODES: Mapping[str, Code] = MappingProxyType({c.code: c for c in (
    FLOAT_MATMUL, INT8_ACCUMULATOR, BROADCAST_MULTIPLY_SUM, CONVOLUTION, HIDDEN_MATMUL,
    TRACED_CONDITION, CONCRETIZATION,
    HOST_CALLBACK, DEBUG_CALLBACK,
)})
