"""The backend registry: a backend says what it can take (pre-quantized weights, ragged dots) as values, and a
name is registered once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxpr_rewrite import Int8ifyError, QuantizationWarning, int8ify, quantize_params, register_backend
from jaxpr_rewrite._core.backends import BACKENDS, Backend
from jaxpr_rewrite._quantized.array import is_quantized

rng = np.random.default_rng(11)


def test_a_backend_name_is_registered_once():
    int8 = BACKENDS["int8"]
    with pytest.raises(Int8ifyError, match="backend 'int8' is already registered"):
        register_backend("int8")(lambda lhs, rhs, float_params, out_dtype, config: lhs)
    with pytest.raises(Int8ifyError, match="backend 'auto' is already registered"):
        register_backend("auto")(lambda lhs, rhs, float_params, out_dtype, config: lhs)
    assert BACKENDS["int8"] is int8


@pytest.mark.parametrize("takes_prequantized", [True, False])
def test_a_backend_gets_pre_quantized_weights_only_when_it_says_it_takes_them(monkeypatch, takes_prequantized):
    """A float-dot backend that records its rhs: with ``takes_prequantized`` the codes of ``quantize_params``
    arrive as a QuantizedArray; without, the weight arrives materialised (and quantize_params keeps it float)."""
    seen = []

    def recording_dot(lhs, rhs, float_params, out_dtype, config):
        # a pre-quantized weight arrives whole: the int8 backends' leaner operand is theirs alone
        seen.append(is_quantized(rhs) and rhs.scales is not None and rhs.exponents is not None)
        rhs = rhs.dot_value() if is_quantized(rhs) else rhs
        return lax.dot_general(lhs, rhs, dict(float_params)["dimension_numbers"]).astype(out_dtype)

    monkeypatch.setitem(BACKENDS, "recording", Backend("recording", recording_dot,
                                                       takes_prequantized=takes_prequantized))
    x = rng.normal(size=(16, 128)).astype(np.float32)
    w = rng.normal(size=(128, 64)).astype(np.float32)
    f = int8ify(lambda w, x: x @ w, backend="recording")
    if takes_prequantized:
        qw = quantize_params(f, w, x)
    else:
        with pytest.warns(QuantizationWarning, match="per-channel int8"):
            qw = quantize_params(f, w, x)
    assert is_quantized(qw) == takes_prequantized
    got = np.asarray(f(qw, x), np.float64)
    assert seen == [takes_prequantized]
    # the backend's float dot, in float64, of the weight value it was handed
    weight = np.asarray(qw.dot_value(), np.float64) if takes_prequantized else w.astype(np.float64)
    np.testing.assert_allclose(got, x.astype(np.float64) @ weight, rtol=1e-5, atol=1e-4)


def test_a_ragged_dot_under_a_backend_without_a_ragged_rule_is_an_error():
    x = jnp.ones((64, 64))
    w = jnp.ones((4, 64, 32))
    group_sizes = jnp.array([16, 16, 16, 16], jnp.int32)
    assert BACKENDS["mxfp8"].ragged_dot is None and BACKENDS["int8"].ragged_dot is not None
    f = int8ify(lambda x, w, g: lax.ragged_dot(x, w, g), backend="mxfp8")
    with pytest.raises(Int8ifyError, match=r"backend 'mxfp8' has no ragged_dot_general rule"):
        jax.make_jaxpr(f)(x, w, group_sizes)
