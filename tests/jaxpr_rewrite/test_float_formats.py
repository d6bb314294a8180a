"""The widening of bfloat16 and float16 operands to float32 (``float_formats.widened``, taken by ``to_compute``):
the exact conversion for every bit pattern, also where XLA:GPU would drop a ``float32 -> float16 -> float32``
pair of conversions (``xla_allow_excess_precision``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import assert_same_bits_but_nan, evaluate_as
from jaxpr_rewrite._numerics.float_formats import widened
from jaxpr_rewrite._numerics.quantize import to_compute

NARROW = [np.dtype(np.float16), np.dtype(jnp.bfloat16)]
EVERY_BIT_PATTERN = np.arange(2**16, dtype=np.uint32).astype(np.uint16)


@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_widening_is_the_exact_conversion_for_every_bit_pattern(dtype):
    """All 65,536 values: zeros of both signs, float16's subnormals (2**-24 to 2**-14, normal float32 values),
    normal values, Inf and NaN (NaN stays NaN). bfloat16's subnormals are float32's: a TPU, whose float32 has none,
    reads them as zero, as it reads a float32 subnormal input (README)."""
    narrow = EVERY_BIT_PATTERN.view(dtype)
    results = [jax.jit(widened)(narrow), widened(jnp.asarray(narrow)), jax.jit(to_compute)(narrow)]
    want = narrow.astype(np.float32)
    if jax.default_backend() == "tpu":
        subnormal = (want != 0) & (np.abs(want) < np.finfo(np.float32).tiny)
        assert all((np.asarray(got)[subnormal] == 0).all() for got in results)
        results, want = [np.asarray(got)[~subnormal] for got in results], want[~subnormal]
    for got in results:
        assert_same_bits_but_nan(got, want)


@pytest.mark.parametrize("dtype", NARROW, ids=str)
@given(values=st.lists(st.floats(width=32), min_size=1, max_size=64))
def test_a_float32_value_cast_down_is_widened_from_its_rounded_value_under_gpu_excess_precision(dtype, values):
    """What a model's ``w.astype(float16)`` before its dot hands the quantizer, with XLA:GPU's removal of
    conversion pairs done on the CPU: the float16 (bfloat16) value, not the float32 one."""
    wide = np.asarray(values, np.float32)
    with np.errstate(over="ignore"):
        want = wide.astype(dtype).astype(np.float32)
    (got,) = evaluate_as("cuda", lambda v: to_compute(v.astype(dtype)), wide, excess_precision=True)
    assert_same_bits_but_nan(got, want)
