"""Post-training quantization: weights quantized once (``quantize_params``), an int8 KV cache (``quantize_cache``),
calibration of static scales and SmoothQuant."""
