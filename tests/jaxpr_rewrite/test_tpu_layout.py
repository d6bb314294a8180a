"""The layout rule for XLA:TPU's int8 dot operands (jaxpr_rewrite/tpu_layout.py): which operands it lays out and how,
that only a TPU program carries it (lowered here for a TPU without one), that jax.export leaves it out, and that it
goes along with its operand through vmap, jvp and grad without moving a number."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpr_rewrite import calibrate_activation_dots, int8ify
from jaxpr_rewrite._core import platforms
from jaxpr_rewrite._platforms.tpu_layout import dot_operand_layout

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

_CONSTRAINT = re.compile(
    r"@LayoutConstraint\(.*result_layouts = \[dense<\[([\d, ]+)\]>.*-> tensor<([\dx]+)x(f32|bf16)>")


def scores(q, k):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k)


def attention(q, k, v):
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores(q, k) / 8.0, axis=-1), v)


def constraints(lowered_text: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(shape, major_to_minor)`` of each layout constraint in a lowered program's StableHLO."""
    found = []
    for minor_to_major, shape, _ in _CONSTRAINT.findall(lowered_text):
        found.append((tuple(int(d) for d in shape.split("x")),
                      tuple(int(a) for a in minor_to_major.split(","))[::-1]))
    return found


def lowered_for(fn, args, platform: str) -> str:
    """``fn`` traced for ``platform`` (the program that platform runs) and lowered for it, as StableHLO text."""
    with platforms.target(platform):
        return jax.jit(lambda *values: fn(*values)).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("shape, batch, contracting, expected", [
    # attention's q . k and p . v at 197 tokens (a ViT's): the token axis minor, where XLA:TPU reads the codes
    ((128, 197, 6, 64), (0, 2), (3,), (0, 2, 3, 1)),
    ((128, 197, 6, 64), (0, 2), (1,), (0, 2, 3, 1)),
    # at 50 tokens the head's 64 features are the largest and stay minor: XLA's copy of the codes is the cheaper one
    ((128, 50, 6, 64), (0, 2), (3,), None),
    ((128, 50, 6, 64), (0, 2), (1,), None),
    # the probabilities (batch, heads, queries, keys) are in that layout already
    ((128, 6, 197, 197), (0, 1), (3,), None),
    # at 128 tokens every operand fills XLA's tiles and XLA makes no copy: left to XLA
    ((128, 128, 6, 64), (0, 2), (3,), None),
    ((128, 128, 6, 64), (0, 2), (1,), None),
    # a Dense layer over (batch, tokens, features): the tokens that fill no tile major, the contraction minor
    ((128, 197, 384), (), (2,), (1, 0, 2)),
    ((128, 96, 384), (), (2,), (1, 0, 2)),
    ((128, 256, 384), (), (2,), None),
    ((7, 197, 384), (), (2,), None),  # neither free axis fills a tile: the order stays
    ((197, 384), (), (1,), None),  # two axes: XLA's tiles take any order
])
def test_the_rule_lays_out_what_xla_tpu_copied(shape, batch, contracting, expected):
    assert dot_operand_layout(shape, batch, contracting) == expected


def test_a_symbolic_dim_is_left_to_xla():
    b, = jax.export.symbolic_shape("b")
    assert dot_operand_layout((b, 197, 6, 64), (0, 2), (3,)) is None


def test_a_tpu_program_lays_out_attentions_operands_and_a_cpu_program_is_the_same_as_without():
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, 197, 6, 64)) for i in range(3))
    tpu = constraints(lowered_for(int8ify(attention), (q, k, v), "tpu"))
    # q and k for the scores, the value for p . v (the probabilities are in the dot's layout already)
    assert sorted(tpu) == [((2, 197, 6, 64), (0, 2, 3, 1))] * 3, tpu
    assert constraints(lowered_for(int8ify(attention), (q, k, v), "cpu")) == []
    assert "LayoutConstraint" not in lowered_for(int8ify(attention), (q, k, v), "cuda")
    # the CPU program runs the contract's numbers: against float64 at 197 tokens
    want = np.asarray(attention(*(np.asarray(t, np.float64) for t in (q, k, v))))
    np.testing.assert_allclose(np.asarray(jax.jit(int8ify(attention))(q, k, v)), want, atol=0.05)


