"""The int8 KV cache (``quantize_cache``): written tokens quantized once, bit for bit the contract's codes and scales;
attention's dots reading the codes in int8; the cache kept quantized through decode steps, loops, jit with donation,
nnx modules and checkpoints. References are numpy's (``helpers.reference_codes``) and the float program's."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from helpers import assert_all_dots_int8, assert_same_tree, reference_codes, reference_scale_parts
from jaxpr_rewrite import RequantizationWarning, dot_eqns, int8ify, iter_eqns, quantize_cache, quantize_params, report
from jaxpr_rewrite._platforms.tpu import TPU_FUSION_OF_BATCHED_EPILOGUE_CRASHES
from jaxpr_rewrite._platforms.tpu_cache_write import token_write_p, token_written, write_token, writes_in_place
from jaxpr_rewrite.checkpoint import load_quantized, save_quantized
from jaxpr_rewrite.quantized import QuantizedArray, is_quantized

BATCH, TOKENS, KV_HEADS, GROUP, HEAD_DIM = 2, 256, 2, 4, 64


def _attend(q, k_cache, v_cache, length):
    """Grouped-query attention of ``q`` ``[batch, t, heads * head_dim]`` over the cache's first ``length`` tokens,
    the key-value heads never repeated: the dots read the cache arrays themselves."""
    batch, t = q.shape[:2]
    kv_heads, head_dim = k_cache.shape[2:]
    q = q.reshape(batch, t, kv_heads, -1, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_cache) / np.sqrt(head_dim)
    scores = jnp.where(jnp.arange(k_cache.shape[1]) < length, scores, -1e30)
    out = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(scores, axis=-1), v_cache)
    return out.reshape(batch, t, -1)


def decode_step(cache, q, k, v, pos):
    """One decode step as a serving loop writes it: the new token's key and value written at ``pos`` (one with
    ``lax.dynamic_update_slice``, the other with ``.at[...].set``), then attention over the cache."""
    k_cache = lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, pos, 0, 0))
    v_cache = cache["v"].at[:, pos].set(v[:, 0].astype(cache["v"].dtype))
    return _attend(q, k_cache, v_cache, pos + 1), {"k": k_cache, "v": v_cache}


def _empty_cache(tokens=TOKENS, head_dim=HEAD_DIM, dtype=jnp.float32):
    shape = (BATCH, tokens, KV_HEADS, head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def _token(rng, head_dim=HEAD_DIM):
    q = jnp.asarray(rng.standard_normal((BATCH, 1, KV_HEADS * GROUP * head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((BATCH, 1, KV_HEADS, head_dim)) * scale, jnp.float32)
            for scale in (1.0, 3.0))
    return q, k, v


def _relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.mark.parametrize("head_dim, tokens", [(64, 256), (128, 2048)])
def test_written_tokens_are_the_contracts_codes_and_scales_and_the_rest_stays(head_dim, tokens):
    rng = np.random.default_rng(head_dim)
    step = jax.jit(int8ify(decode_step))
    cache = quantize_cache(_empty_cache(tokens, head_dim))
    written = {}
    for pos in (0, 1, tokens - 1):
        q, k, v = _token(rng, head_dim)
        k = k.at[0, 0, 1, 3].set(0.5 * np.abs(k[0, 0, 1]).max())  # a tie or two
        _, cache = step(cache, q, k, v, pos)
        written[pos] = (np.asarray(k[:, 0]), np.asarray(v[:, 0]))
    for name, index in (("k", 0), ("v", 1)):
        array = cache[name]
        assert is_quantized(array) and array.contracting == (3,) and array.codes.dtype == np.int8
        for pos, values in written.items():
            np.testing.assert_array_equal(np.asarray(array.codes[:, pos]), reference_codes(values[index], (2,)))
            scales, exponents = reference_scale_parts(values[index], (2,))
            np.testing.assert_array_equal(np.asarray(array.scales[:, pos]), scales)
            np.testing.assert_array_equal(np.asarray(array.exponents[:, pos]), exponents)
        untouched = np.ones(tokens, bool)
        untouched[list(written)] = False
        assert not np.asarray(array.codes[:, untouched]).any()  # never written: zero codes, scale 1, reads as zero
        assert (np.asarray(array.scales[:, untouched]) == 1).all()
        assert not np.asarray(array.materialise()[:, untouched]).any()


def test_a_decode_step_reads_the_int8_cache_in_two_int8_dots_and_matches_float_attention():
    rng = np.random.default_rng(1)
    q, k, v = _token(rng)
    cache = quantize_cache(_empty_cache())
    jaxpr = jax.make_jaxpr(int8ify(decode_step))(cache, q, k, v, 5)
    dots = assert_all_dots_int8(jaxpr, expected_count=2)
    cache_shape = (BATCH, TOKENS, KV_HEADS, HEAD_DIM)
    assert all(cache_shape in [tuple(v.aval.shape) for v in e.invars] for e in dots)  # the codes, as they are
    float_cache, int8_cache = _empty_cache(), cache
    step = jax.jit(int8ify(decode_step))
    for pos in range(24):
        q, k, v = _token(rng)
        want, float_cache = decode_step(float_cache, q, k, v, pos)
        got, int8_cache = step(int8_cache, q, k, v, pos)
        assert _relative_error(got, want) < 0.02, pos


def test_the_value_dot_folds_each_tokens_scale_into_the_probabilities():
    """``p . v`` over the tokens: ``sum_s (p * s_v)[s] * v_q[s]``, the int8 sums exact and scaled by the folded
    probabilities' own per-row scales: against a numpy reference of that scheme, in float64."""
    rng = np.random.default_rng(2)
    p = jax.nn.softmax(jnp.asarray(rng.standard_normal((BATCH, KV_HEADS, GROUP, 1, TOKENS)), jnp.float32), -1)
    values = jnp.asarray(rng.standard_normal((BATCH, TOKENS, KV_HEADS, HEAD_DIM)), jnp.float32)
    cache = quantize_cache(values)
    got = jax.jit(int8ify(lambda p, v: jnp.einsum("bkgts,bskd->btkgd", p, v)))(p, cache)
    v_scales = reference_scale_parts(np.asarray(values), (3,))
    v_scale = v_scales[0].astype(np.float64) * np.exp2(v_scales[1])  # (b, s, k)
    folded = np.asarray(p, np.float32) * np.transpose(v_scale, (0, 2, 1))[:, :, None, None, :].astype(np.float32)
    p_codes = reference_codes(folded, (4,)).astype(np.int64)
    p_scales = reference_scale_parts(folded, (4,))
    p_scale = p_scales[0].astype(np.float64) * np.exp2(p_scales[1])  # (b, k, g, t)
    sums = np.einsum("bkgts,bskd->btkgd", p_codes, reference_codes(np.asarray(values), (3,)).astype(np.int64))
    want = sums * np.transpose(p_scale, (0, 3, 1, 2))[..., None]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-6, atol=1e-9)
    assert _relative_error(got, jnp.einsum("bkgts,bskd->btkgd", p, values)) < 0.03


