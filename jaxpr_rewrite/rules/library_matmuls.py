"""Primitives that compute float matmuls inside a library kernel, where no jaxpr rewrite reaches them (JX105): their
equation is an error that says what to call instead (unless a ``skip`` pattern keeps it float on purpose), and
``verify`` reports it; the lint plugin flags the cuDNN attention call.

* cuDNN's fused attention, ``jax.nn.dot_product_attention(implementation="cudnn")``: its two matmuls (and, in a
  gradient program, their derivatives) run in float, or float8, inside one cuDNN call. The XLA implementation
  computes them as einsums, which int8ify rewrites.
* ``jax.experimental.sparse``: a matmul with a sparse operand (``BCOO``, ``BCSR``, the low-level COO/CSR
  products) is one primitive over the stored values and their indices. A dense operand (``.todense()``) makes it a
  ``dot_general``, which int8ify rewrites.
"""

from __future__ import annotations

from .registry import register

__all__ = []

register(
    "dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper",
    "dot_product_attention_fp8_fwd_wrapper", "dot_product_attention_fp8_bwd_wrapper",
    hides_matmuls=("is cuDNN's fused attention (jax.nn.dot_product_attention(implementation='cudnn')), whose "
                   "matmuls run in float inside cuDNN, out of int8ify's reach"),
)

register(
    "bcoo_dot_general", "bcoo_dot_general_sampled", "bcoo_spdot_general", "bcsr_dot_general",
    "coo_matvec", "coo_matmat", "csr_matvec", "csr_matmat",
    hides_matmuls=("is a matmul with a jax.experimental.sparse operand, computed in float over its stored values, "
                   "out of int8ify's reach"),
)
