"""Quantized params as Orbax checkpoints: :func:`save_quantized`, :func:`load_quantized`, :func:`sharded_like`."""

from ._io.checkpoint import load_quantized, save_quantized, sharded_like

__all__ = ["load_quantized", "save_quantized", "sharded_like"]
