"""cuDNN's fused attention, ``jax.nn.dot_product_attention(implementation="cudnn")``: its two matmuls (and, in a
gradient program, their derivatives) run in float, or float8, inside one cuDNN call, where no jaxpr rewrite reaches
them. An equation of it is an error that says to call the XLA implementation, whose einsums int8ify rewrites;
``verify`` reports it, and the lint plugin the call, as JX105."""

from __future__ import annotations

from .registry import register

__all__ = []

register(
    "dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper",
    "dot_product_attention_fp8_fwd_wrapper", "dot_product_attention_fp8_bwd_wrapper",
    hides_matmuls=("is cuDNN's fused attention (jax.nn.dot_product_attention(implementation='cudnn')), whose "
                   "matmuls run in float inside cuDNN, out of int8ify's reach"),
)
