"""The seed problem (per-channel int8 matmul): its published examples and its grader's rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from helpers import (PLATFORMS, away_from_ties, evaluate_as, is_max_reduction, iter_eqns, program_dots,
                     reference_codes, reference_scales)
from jaxpr_rewrite import int8_matmul, int8ify

SEED_EXAMPLES = [
    (
        [[1.2, 2.0, -0.9]],
        [[0.5, -0.023], [-1.27, 0.011], [0.3, 0.041]],
        {
            "w_q": [[50, -71], [-127, 34], [30, 127]],
            "w_scales": [0.01, 0.000323],
            "x_q": [[76, 127, -57]],
            "x_scales": [0.015748],
            "y": [[-2.210866, -0.042284]],
        },
    ),
    (
        [[0.0, 0.0], [0.5, 2.0]],
        [[0.8, 0.0, -0.31], [-0.45, 0.0, 0.66]],
        {
            "w_q": [[127, 0, -60], [-71, 0, 127]],
            "w_scales": [0.006299, 1.0, 0.005197],
            "x_q": [[0, 0], [32, 127]],
            "x_scales": [1.0, 0.015748],
            "y": [[0.0, 0.0, 0.0], [-0.491339, 0.0, 1.162867]],
        },
    ),
    (
        [[1.0, 1.0, 1.0, 1.0], [0.7, -0.5, 0.3, 1.2]],
        [[0.5, 0.25], [0.5, -0.25], [0.5, 0.25], [0.5, 0.1]],
        {
            "w_q": [[127, 127], [127, -127], [127, 127], [127, 51]],
            "w_scales": [0.003937, 0.001969],
            "x_q": [[127, 127, 127, 127], [74, -53, 32, 127]],
            "x_scales": [0.007874, 0.009449],
            "y": [[2.0, 0.350394], [0.850394, 0.496063]],
        },
    ),
]

jitted_int8_matmul = jax.jit(int8_matmul)


def grade(x, w, out):
    """The seed grader: exact codes, scales to 1e-6, y to 1e-6 of the float64 product of the exact sum."""
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    assert out["w_q"].dtype == jnp.int8 and out["x_q"].dtype == jnp.int8
    assert out["w_scales"].dtype == jnp.float32 and out["x_scales"].dtype == jnp.float32
    assert out["y"].dtype == jnp.float32
    assert out["w_q"].shape == w.shape and out["x_q"].shape == x.shape
    assert out["w_scales"].shape == (w.shape[1],) and out["x_scales"].shape == (x.shape[0],)
    np.testing.assert_array_equal(np.asarray(out["w_q"]), reference_codes(w, (0,)))
    np.testing.assert_array_equal(np.asarray(out["x_q"]), reference_codes(x, (1,)))
    np.testing.assert_allclose(out["w_scales"], reference_scales(w, (0,)), rtol=1e-6)
    np.testing.assert_allclose(out["x_scales"], reference_scales(x, (1,)), rtol=1e-6)
    exact = np.asarray(out["x_q"], np.int64) @ np.asarray(out["w_q"], np.int64)
    want = exact * np.asarray(out["x_scales"], np.float64)[:, None] * np.asarray(out["w_scales"], np.float64)[None, :]
    # a product below float32's normal range is 0 in float32 (XLA flushes subnormals)
    np.testing.assert_allclose(np.asarray(out["y"], np.float64), want, rtol=1e-6, atol=np.finfo(np.float32).tiny)


@pytest.mark.parametrize("x, w, expected", SEED_EXAMPLES)
def test_published_examples(x, w, expected):
    out = jitted_int8_matmul(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    for key in ("w_q", "x_q"):
        np.testing.assert_array_equal(np.asarray(out[key]), np.asarray(expected[key]))
    for key in ("w_scales", "x_scales", "y"):
        np.testing.assert_allclose(np.asarray(out[key]), np.asarray(expected[key]), rtol=2e-3, atol=1e-6)
    grade(x, w, out)


def test_structure_one_int8_dot_no_float_product():
    """The traced program holds one dot (int8 x int8 -> int32) on each platform, no other matmul, conv, callback,
    and no B x D_in x D_out sized intermediate."""
    b, d_in, d_out = 3, 5, 4
    jaxpr = jax.make_jaxpr(int8_matmul)(jnp.ones((b, d_in)), jnp.ones((d_in, d_out)))
    dots = program_dots(jaxpr)
    assert len(dots) == 1
    assert [str(v.aval.dtype) for v in dots[0].invars] == ["int8", "int8"]
    assert str(dots[0].outvars[0].aval.dtype) == "int32"
    banned = {"conv_general_dilated", "pure_callback", "io_callback", "debug_callback"}
    for eqn in iter_eqns(jaxpr):
        assert eqn.primitive.name not in banned, eqn
        for v in eqn.outvars:
            assert np.prod(v.aval.shape) < b * d_in * d_out, f"B x D_in x D_out sized value: {eqn}"


@pytest.mark.usefixtures("every_platform_programs")
def test_each_operand_is_quantized_once_on_every_platform():
    """The codes and scales returned are the ones the dot multiplied: one absmax per operand in the program each
    platform runs (a GPU's float64-scale dot included), and the GPU's program gives the CPU's outputs bit for bit."""
    jaxpr = jax.make_jaxpr(int8_matmul)(jnp.ones((8, 64)), jnp.ones((64, 16)))
    for platform in PLATFORMS:
        assert sum(map(is_max_reduction, iter_eqns(jaxpr, platform=platform))) == 2, platform
    rng = np.random.default_rng(1)
    x = np.round(rng.normal(size=(32, 256)) * 8).astype(np.float32) / 8  # ties among the codes
    w = rng.normal(size=(256, 64)).astype(np.float32)
    x[3] = 0.0
    w[:, 5] = 0.0
    on_gpu = evaluate_as("cuda", int8_matmul, x, w)
    on_cpu = jax.tree_util.tree_leaves(jitted_int8_matmul(x, w))
    for got, want in zip(on_gpu, on_cpu, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bit_identical_to_int8ify():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 64)).astype(np.float32)
    w = rng.normal(size=(64, 6)).astype(np.float32)
    y_rewrite = jax.jit(int8ify(lambda x, w: x @ w))(x, w)
    np.testing.assert_array_equal(np.asarray(jitted_int8_matmul(x, w)["y"]), np.asarray(y_rewrite))