@pytest.mark.parametrize("magnitude", [1e-30, 1e-20, 1.0, 1e30])
@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_the_value_dot_of_a_partly_written_cache_is_its_float_result(magnitude, platform):
    """Half the cache never written (codes 0, placeholder scale 1) and the attention not masking it: the unwritten
    tokens take no part in the folded rows' absmax, at every magnitude the fold covers (down to values of about
    1e-30, whose scales sit below 2**-100); the TPU's program run here too."""
    rng = np.random.default_rng(3)
    p = jax.nn.softmax(jnp.asarray(rng.standard_normal((BATCH, KV_HEADS, GROUP, 1, TOKENS)), jnp.float32), -1)
    values = rng.standard_normal((BATCH, TOKENS, KV_HEADS, HEAD_DIM)) * magnitude
    values[:, TOKENS // 2:] = 0
    values = jnp.asarray(values, jnp.float32)
    attend = jax.jit(int8ify(lambda p, v: jnp.einsum("bkgts,bskd->btkgd", p, v), platforms=(platform,)))
    got = np.asarray(attend(p, quantize_cache(values)), np.float64)
    want = np.einsum("bkgts,bskd->btkgd", np.asarray(p, np.float64), np.asarray(values, np.float64))
    assert np.all(np.isfinite(got)) and _relative_error(got, want) < 0.03


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_a_start_below_minus_the_cache_length_is_clamped_as_the_float_program_clamps_it(platform):
    """``lax.dynamic_update_slice`` and ``lax.dynamic_slice`` count a negative start from the end once, and XLA
    clamps what is still negative to 0: a quantized cache is written and read at the same token."""
    rng = np.random.default_rng(4)
    values = jnp.asarray(rng.standard_normal((BATCH, TOKENS, KV_HEADS, HEAD_DIM)), jnp.float32)
    update = jnp.asarray(rng.standard_normal((BATCH, 1, KV_HEADS, HEAD_DIM)) * 3, jnp.float32)

    def write(c, u, pos):
        return lax.dynamic_update_slice(c, u, (0, pos, 0, 0))

    def read(c, pos):
        return lax.dynamic_slice(c, (0, pos, 0, 0), (BATCH, 2, KV_HEADS, HEAD_DIM))

    stored = quantize_cache(values)
    for pos in (-1, -TOKENS, -TOKENS - 3, -3 * TOKENS, TOKENS + 3):
        written = jax.jit(int8ify(write, platforms=(platform,)))(stored, update, pos)
        want = np.asarray(write(values, update, pos))
        np.testing.assert_array_equal(np.asarray(written.codes), reference_codes(want, (3,)))
        got = jax.jit(int8ify(read, platforms=(platform,)))(stored, pos)  # the slice's codes and scales, returned
        got = got.materialise() if is_quantized(got) else got  # as their float value
        np.testing.assert_array_equal(np.asarray(got), np.asarray(read(stored.materialise(), pos)))


# each write form, and the tokens its update holds
_WRITES = {
    "dynamic_update_slice": (lambda c, u, pos: lax.dynamic_update_slice(c, u, (0, pos, 0, 0)), 1),
    ".at[:, pos].set": (lambda c, u, pos: c.at[:, pos].set(u[:, 0]), 1),
    ".at[:, pos].set, clip": (lambda c, u, pos: c.at[:, pos].set(u[:, 0], mode="clip"), 1),
    ".at[:, [pos, pos + 2]].set": (lambda c, u, pos: c.at[:, jnp.stack([pos, pos + 2])].set(u), 2),
    ".at[batch, per-batch pos].set": (
        lambda c, u, pos: c.at[jnp.arange(c.shape[0]), pos + jnp.arange(c.shape[0])].set(u[:, 0]), 1),
}


@settings(max_examples=40, deadline=None, derandomize=True)
@given(write=st.sampled_from(sorted(_WRITES)), tokens=st.sampled_from([1, 5, 64]), head_dim=st.sampled_from([3, 64]),
       lengths=st.integers(-2, 1), offset=st.integers(0, 63), seed=st.integers(0, 2**16))
def test_every_write_form_stores_the_contracts_codes_of_the_float_programs_values(write, tokens, head_dim, lengths,
                                                                                  offset, seed):
    """Each way of writing tokens (``dynamic_update_slice``, scatters with one, several or per-batch indices, in
    the default drop mode and in clip mode), at any start (``lengths`` cache lengths from the first token: below
    minus the length, negative, in range, past the end): the returned cache holds the contract's codes and scales
    of the values the float program's cache holds, unwritten slices included."""
    pos = lengths * tokens + offset % tokens
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((BATCH, tokens, KV_HEADS, head_dim)).astype(np.float32)
    values[rng.random((BATCH, tokens)) < 0.3] = 0  # tokens never written
    fn, written = _WRITES[write]
    updates = rng.standard_normal((BATCH, written, KV_HEADS, head_dim)).astype(np.float32)
    got = jax.jit(int8ify(fn))(quantize_cache(jnp.asarray(values)), updates, pos)
    want = np.asarray(fn(jnp.asarray(values), updates, pos))
    assert is_quantized(got)
    np.testing.assert_array_equal(np.asarray(got.codes), reference_codes(want, (3,)))
    want_scales, want_exponents = reference_scale_parts(want, (3,))
    np.testing.assert_array_equal(np.asarray(got.scales), want_scales)
    np.testing.assert_array_equal(np.asarray(got.exponents), want_exponents)


def test_a_vmapped_step_writes_each_cache_at_its_own_position_and_keeps_it_quantized():
    """``jax.vmap`` makes a ``dynamic_update_slice`` a scatter indexing every axis, head_dim too (always at 0, in
    ``CLIP`` mode): each cache keeps its codes and scales, the written tokens the contract's."""
    rng = np.random.default_rng(5)
    caches = jnp.asarray(rng.standard_normal((3, BATCH, TOKENS, KV_HEADS, HEAD_DIM)), jnp.float32)
    updates = jnp.asarray(rng.standard_normal((3, BATCH, 1, KV_HEADS, HEAD_DIM)) * 2, jnp.float32)
    positions = jnp.array([0, 7, TOKENS - 1])
    write = jax.vmap(lambda c, u, pos: lax.dynamic_update_slice(c, u, (0, pos, 0, 0)))
    got = jax.jit(int8ify(write))(quantize_cache(caches), updates, positions)
    assert is_quantized(got)
    want = np.asarray(write(caches, updates, positions))
    np.testing.assert_array_equal(np.asarray(got.codes), reference_codes(want, (4,)))
    want_scales, want_exponents = reference_scale_parts(want, (4,))
    np.testing.assert_array_equal(np.asarray(got.scales), want_scales)
    np.testing.assert_array_equal(np.asarray(got.exponents), want_exponents)


def test_nan_or_inf_in_one_token_reaches_only_the_outputs_it_feeds():
    rng = np.random.default_rng(3)
    step = jax.jit(int8ify(decode_step))
    cache = quantize_cache(_empty_cache())
    for pos in range(4):
        q, k, v = _token(rng)
        if pos == 2:  # batch row 1's key (head 0) and value (head 1) hold NaN and Inf
            k = k.at[1, 0, 0, 5].set(jnp.nan)
            v = v.at[1, 0, 1, 7].set(jnp.inf)
        out, cache = step(cache, q, k, v, pos)
    out = np.asarray(out).reshape(BATCH, 1, KV_HEADS, GROUP, HEAD_DIM)
    assert np.isfinite(out[0]).all()  # the other sequence: untouched
    assert not np.isfinite(out[1, :, 0]).any() and not np.isfinite(out[1, :, 1]).any()
    assert np.isfinite(np.asarray(cache["k"].scales[1, :2])).all()  # the tokens written before: their own scales
    assert not np.isfinite(np.asarray(cache["k"].scales[1, 2, 0])) and np.isfinite(cache["k"].scales[1, 2, 1])


def test_a_jitted_step_with_the_cache_donated_keeps_it_quantized_and_frees_the_old_buffers():
    rng = np.random.default_rng(4)
    step = jax.jit(int8ify(decode_step), donate_argnums=0)
    cache = quantize_cache(_empty_cache())
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(cache))
    float_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(_empty_cache(dtype=jnp.bfloat16)))
    assert nbytes < 0.6 * float_bytes  # codes, and per token and head a float32 scale and an int32 exponent
    for pos in range(3):
        old = cache
        _, cache = step(cache, *_token(rng), pos)
        assert jax.tree_util.tree_structure(cache) == jax.tree_util.tree_structure(old)
        assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(old))


