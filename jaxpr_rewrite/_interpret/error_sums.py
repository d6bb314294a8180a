"""The report's measured sums of one matmul, accumulated over every time it runs (loop bodies run many times).

Each is float32 ``[sum((q - f)**2) / s**2, sum(f**2) / s**2, runs, s]``: the squares are taken of values divided by
the largest magnitude ``s`` met, so outputs above ~1e19 (whose squares overflow float32) or below ~1e-19 (whose
squares flush to zero) keep their error, which is scale-invariant (LAPACK's nrm2 does the same).
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["ERR", "REF", "RUNS", "SCALE", "add", "measured_sums", "zeros"]

ERR, REF, RUNS, SCALE = range(4)


def zeros(paths) -> dict:
    """Empty sums for the matmuls at ``paths``."""
    return {p: jnp.zeros((4,), jnp.float32) for p in paths}


def measured_sums(quantized, reference):
    """The sums of one run of a matmul: ``quantized`` its int8 result, ``reference`` its float one (float32)."""
    diff = quantized - reference
    magnitudes = jnp.concatenate([jnp.abs(reference).ravel(), jnp.abs(diff).ravel()])
    scale = jnp.max(jnp.where(jnp.isfinite(magnitudes), magnitudes, 0), initial=0)
    divisor = jnp.where(scale > 0, scale, 1)
    return jnp.stack([jnp.sum(jnp.square(diff / divisor)), jnp.sum(jnp.square(reference / divisor)),
                      jnp.float32(1), scale])


def _combine(a, b):
    """The sums of two sets of runs together, brought to the larger scale."""
    scale = jnp.maximum(a[SCALE], b[SCALE])
    divisor = jnp.where(scale > 0, scale, 1)
    ratio_a, ratio_b = jnp.square(a[SCALE] / divisor), jnp.square(b[SCALE] / divisor)
    return jnp.stack([a[ERR] * ratio_a + b[ERR] * ratio_b, a[REF] * ratio_a + b[REF] * ratio_b,
                      a[RUNS] + b[RUNS], scale])


def add(a: dict, b: dict) -> dict:
    """The sums of ``a`` with those of ``b`` added in (paths only in ``b`` are left out)."""
    return {p: _combine(a[p], b[p]) if p in b else a[p] for p in a}
