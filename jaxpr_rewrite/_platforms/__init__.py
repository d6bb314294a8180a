"""One module per platform, each a :class:`~jaxpr_rewrite._core.platforms.Platform` registered on import: XLA:CPU
(:mod:`.cpu`), XLA's GPU compiler (:mod:`.gpu`: CUDA and ROCm, with the fused Pallas kernels of :mod:`.fused_gpu_dot`)
and XLA:TPU (:mod:`.tpu`, with the layout constraint of :mod:`.tpu_layout` and the KV cache's scale writer of
:mod:`.tpu_cache_write`)."""

from . import cpu, gpu, tpu  # noqa: F401  (each registers its platform)
