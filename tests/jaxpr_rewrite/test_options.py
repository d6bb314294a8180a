"""The rewrite options: which dots are rewritten (skip patterns, skip_if, min_contracting_size) and how
(per-tensor scales, sub-channel blocks), each against the independent numpy reference."""

import jax
import numpy as np
import pytest

from helpers import (
    assert_close_to_reference,
    away_from_ties,
    away_from_ties_blocks,
    float_dot_eqns,
    program_dots,
    reference_block_matmul,
    reference_dot,
    reference_per_tensor_matmul,
)
from jaxpr_rewrite import Int8ifyError, int8ify

MATMUL = (((1,), (0,)), ((), ()))
rng = np.random.default_rng(0)
X = away_from_ties(rng.normal(size=(4, 32)), (1,))
W1 = away_from_ties(rng.normal(size=(32, 16)), (0,))
W2 = away_from_ties(rng.normal(size=(16, 8)), (0,))


def two_layers(x, w1, w2):
    with jax.named_scope("encoder"):
        with jax.named_scope("attention"):
            h = x @ w1
    with jax.named_scope("mlp"):
        return h, h @ w2


def _split_dots(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    floats = float_dot_eqns(jaxpr)
    ints = [e for e in program_dots(jaxpr) if e not in floats]
    return floats, ints


def test_skip_by_scope_pattern_keeps_matching_dots_float():
    f = int8ify(two_layers, skip=["*attention*"])
    floats, ints = _split_dots(f, X, W1, W2)
    assert [e.outvars[0].aval.shape for e in floats] == [(4, 16)]  # the attention dot
    assert len(ints) == 1 and str(ints[0].outvars[0].aval.dtype) == "int32"
    h, y = f(X, W1, W2)
    # the skipped dot is the float dot: float32 rounding only, not int8's ~1e-2
    want = X.astype(np.float64) @ W1.astype(np.float64)
    np.testing.assert_allclose(np.asarray(h, np.float64), want, rtol=1e-5, atol=1e-5)
    h64 = np.asarray(h)
    assert_close_to_reference(y, reference_dot(h64, W2, MATMUL))


def test_skip_pattern_sees_the_full_nested_scope():
    """Scopes nest across jit boundaries: the pattern matches 'encoder/attention', not just 'attention'."""
    inner = jax.jit(lambda x, w: x @ w)

    def f(x, w1):
        with jax.named_scope("encoder"):
            with jax.named_scope("attention"):
                return inner(x, w1)

    assert len(_split_dots(int8ify(f, skip="encoder/attention*"), X, W1)[0]) == 1
    assert len(_split_dots(int8ify(f, skip="attention*"), X, W1)[0]) == 0


@pytest.mark.parametrize("scope", ["MultiHeadDotProductAttention_0", "MultiheadAttention", "self_attention"])
def test_skip_patterns_ignore_case_as_frameworks_capitalise_differently(scope):
    """Flax names its attention module's scope MultiHeadDotProductAttention_0, Equinox MultiheadAttention: the
    README's skip=["*attention*"] matched neither (case-sensitive), silently."""
    def f(x, w1, w2):
        with jax.named_scope("Block_0"):
            with jax.named_scope(scope):
                h = x @ w1
            return h @ w2

    for pattern in ("*attention*", "*ATTENTION*", "block_0/*Attention*"):
        floats, ints = _split_dots(int8ify(f, skip=[pattern]), X, W1, W2)
        assert [e.outvars[0].aval.shape for e in floats] == [(4, 16)] and len(ints) == 1, pattern


def test_skip_if_predicate_on_the_equation():
    seen = []

    def keep_narrow(eqn):
        seen.append(eqn.primitive.name)
        return eqn.outvars[0].aval.shape[-1] == 8

    floats, ints = _split_dots(int8ify(two_layers, skip_if=keep_narrow), X, W1, W2)
    assert set(seen) == {"dot_general"}
    assert [e.outvars[0].aval.shape for e in floats] == [(4, 8)]
    assert len(ints) == 1


def test_min_contracting_size():
    # contractions: 32 (x @ w1) and 16 (h @ w2)
    floats, ints = _split_dots(int8ify(two_layers, min_contracting_size=17), X, W1, W2)
    assert [e.invars[0].aval.shape[-1] for e in floats] == [16]
    assert len(ints) == 1
    floats, ints = _split_dots(int8ify(two_layers, min_contracting_size=16), X, W1, W2)
    assert floats == [] and len(ints) == 2


def test_per_tensor_matches_reference():
    x = away_from_ties(rng.normal(size=(5, 24)), (0, 1))
    w = away_from_ties(rng.normal(size=(24, 6)), (0, 1))
    x[2] = 0.0
    w[:, 3] = 0.0
    f = int8ify(lambda a, b: a @ b, granularity="per-tensor")
    got = jax.jit(f)(x, w)
    assert_close_to_reference(got, reference_per_tensor_matmul(x, w))
    # one scale per operand: the scale arrays in the program are scalars
    (dot,) = program_dots(jax.make_jaxpr(f)(x, w))
    assert [str(v.aval.dtype) for v in dot.invars] == ["int8", "int8"]


@pytest.mark.parametrize("k, block", [(40, 16), (32, 8)])  # padded tail / exact blocks
def test_block_size_matches_reference(k, block):
    x = away_from_ties_blocks(rng.normal(size=(3, k)), 1, block)
    w = away_from_ties_blocks(rng.normal(size=(k, 5)), 0, block)
    w[:block, 2] = 0.0  # an all-zero block of one column: scale 1, zero partial sum
    f = int8ify(lambda a, b: a @ b, block_size=block)
    got = np.asarray(jax.jit(f)(x, w), np.float64)
    want, magnitude = reference_block_matmul(x, w, block)
    # float32 scaling of each block, then a float32 sum of the blocks: a few ulps of the terms' magnitude
    np.testing.assert_array_less(np.abs(got - want), 4e-7 * magnitude + 1e-30)
    dots = program_dots(jax.make_jaxpr(f)(x, w))
    assert len(dots) == 1 and str(dots[0].outvars[0].aval.dtype) == "int32"
    n_blocks = -(-k // block)
    assert n_blocks in dots[0].invars[0].aval.shape  # the blocks are one batch dim of a single int8 dot


def test_block_size_larger_than_contraction_is_per_channel():
    got = jax.jit(int8ify(lambda a, b: a @ b, block_size=128))(X, W1)
    assert_close_to_reference(got, reference_dot(X, W1, MATMUL), rtol=1e-6)


@pytest.mark.parametrize(
    "options, names",
    [
        (dict(granularity="per-row"), "granularity"),
        (dict(block_size=0), "block_size"),
        (dict(block_size=2.5), "block_size"),
        (dict(block_size=64, granularity="per-tensor"), "block_size"),
        (dict(min_contracting_size=-1), "min_contracting_size"),
        (dict(skip=[3]), "skip"),
        (dict(skip=None), "skip"),
        (dict(skip=3), "skip"),
        (dict(skip_if="big"), "skip_if"),
        (dict(static_argnames=1), "static_argnames"),
        (dict(static_argnums="x"), "static_argnums"),
        (dict(static_argnames=("nope",)), "static_argnames contains 'nope'"),
        (dict(backend="fp8"), "backend"),
        (dict(skipp=["*"]), "skipp"),
    ],
)
def test_invalid_options_name_the_option(options, names):
    with pytest.raises(Int8ifyError, match=names):
        int8ify(lambda a, b: a @ b, **options)