@pytest.mark.parametrize("loop", ["fori_loop", "scan", "python"])
def test_decode_loops_carry_the_cache_quantized(loop):
    rng = np.random.default_rng(5)
    steps = 6
    qs, ks, vs = (jnp.stack(parts) for parts in zip(*(_token(rng) for _ in range(steps))))

    def decode(cache, qs, ks, vs):
        if loop == "fori_loop":
            return lax.fori_loop(0, steps, lambda i, c: decode_step(c, qs[i], ks[i], vs[i], i)[1], cache)
        if loop == "scan":
            def body(c, xs):
                i, q, k, v = xs
                out, c = decode_step(c, q, k, v, i)
                return c, out
            return lax.scan(body, cache, (jnp.arange(steps), qs, ks, vs))[0]
        for i in range(steps):
            cache = decode_step(cache, qs[i], ks[i], vs[i], i)[1]
        return cache

    got = jax.jit(int8ify(decode))(quantize_cache(_empty_cache()), qs, ks, vs)
    want = quantize_cache(decode(_empty_cache(), qs, ks, vs))  # the float cache, each token quantized alone
    for name in ("k", "v"):
        assert is_quantized(got[name])
        np.testing.assert_array_equal(np.asarray(got[name].codes), np.asarray(want[name].codes))
        np.testing.assert_array_equal(np.asarray(got[name].scales), np.asarray(want[name].scales))


