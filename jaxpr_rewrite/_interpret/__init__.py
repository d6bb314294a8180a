"""The rewriting interpreter: the options, evaluation of a jaxpr, the per-primitive rules, how weights are followed to
their matmuls, and dots that re-quantize large arguments."""
