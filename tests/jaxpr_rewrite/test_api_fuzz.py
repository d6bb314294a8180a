"""Fuzzing the public API surface: option values of every type, static values of every kind through one cached
wrapper, and pytrees of QuantizedArray through casts, jit, grad, equinox and scan. Each drawn case either gives
the contract's numbers (against the numpy reference of ``helpers.py``) or a clear ``Int8ifyError``; any other
exception, or a wrong number, fails. Bounded by the hypothesis profile of ``tests/conftest.py``."""

import fnmatch
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

from helpers import (away_from_ties, away_from_ties_blocks, examples, reference_block_matmul, reference_dot,
                     reference_per_tensor_matmul)
from jaxpr_rewrite import ActivationScales, Int8ifyError, int8ify, quantize_params
from jaxpr_rewrite._quantized.array import is_quantized
from jaxpr_rewrite._quantized.array_layout import ARRAY_FIELDS, METADATA_FIELDS, layout_problems

MATMUL = (((1,), (0,)), ((), ()))
K = 64


@functools.lru_cache(maxsize=None)
def operands(block=None):
    """``(x, w)`` of shapes (16, 64) and (64, 64), tie-free for the per-channel (or ``block``-wise) codes."""
    rng = np.random.default_rng(7)
    x, w = rng.normal(size=(16, K)), rng.normal(size=(K, K))
    if block is None:
        return away_from_ties(x, (1,)), away_from_ties(w, (0,))
    return away_from_ties_blocks(x, 1, block), away_from_ties_blocks(w, 0, block)


def layer(x, w):
    with jax.named_scope("layer"):
        return x @ w


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def assert_float32_close(got, want, rtol=1e-5):
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=rtol * 0.1 * np.abs(want).max())


# -- option values of every type -----------------------------------------------------------------------------------
SKIPS = st.one_of(st.none(), st.integers(-1, 3), st.sampled_from(["*", "layer", "lay*", "other", "jvp(layer)"]),
                  st.lists(st.sampled_from(["*", "layer", "other", 3, None]), max_size=3))
OPTIONS = st.fixed_dictionaries({}, optional={
    "skip": SKIPS,
    "min_contracting_size": st.one_of(st.integers(-1, 2 * K), st.booleans(), st.floats(0, 100), st.none()),
    "granularity": st.sampled_from(["per-channel", "per-tensor", "per-row", 1]),
    "block_size": st.one_of(st.none(), st.sampled_from([16, 32, 0, -8, True, 1.5, 10 ** 9])),
    "backend": st.sampled_from(["int8", "mxfp8", "nvfp4", "fp8", None]),
    "static_argnames": st.one_of(st.just(()), st.just("w"), st.integers(0, 2), st.just(["nope"])),
    "cache_size": st.one_of(st.integers(-1, 3), st.booleans(), st.just("4")),
    "skip_if": st.one_of(st.none(), st.just(lambda eqn: True), st.just(3)),
    "late_inlining": st.sampled_from([None, True, False, 1, "late"]),
    # scales of this program (one dot, none between activations), of a two-dot program, and not scales at all
    "activation_scales": st.sampled_from([None, ActivationScales((), 1), ActivationScales((), 2), {"n_dots": 1}]),
})


@given(OPTIONS)
def test_options_give_the_contract_or_a_clear_error(options):
    try:
        f = int8ify(layer, **options)
    except Int8ifyError:
        return
    block = options.get("block_size")
    x, w = operands(block)
    try:
        got = f(x, jnp.asarray(w))
    except Int8ifyError:
        # a static array argument (unhashable), options a backend refuses (nvfp4 with block_size, ...), or the
        # activation scales of another program
        assert (options.get("static_argnames") == "w" or options.get("backend") in ("mxfp8", "nvfp4")
                or options.get("activation_scales") == ActivationScales((), 2))
        return
    exact = x.astype(np.float64) @ w.astype(np.float64)
    patterns = [options["skip"]] if isinstance(options.get("skip"), str) else list(options.get("skip", ()))
    kept_float = (any(fnmatch.fnmatchcase("layer", p) for p in patterns) or options.get("skip_if") is not None
                  or options.get("min_contracting_size", 0) > K)
    backend = options.get("backend", "int8")
    if kept_float:
        assert_float32_close(got, exact)
    elif backend != "int8":
        assert relative_error(got, exact) < {"mxfp8": 0.08, "nvfp4": 0.25}[backend]
    elif block is not None:
        want, magnitude = reference_block_matmul(x, w, block)
        np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), 4e-7 * magnitude + 1e-30)
    elif options.get("granularity") == "per-tensor":
        assert_float32_close(got, reference_per_tensor_matmul(x, w), rtol=1e-6)
    else:
        assert_float32_close(got, reference_dot(x, w, MATMUL), rtol=1e-6)