def test_a_dense_layer_over_tokens_has_its_activation_laid_out_and_its_weight_not():
    x = jax.random.normal(jax.random.PRNGKey(0), (128, 197, 384))
    w = jax.random.normal(jax.random.PRNGKey(1), (384, 96))
    assert constraints(lowered_for(int8ify(lambda x, w: x @ w), (x, w), "tpu")) == [((128, 197, 384), (1, 0, 2))]
    aligned = jnp.zeros((128, 256, 384))
    assert constraints(lowered_for(int8ify(lambda x, w: x @ w), (aligned, w), "tpu")) == []


def test_operands_with_static_scales_are_left_to_xla():
    """An operand with a calibrated scale: XLA's copy of its codes took less time than a float relayout (the block
    at d 768 on the chip); with dynamic scales it is laid out."""
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, 77, 6, 64)) for i in range(3))
    scales = calibrate_activation_dots(attention, q, k, v)
    assert str(scales) == "ActivationScales(1 dot(s) of 2)"  # p . v (q . k reads the program's inputs)
    laid_out = [((2, 77, 6, 64), (0, 2, 3, 1))]
    assert constraints(lowered_for(int8ify(attention, activation_scales=scales), (q, k, v), "tpu")) == laid_out * 2
    assert constraints(lowered_for(int8ify(attention), (q, k, v), "tpu")) == laid_out * 3


def test_jax_export_leaves_the_constraint_out():
    """XLA's layout constraint is no custom call jax.export can serialize: an exported program keeps XLA's
    layouts, for a TPU too."""
    q = jax.random.normal(jax.random.PRNGKey(0), (2, 197, 6, 64))
    exported = jax.export.export(jax.jit(int8ify(scores, platforms=["cpu", "tpu"])), platforms=["cpu", "tpu"])(q, q)
    assert "LayoutConstraint" not in exported.mlir_module()
    np.testing.assert_array_equal(exported.call(q, q), jax.jit(int8ify(scores))(q, q))


def test_the_constraint_goes_along_through_vmap_jvp_and_grad():
    q = jax.random.normal(jax.random.PRNGKey(0), (2, 197, 6, 64))
    k = jax.random.normal(jax.random.PRNGKey(1), (2, 197, 6, 64))
    program = int8ify(scores)
    # vmapped over an axis in the middle: the mapped axis goes major, the rule's order after it
    stacked = jnp.stack([q, k], axis=2)
    tpu = constraints(lowered_for(jax.vmap(program, in_axes=(2, None)), (stacked, k), "tpu"))
    assert ((2, 2, 197, 6, 64), (0, 1, 3, 4, 2)) in tpu, tpu
    np.testing.assert_array_equal(jax.vmap(program, in_axes=(2, None))(stacked, k),
                                  jnp.stack([program(q, k), program(k, k)]))
    # the tangent is the float dot's (straight-through); the primal the int8 program's
    primal, tangent = jax.jvp(program, (q, k), (k, q))
    np.testing.assert_array_equal(primal, program(q, k))
    np.testing.assert_allclose(tangent, scores(k, k) + scores(q, q), rtol=1e-5, atol=1e-4)
    grad = jax.grad(lambda q: program(q, k).sum())(q)
    np.testing.assert_allclose(grad, jax.grad(lambda q: scores(q, k).sum())(q), rtol=1e-5)
    # the primal of a jvp keeps the constraint (the tangent's float dot has none)
    jvp_program = lowered_for(lambda *a: jax.jvp(program, a[:2], a[2:]), (q, k, k, q), "tpu")
    assert constraints(jvp_program) == [((2, 197, 6, 64), (0, 2, 3, 1))] * 2