def test_heads_repeated_for_grouped_query_attention_keep_the_codes():
    """``jnp.repeat`` of the key-value heads (a broadcast and a reshape) moves whole slices: the repeated cache is
    still int8 codes in the dot."""
    def step(cache, q, k, v, pos):
        k_cache = lax.dynamic_update_slice(cache["k"], k, (0, pos, 0, 0))
        keys = jnp.repeat(k_cache, GROUP, axis=2)  # (batch, tokens, heads, head_dim)
        q = q.reshape(BATCH, 1, KV_HEADS * GROUP, HEAD_DIM)
        return jnp.einsum("bthd,bshd->bhts", q, keys), {"k": k_cache, "v": cache["v"]}

    rng = np.random.default_rng(6)
    q, k, v = _token(rng)
    cache = quantize_cache(_empty_cache())
    jaxpr = jax.make_jaxpr(int8ify(step))(cache, q, k, v, 0)
    (dot,) = assert_all_dots_int8(jaxpr, expected_count=1)
    assert (BATCH, TOKENS, KV_HEADS * GROUP, HEAD_DIM) in [tuple(v.aval.shape) for v in dot.invars]
    got, _ = jax.jit(int8ify(step))(cache, q, k, v, 0)
    want, _ = step(_empty_cache(), q, k, v, 0)
    assert _relative_error(got[..., :1], want[..., :1]) < 0.02