# -- static values of every kind through one cached wrapper -------------------------------------------------------
def _factor(static) -> float:
    """A number that tells apart every static value a cache must tell apart (True vs 1 vs 1.0, 0.0 vs -0.0)."""
    return (len(repr(static)) % 5 + 1) * math.copysign(1.0, static if isinstance(static, float) else 1.0)


def scaled_layer(x, w, static):
    return layer(x, w) * _factor(static)


SCALED_LAYER = int8ify(scaled_layer)  # one wrapper for every example: its cache must keep them apart
STATICS = st.recursive(
    st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.booleans(), st.none(),
              st.text(max_size=3), st.just(0.0), st.just(-0.0)),
    lambda inner: st.tuples(inner, inner), max_leaves=4)


@given(st.lists(STATICS, min_size=1, max_size=4))
def test_static_values_find_their_own_program(statics):
    x, w = operands()
    want = reference_dot(x, w, MATMUL)
    for static in statics:
        got = SCALED_LAYER(x, w, static)
        assert_float32_close(got, want * _factor(static), rtol=1e-6)
    # rebuilding the wrapper finds the same programs, with the same answers
    assert_float32_close(int8ify(scaled_layer)(x, w, statics[0]), want * _factor(statics[0]), rtol=1e-6)


# -- pytrees of QuantizedArray through casts and transformations ------------------------------------------------
def dense(params, x):
    return x @ params["w"] + params["b"]


def stacked_dense(params, x):
    return lax.scan(lambda carry, p: (carry, dense(p, x)), None, params)[1]


@functools.lru_cache(maxsize=None)
def quantized(stacked: bool):
    """``(float params, quantized params)``: one dense layer, or two stacked ones scanned over (JAX arrays:
    equinox differentiates those, not numpy bfloat16 ones)."""
    x, w = operands()
    b = np.linspace(-1, 1, K).astype(np.float32)
    if stacked:
        w2 = away_from_ties(np.random.default_rng(8).normal(size=(K, K)), (0,))
        params = {"w": np.stack([w, w2]), "b": np.stack([b, -b])}
    else:
        params = {"w": w, "b": b}
    return params, quantize_params(stacked_dense if stacked else dense, jax.tree_util.tree_map(jnp.asarray, params),
                                   x)


def _floating(leaf):
    return jnp.issubdtype(leaf.dtype, jnp.floating)


CASTS = {
    "none": lambda tree: tree,
    # the recipe: cast whole QuantizedArrays (codes and scales stay)
    "bfloat16": lambda tree: jax.tree_util.tree_map(
        lambda a: a.astype(jnp.bfloat16) if _floating(a) else a, tree, is_leaf=is_quantized),
    "float32 again": lambda tree: jax.tree_util.tree_map(
        lambda a: a.astype(jnp.bfloat16).astype(jnp.float32) if _floating(a) else a, tree, is_leaf=is_quantized),
    # the usual mixed-precision tree_map, which reaches the scales: a clear error
    "into the scales": lambda tree: jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16) if _floating(a) else a,
                                                           tree),
}
USES = ("call", "jit", "grad", "filter_grad")


def _loss(fn):
    return lambda params, x: jnp.sum(jnp.square(fn(params, x).astype(jnp.float32)))


