"""Quantized pytrees on disk: Orbax checkpoints and SafeTensors files."""