def test_any_other_use_of_the_cache_reads_its_float_value():
    """An elementwise use, and a write of part of a token's head_dim: the cache's value, ``codes * scales``; the
    returned cache is then the float function's."""
    def other_uses(cache, k):
        doubled = cache["k"] * 2
        partial = lax.dynamic_update_slice(cache["v"], k[..., :8], (0, 3, 0, 0))
        return doubled.sum(), {"k": cache["k"], "v": partial}

    rng = np.random.default_rng(7)
    values = {name: jnp.asarray(rng.standard_normal((BATCH, TOKENS, KV_HEADS, HEAD_DIM)), jnp.float32)
              for name in ("k", "v")}
    cache = quantize_cache(values)
    k = jnp.asarray(rng.standard_normal((BATCH, 1, KV_HEADS, HEAD_DIM)), jnp.float32)
    total, out = jax.jit(int8ify(other_uses))(cache, k)
    dequantized = {name: cache[name].materialise() for name in ("k", "v")}
    want_total, want = other_uses(dequantized, k)
    np.testing.assert_allclose(float(total), float(want_total), rtol=1e-5)
    assert is_quantized(out["k"]) and not is_quantized(out["v"])
    np.testing.assert_array_equal(np.asarray(out["v"]), np.asarray(want["v"]))


class _Attention(nnx.Module):
    """An nnx attention block whose KV cache lives in ``nnx.Cache`` variables, written each step."""

    def __init__(self, rngs: nnx.Rngs):
        width = KV_HEADS * GROUP * HEAD_DIM
        self.q = nnx.Linear(width, width, rngs=rngs)
        self.k = nnx.Linear(width, KV_HEADS * HEAD_DIM, rngs=rngs)
        self.v = nnx.Linear(width, KV_HEADS * HEAD_DIM, rngs=rngs)
        self.cache_k = nnx.Cache(jnp.zeros((BATCH, TOKENS, KV_HEADS, HEAD_DIM)))
        self.cache_v = nnx.Cache(jnp.zeros((BATCH, TOKENS, KV_HEADS, HEAD_DIM)))

    def __call__(self, x, pos):
        k = self.k(x).reshape(BATCH, 1, KV_HEADS, HEAD_DIM)
        v = self.v(x).reshape(BATCH, 1, KV_HEADS, HEAD_DIM)
        self.cache_k.set_value(lax.dynamic_update_slice(self.cache_k.get_value(), k, (0, pos, 0, 0)))
        self.cache_v.set_value(lax.dynamic_update_slice(self.cache_v.get_value(), v, (0, pos, 0, 0)))
        return _attend(self.q(x), self.cache_k.get_value(), self.cache_v.get_value(), pos + 1)


def test_an_nnx_modules_cache_variables_stay_quantized_eagerly_and_under_nnx_jit():
    model, reference = _Attention(nnx.Rngs(0)), _Attention(nnx.Rngs(0))
    for variable in (model.cache_k, model.cache_v):
        variable.set_value(quantize_cache(variable.get_value()))
    eager = int8ify(lambda m, x, pos: m(x, pos))
    jitted = nnx.jit(int8ify(lambda m, x, pos: m(x, pos)))
    rng = np.random.default_rng(8)
    for pos in range(4):
        x = jnp.asarray(rng.standard_normal((BATCH, 1, KV_HEADS * GROUP * HEAD_DIM)) / 8, jnp.float32)
        got = (eager if pos % 2 else jitted)(model, x, pos)
        assert _relative_error(got, reference(x, pos)) < 0.03, pos
        assert is_quantized(model.cache_k.get_value()) and is_quantized(model.cache_v.get_value())
    written = (slice(None), slice(0, 4))  # (the int8 projections' keys: close to the float ones, not equal)
    got_keys, want_keys = model.cache_k.get_value().materialise()[written], reference.cache_k.get_value()[written]
    assert _relative_error(got_keys, want_keys) < 0.02


