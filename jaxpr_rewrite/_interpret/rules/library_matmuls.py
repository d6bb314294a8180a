"""Primitives that compute float matmuls where no jaxpr rewrite reaches them (JX105): their equation is an error that
says what to call instead (unless a ``skip`` pattern keeps it float on purpose), and ``verify`` reports it; the lint
plugin flags the cuDNN attention call.

* cuDNN's fused attention, ``jax.nn.dot_product_attention(implementation="cudnn")``: its two matmuls (and, in a
  gradient program, their derivatives) run in float, or float8, inside one cuDNN call. The XLA implementation
  computes them as einsums, which int8ify rewrites.
* ``jax.experimental.sparse``: a matmul with a sparse operand (``BCOO``, ``BCSR``, the low-level COO/CSR
  products) is one primitive over the stored values and their indices. A dense operand (``.todense()``) makes it a
  ``dot_general``, which int8ify rewrites.
* ``Exported.call``: a ``jax.export``'ed program is StableHLO, not a jaxpr; one whose module holds float matmuls
  keeps them. Exporting the int8ified function instead gives one of int8 dots only, which passes.
"""

from __future__ import annotations

import re

import jax.numpy as jnp

from .registry import register

__all__ = []

# a StableHLO matmul's operand types, and an integer element type (i8, i32, ui8, ...)
_MODULE_MATMUL = re.compile(r"stablehlo\.(?:dot_general|dot) .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)")
_INTEGER_TENSOR = re.compile(r"[<x]u?i\d+>$")


def _on_float_operands(what: str):
    """``hides(eqn)``: ``what`` when an operand is floating (a matmul of integers is not the rewrite's)."""

    def hides(eqn):
        return what if any(jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.invars) else None

    return hides


def _exported_float_matmuls(eqn):
    """What a ``call_exported`` equation is, when its module holds a float matmul."""
    floats = [pair for pair in _MODULE_MATMUL.findall(eqn.params["exported"].mlir_module())
              if not all(_INTEGER_TENSOR.search(t) for t in pair)]
    if not floats:
        return None
    return (f"calls a jax.export'ed program (Exported.call) whose module holds {len(floats)} float matmul(s) "
            f"(the first: {' x '.join(floats[0])}), out of int8ify's reach")


register(
    "dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper",
    "dot_product_attention_fp8_fwd_wrapper", "dot_product_attention_fp8_bwd_wrapper",
    hides_matmuls=_on_float_operands("is cuDNN's fused attention (jax.nn.dot_product_attention("
                                     "implementation='cudnn')), whose matmuls run in float inside cuDNN, out of "
                                     "int8ify's reach"),
)

register(
    "bcoo_dot_general", "bcoo_dot_general_sampled", "bcoo_spdot_general", "bcsr_dot_general",
    "coo_matvec", "coo_matmat", "csr_matvec", "csr_matmat",
    hides_matmuls=_on_float_operands("is a matmul with a jax.experimental.sparse operand, computed in float over "
                                     "its stored values, out of int8ify's reach"),
)

register("call_exported", hides_matmuls=_exported_float_matmuls)
