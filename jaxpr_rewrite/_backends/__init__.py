"""What a float dot becomes: the int8 contract (``int8``, ``int8-fused``) and the block-scaled fp8/fp4 formats of
``jax.nn.scaled_matmul`` (``mxfp8``, ``nvfp4``, ``auto``), each registered with
:func:`~jaxpr_rewrite.register_backend`."""