class _LinenAttention(linen.Module):
    """A linen attention block whose KV cache lives in its ``cache`` collection, written each step."""

    @linen.compact
    def __call__(self, x, pos):
        shape = (BATCH, TOKENS, KV_HEADS, HEAD_DIM)
        cache_k = self.variable("cache", "k", jnp.zeros, shape)
        cache_v = self.variable("cache", "v", jnp.zeros, shape)
        k = linen.Dense(KV_HEADS * HEAD_DIM, name="key")(x).reshape(BATCH, 1, KV_HEADS, HEAD_DIM)
        v = linen.Dense(KV_HEADS * HEAD_DIM, name="value")(x).reshape(BATCH, 1, KV_HEADS, HEAD_DIM)
        cache_k.value = lax.dynamic_update_slice(cache_k.value, k, (0, pos, 0, 0))
        cache_v.value = lax.dynamic_update_slice(cache_v.value, v, (0, pos, 0, 0))
        q = linen.Dense(KV_HEADS * GROUP * HEAD_DIM, name="query")(x)
        return _attend(q, cache_k.value, cache_v.value, pos + 1)


def test_a_linen_cache_collection_stays_quantized_across_applies():
    module = _LinenAttention()
    x0 = jnp.zeros((BATCH, 1, KV_HEADS * GROUP * HEAD_DIM), jnp.float32)
    variables = module.init(jax.random.key(0), x0, 0)
    params, float_cache = variables["params"], variables["cache"]
    cache = quantize_cache(float_cache)
    step = jax.jit(int8ify(lambda params, cache, x, pos: module.apply(
        {"params": params, "cache": cache}, x, pos, mutable=["cache"])))
    rng = np.random.default_rng(10)
    for pos in range(4):
        x = jnp.asarray(rng.standard_normal((BATCH, 1, KV_HEADS * GROUP * HEAD_DIM)) / 8, jnp.float32)
        got, updated = step(params, cache, x, pos)
        want, updated_float = module.apply({"params": params, "cache": float_cache}, x, pos, mutable=["cache"])
        cache, float_cache = updated["cache"], updated_float["cache"]
        assert all(is_quantized(leaf) for leaf in jax.tree.leaves(cache, is_leaf=is_quantized)), pos
        assert _relative_error(got, want) < 0.03, pos
    written = (slice(None), slice(0, 4))
    assert _relative_error(cache["k"].materialise()[written], float_cache["k"][written]) < 0.02


def test_the_cache_saves_and_loads_with_the_checkpoint_functions(tmp_path):
    rng = np.random.default_rng(9)
    step = jax.jit(int8ify(decode_step))
    cache = quantize_cache(_empty_cache())
    _, cache = step(cache, *_token(rng), 0)
    save_quantized(tmp_path / "cache", cache)
    loaded = load_quantized(tmp_path / "cache", target=cache)
    for name in ("k", "v"):
        assert isinstance(loaded[name], QuantizedArray)
        for part in ("codes", "scales", "exponents"):
            np.testing.assert_array_equal(*(np.asarray(getattr(tree[name], part)) for tree in (loaded, cache)))
    token = _token(rng)
    np.testing.assert_array_equal(np.asarray(step(loaded, *token, 1)[0]), np.asarray(step(cache, *token, 1)[0]))


def test_quantize_cache_keeps_other_leaves_and_refuses_nothing_silently():
    tree = {"k": jnp.zeros((2, 8, 1, 64), jnp.bfloat16), "length": jnp.asarray(3), "name": "layer0"}
    cache = quantize_cache(tree)
    assert is_quantized(cache["k"]) and cache["k"].dtype == jnp.bfloat16
    assert cache["length"] is tree["length"] and cache["name"] == "layer0"
    assert quantize_cache(cache)["k"] is cache["k"]  # already quantized: kept
    jaxpr = jax.make_jaxpr(int8ify(decode_step))(quantize_cache(_empty_cache(dtype=jnp.bfloat16)), *_token(
        np.random.default_rng(0)), 0)
    assert all(e.invars[0].aval.dtype == np.int8 for e in dot_eqns(jaxpr))