def seed_inputs():
    """Inputs inside the seed's constraints: B, D_out in 1..6, D_in in 1..64, zero rows/columns allowed."""

    @st.composite
    def draw(draw_fn):
        b = draw_fn(st.integers(1, 6))
        d_in = draw_fn(st.sampled_from([1, 7, 64]))  # few distinct shapes: each costs a compile
        d_out = draw_fn(st.integers(1, 6))
        elements = st.floats(-4, 4, width=32, allow_subnormal=False)
        x = draw_fn(hnp.arrays(np.float32, (b, d_in), elements=elements))
        w = draw_fn(hnp.arrays(np.float32, (d_in, d_out), elements=elements))
        zero_row = draw_fn(st.integers(-1, b - 1))
        zero_col = draw_fn(st.integers(-1, d_out - 1))
        if zero_row >= 0:
            x[zero_row] = 0
        if zero_col >= 0:
            w[:, zero_col] = 0
        return away_from_ties(x, (1,)), away_from_ties(w, (0,))

    return draw()


@given(seed_inputs())
def test_grader_property(xw):
    x, w = xw
    out = jitted_int8_matmul(x, w)
    grade(x, w, out)
    # An all-zero row or column gets scale 1 and an exactly zero output.
    zero_rows = np.all(x == 0, axis=1)
    assert np.all(np.asarray(out["x_scales"])[zero_rows] == 1)
    assert np.all(np.asarray(out["y"])[zero_rows] == 0)


def test_rejects_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"\(3, 4\) and \(5, 2\)"):
        int8_matmul(jnp.ones((3, 4)), jnp.ones((5, 2)))
    with pytest.raises(TypeError, match="floating x"):
        int8_matmul(jnp.ones((3, 4), jnp.int32), jnp.ones((4, 2)))
