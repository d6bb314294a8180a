"""One rewritten dot: its operands quantized, the int8 dot, the scale epilogue, a KV cache's values with their scales
folded into the other operand, ragged dots, straight-through gradients, and the seed problem's ``int8_matmul``."""
