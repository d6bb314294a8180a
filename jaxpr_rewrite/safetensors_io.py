"""Quantized params as one SafeTensors file: :func:`save_safetensors`, :func:`load_safetensors`."""

from ._io.safetensors_io import LAYOUT_KEY, load_safetensors, save_safetensors

__all__ = ["LAYOUT_KEY", "load_safetensors", "save_safetensors"]