def test_a_decode_step_over_a_float_cache_warns_naming_each_dot_and_the_fix():
    """Re-quantizing a float cache on every token reads it about 2.5 times for a dot bound by reading it once: the
    step as its author wrote it warns when it is traced, and ``report`` says so; the int8 cache, and a prefill over
    many tokens (whose dots pay for it), do not."""
    rng = np.random.default_rng(10)
    cache = _empty_cache(tokens=2048, head_dim=128)
    q, k, v = _token(rng, 128)
    with pytest.warns(RequantizationWarning) as caught:
        int8ify(decode_step).rewritten_jaxpr(cache, q, k, v, 3)
    messages = [str(w.message) for w in caught if w.category is RequantizationWarning]
    assert len(messages) == 2
    for message, name in zip(messages, ("k", "v")):
        assert re.search(rf"dot_general at .*test_kv_cache\.py:\d+ .*argument args\[0\]\['{name}'\] "
                         r"\(float32\[2,2048,2,128\], 4 MiB\) .*4 row\(s\).*quantize_cache", message), message
    rows = report(int8ify(decode_step), cache, q, k, v, 3)
    assert [r.requantizes for r in rows] == ["args[0]['k']", "args[0]['v']"]
    assert "2 dot(s) quantize a large argument on every call" in rows.summary()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RequantizationWarning)
        int8ify(decode_step).rewritten_jaxpr(quantize_cache(cache), q, k, v, 3)
        prompt = jnp.asarray(rng.standard_normal((BATCH, 512, KV_HEADS * GROUP * 128)), jnp.float32)
        int8ify(lambda c, q: _attend(q, c["k"], c["v"], 512)).rewritten_jaxpr(cache, prompt)