@given(st.sampled_from(sorted(CASTS)), st.sampled_from(USES), st.booleans())
def test_quantized_pytrees_through_casts_and_transforms(cast, use, stacked):
    x, _ = operands()
    params, qparams = quantized(stacked)
    assert is_quantized(qparams["w"])
    fn = stacked_dense if stacked else dense
    tree = CASTS[cast](qparams)
    run = {
        "call": lambda: int8ify(fn)(tree, x),
        "jit": lambda: jax.jit(int8ify(fn))(tree, x),
        "grad": lambda: jax.grad(int8ify(_loss(fn)), allow_int=True)(tree, x)["b"],
        "filter_grad": lambda: eqx.filter_grad(int8ify(_loss(fn)))(tree, x)["b"],
    }[use]
    if cast == "into the scales":
        try:
            run()
        except Int8ifyError as e:
            assert "scales are bfloat16" in str(e)
            return
        raise AssertionError("bfloat16 scales were accepted")
    b = np.asarray(jnp.asarray(params["b"]).astype(jnp.bfloat16).astype(np.float32)) if cast != "none" \
        else params["b"]
    ws = params["w"] if stacked else params["w"][None]
    bs = b if stacked else b[None]
    y = np.stack([reference_dot(x, w, MATMUL) + bias for w, bias in zip(ws, bs)])
    y = y if stacked else y[0]
    got = run()
    tolerance = 1e-2 if cast == "bfloat16" else 1e-5  # a bfloat16 output (or bias gradient) is rounded
    if use in ("call", "jit"):
        assert_float32_close(got, y, rtol=tolerance)
    else:
        assert_float32_close(got, 2 * y.sum(axis=-2), rtol=tolerance)


# What a hand-built QuantizedArray (``replace``) may hold in place of a child: every value here is malformed for
# the child it replaces, except where noted (None for an optional child: absent).
def _wrong_children(value) -> list:
    wrong = [1.0, [[1, 2]], True, "codes", np.zeros((), np.float32), np.zeros((3,), np.float32), None]
    if value is not None:
        shape = tuple(value.shape)
        wrong += [np.zeros(shape, np.int16), np.zeros(shape, np.float16), np.zeros(shape, np.bool_),
                  np.zeros((*shape, 1), value.dtype), np.zeros((2, *shape), value.dtype)]
    return wrong


# ... and in place of a static field (the tokens accept anything: they only group weights; a weight marked a KV cache
# is read as one, the same numbers in its own contraction)
WRONG_METADATA = {"from_end": [(), (-1,), (-3,), (0,), (-2, -2), (1.5,), "x"], "dtype": [np.dtype(np.int32)],
                  "smooth_group": [None, "another"], "bits": [4, 3, "8", True], "length": [3, -1, 64, 64.0],
                  "block_size": [0, -4, 16, 2.5, True], "activation_group": [None, "another"],
                  "cache": [True, None, 1, "yes"]}
WEIGHT_KINDS = {"dynamic": {}, "smoothed": {"smooth_alpha": 0.5}, "static": {"activations": "static"},
                "4-bit": {"bits": 4}}


@functools.lru_cache(maxsize=None)
def _weight(kind: str):
    x, w = operands()
    return quantize_params(lambda p, x: x @ p["w"], {"w": jnp.asarray(w)}, x, **WEIGHT_KINDS[kind])["w"]


@st.composite
def hand_built(draw):
    kind = draw(st.sampled_from(sorted(WEIGHT_KINDS)))
    q = _weight(kind)
    field = draw(st.sampled_from([*ARRAY_FIELDS, *METADATA_FIELDS]))
    pool = _wrong_children(getattr(q, field)) if field in ARRAY_FIELDS else WRONG_METADATA[field]
    return kind, field, draw(st.sampled_from(pool))


@examples(60)
@given(hand_built(), st.sampled_from(["call", "jit"]))
def test_a_hand_built_quantized_array_gives_the_contract_or_a_clear_error(case, use):
    kind, field, value = case
    x, _ = operands()
    bad = _weight(kind).replace(**{field: value})
    apply = int8ify(lambda w, x: x @ w)
    if use == "jit" and isinstance(value, str) and field in ARRAY_FIELDS:  # jax.jit refuses it before int8ify runs
        with pytest.raises(TypeError, match=r"<class 'str'>"):  # names the path w.<child> on JAX 0.10+
            jax.jit(apply)(bad, x)
        return
    try:
        got = (jax.jit(apply) if use == "jit" else apply)(bad, x)
    except Int8ifyError as e:
        assert "malformed" in str(e) and layout_problems(bad), str(e)
        return
    assert not layout_problems(bad)  # accepted: well formed
    # a token changed, an absent child stayed absent, or the stored 1 / smooth dropped (the program computes it,
    # correctly rounded as well): the weight's own numbers, bit for bit
    if field in ("smooth_group", "activation_group", "smooth_inverse") or getattr(_weight(kind), field) is value:
        assert np.array_equal(got, apply(_weight(kind), x))
    else:  # the static scale removed, or the square codes' other axis contracted: the value it stands for now
        assert_float32_close(got, reference_dot(x, np.asarray(bad.materialise()), MATMUL))
