"""Quantized arrays: :class:`~jaxpr_rewrite.QuantizedArray`, its stored layout, the stored form of a quantized pytree,
and static activation scales."""