def test_float_weights_passed_to_a_small_batch_warn_and_a_large_batch_does_not():
    weights = jnp.ones((2048, 1024), jnp.float32)
    with pytest.warns(RequantizationWarning, match=r"argument args\[0\] .*16 row\(s\).*quantize_params"):
        int8ify(lambda w, x: x @ w).rewritten_jaxpr(weights, jnp.ones((16, 2048)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RequantizationWarning)
        int8ify(lambda w, x: x @ w).rewritten_jaxpr(weights, jnp.ones((512, 2048)))
        quantized = quantize_params(lambda w, x: x @ w, weights, jnp.ones((16, 2048)))
        int8ify(lambda w, x: x @ w).rewritten_jaxpr(quantized, jnp.ones((16, 2048)))


def _token_writes(jaxpr):
    return [e for e in iter_eqns(jaxpr.jaxpr) if e.primitive is token_write_p]


def _scores_barriers(jaxpr, queries: int):
    """The optimization barriers holding ``q . k``'s output alone (in the dot's own axis order)."""
    scores = sorted((BATCH, KV_HEADS, GROUP, queries, TOKENS))
    return [e for e in iter_eqns(jaxpr.jaxpr) if e.primitive.name == "optimization_barrier"
            and len(e.invars) == 1 and sorted(e.invars[0].aval.shape) == scores]


def test_a_tpu_program_writes_a_tokens_scales_in_place_and_reads_the_scores_unbarriered():
    """Traced for a TPU, a decode step writes each ``dynamic_update_slice``'d token's scales and exponents with the
    in-place kernel (XLA:TPU would move the whole per-slice array through VMEM and back on every step), and its
    attention dot reading the stored cache leaves its output to fuse with the softmax; a prefill's does not where
    ``TPU_FUSION_OF_BATCHED_EPILOGUE_CRASHES`` (1.22x bf16's speed fused, 1.51x written out)."""
    rng = np.random.default_rng(6)
    cache = quantize_cache(_empty_cache())
    q, k, v = _token(rng)
    jaxpr = jax.make_jaxpr(int8ify(decode_step, platforms=("tpu",)))(cache, q, k, v, 5)
    writes = _token_writes(jaxpr)
    per_slice = (BATCH, TOKENS, KV_HEADS)
    assert sorted((e.outvars[0].aval.shape, str(e.outvars[0].aval.dtype)) for e in writes) == [
        (per_slice, "float32"), (per_slice, "int32")]  # the keys' (the values are written by a scatter)
    assert not _scores_barriers(jaxpr, queries=1)
    assert not _token_writes(jax.make_jaxpr(int8ify(decode_step, platforms=("cpu",)))(cache, q, k, v, 5))
    # the TPU's program runs on a CPU (the write lowered to dynamic_update_slice there) and gives the CPU's bits
    tpu_out, tpu_cache = jax.jit(int8ify(decode_step, platforms=("tpu",)))(cache, q, k, v, 5)
    cpu_out, cpu_cache = jax.jit(int8ify(decode_step, platforms=("cpu",)))(cache, q, k, v, 5)
    assert_same_tree(tpu_cache, cpu_cache)
    np.testing.assert_allclose(np.asarray(tpu_out), np.asarray(cpu_out), rtol=1e-6)
    # a prefill's thousands of query rows over the same cache keep the barrier where that compiler needs it
    prompt = jnp.ones((BATCH, TOKENS, q.shape[-1]))
    prefill = jax.make_jaxpr(int8ify(_attend, platforms=("tpu",)))(prompt, cache["k"], cache["v"], TOKENS)
    assert len(_scores_barriers(prefill, queries=TOKENS)) == (1 if TPU_FUSION_OF_BATCHED_EPILOGUE_CRASHES else 0)


@pytest.mark.parametrize("shape, axis", [((4, 256, 8), 1), ((2, 3, 384), 2), ((3, 128, 5), 1)])
def test_the_tpu_token_writer_writes_what_dynamic_update_slice_writes(shape, axis):
    """The in-place kernel (in Pallas's TPU interpreter) against the ``dynamic_update_slice`` primitive: a token at
    each edge of a 128-token window, inside one, at the last slot, past it and before the first (clamped), float32
    scales and int32 exponents."""
    rng = np.random.default_rng(7)
    update_shape = tuple(1 if a == axis else n for a, n in enumerate(shape))
    for dtype in (np.float32, np.int32):
        array = jnp.asarray(rng.normal(size=shape) * 100, dtype)
        update = jnp.asarray(rng.normal(size=update_shape) * 100, dtype)
        assert writes_in_place(shape, update_shape, dtype)
        write = jax.jit(lambda a, u, p: write_token(a, u, *[p if i == axis else 0 for i in range(a.ndim)],
                                                    interpret=True))
        for position in (-5, 0, 1, 127, 128, 200, shape[axis] - 1, shape[axis] + 5):  # the primitive's starts
            starts = [position if i == axis else 0 for i in range(len(shape))]
            want = lax.dynamic_update_slice_p.bind(array, update, *[jnp.int32(s) for s in starts])
            np.testing.assert_array_equal(np.asarray(write(array, update, jnp.int32(position))), np.asarray(want))


def test_the_tpu_token_writer_takes_only_one_whole_token_of_a_32_bit_array_laid_out_tokens_minor():
    assert writes_in_place((8, 1024, 8), (8, 1, 8), np.float32)
    assert writes_in_place((8, 8, 1024), (8, 8, 1), np.int32)
    assert not writes_in_place((8, 1000, 8), (8, 1, 8), np.float32)  # not whole windows of 128 tokens
    assert not writes_in_place((8, 1024, 8), (8, 2, 8), np.float32)  # two tokens (a prefill's write)
    assert not writes_in_place((8, 1024, 8), (8, 1, 4), np.float32)  # part of a token
    assert not writes_in_place((8, 1024, 8), (8, 1, 8), np.float16)
    assert not writes_in_place((8, 1024, 256), (8, 1, 256), np.float32)  # XLA:TPU lays these heads minor
    assert not writes_in_place((4096, 1024, 8), (4096, 1, 8), np.float32)  # a window past WINDOW_BYTES of VMEM


def test_a_decode_step_exported_for_a_cpu_and_a_tpu_carries_each_platforms_write():
    """``jax.export`` for both platforms: the token write is the kernel in the TPU's lowering and a
    ``dynamic_update_slice`` in the CPU's, and the exported step called here gives the step's cache bit for bit."""
    from jax import export

    rng = np.random.default_rng(8)
    cache = quantize_cache(_empty_cache())
    step = jax.jit(int8ify(decode_step, platforms=("cpu", "tpu")))
    exported = export.export(step, platforms=["cpu", "tpu"])(cache, *_token(rng), 7)
    assert "tpu_custom_call" in exported.mlir_module()
    q, k, v = _token(rng)
    _, got = exported.call(cache, q, k, v, 7)
    _, want = jax.jit(int8ify(decode_step))(cache, q, k, v, 7)
    assert_same_tree(got, want)


def test_the_token_write_under_vmap_writes_each_mapped_cache():
    """``jax.vmap`` over the TPU's token write (two caches, each its own token and position): a
    ``dynamic_update_slice`` of each, as mapped."""
    rng = np.random.default_rng(9)
    arrays = jnp.asarray(rng.normal(size=(2, 4, 256, 8)), jnp.float32)
    updates = jnp.asarray(rng.normal(size=(2, 4, 1, 8)), jnp.float32)
    positions = jnp.asarray([3, 200], jnp.int32)
    got = jax.vmap(lambda a, u, p: token_written(a, u, 0, p, 0))(arrays, updates, positions)
    want = jax.vmap(lambda a, u, p: lax.dynamic_update_slice(a, u, (0, p, 0)))(arrays, updates, positions)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    shared = jax.vmap(lambda u: token_written(arrays[0], u, 0, 9, 0))(updates)  # the array itself unmapped
    np.testing.assert_array_equal(np.asarray(shared[1]),
                                  np.asarray(lax.dynamic_update_slice(arrays[0], updates[1], (0, 9, 0))))
