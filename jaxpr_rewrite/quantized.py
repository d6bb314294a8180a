"""Quantized arrays: :class:`QuantizedArray` (int8 or packed int4 codes with per-slice scales), :func:`is_quantized`
(a ``tree_map`` leaf test) and :func:`materialise` (the float value)."""

from ._quantized.array import QuantizedArray, is_quantized, materialise

__all__ = ["QuantizedArray", "is_quantized", "materialise"]
