"""verify: the seed's reference solution passes; each way the seed's grader rejects a solution is a
finding with the lint plugin's code at the user's line; int8ify's output is clean for every supported
program shape."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import dense_with_custom_jvp
from jaxpr_rewrite import int8ify
from jaxpr_rewrite._inspect.verify import Finding, assert_int8, verify

B, D_IN, D_OUT = 4, 16, 3
X = jax.ShapeDtypeStruct((B, D_IN), jnp.float32)
W = jax.ShapeDtypeStruct((D_IN, D_OUT), jnp.float32)


def _line(fn, marker: str) -> int:
    """Line number (in this file) of the source line of ``fn`` containing ``marker``."""
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def _scales(v, axis):
    amax = jnp.max(jnp.abs(v), axis=axis)
    return jnp.where(amax == 0, 1.0, amax / 127.0).astype(jnp.float32)


def _codes(v, s):
    return jnp.clip(jnp.round(v / s), -127, 127).astype(jnp.int8)


def seed_reference(x, w):
    """The seed problem's reference solution."""
    w_scales, x_scales = _scales(w, 0), _scales(x, 1)
    w_q, x_q = _codes(w, w_scales[None, :]), _codes(x, x_scales[:, None])
    acc = jnp.matmul(x_q, w_q, preferred_element_type=jnp.int32)
    y = acc.astype(jnp.float32) * (x_scales[:, None] * w_scales[None, :])
    return {"w_q": w_q, "w_scales": w_scales, "x_q": x_q, "x_scales": x_scales, "y": y}


def dequantized_matmul(x, w):
    r = seed_reference(x, w)
    x_dq = r["x_q"].astype(jnp.float32) * r["x_scales"][:, None]
    w_dq = r["w_q"].astype(jnp.float32) * r["w_scales"][None, :]
    return {**r, "y": x_dq @ w_dq}  # MARK


def matmul_of_scales(x, w):
    r = seed_reference(x, w)
    acc = jnp.matmul(r["x_q"], r["w_q"], preferred_element_type=jnp.int32)
    outer = r["x_scales"][:, None] @ r["w_scales"][None, :]  # MARK
    return {**r, "y": acc.astype(jnp.float32) * outer}


def broadcast_multiply_sum(x, w):
    r = seed_reference(x, w)
    prods = r["x_q"][:, :, None].astype(jnp.int32) * r["w_q"][None, :, :].astype(jnp.int32)  # MARK
    acc = jnp.sum(prods, axis=1)
    return {**r, "y": acc.astype(jnp.float32) * (r["x_scales"][:, None] * r["w_scales"][None, :])}


def float_broadcast_multiply_sum(x, w):
    return jnp.sum(x[:, :, None] * w[None, :, :], axis=1)  # MARK


def host_callback(x, w):
    r = seed_reference(x, w)
    y = jax.pure_callback(  # MARK
        lambda a, b: np.asarray(a, np.float32) @ np.asarray(b, np.float32),
        jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32), x, w,
    )
    return {**r, "y": y}


def python_if_on_zero(x, w):
    amax = jnp.max(jnp.abs(w), axis=0)
    if jnp.all(amax == 0):  # MARK
        return jnp.zeros((x.shape[0], w.shape[1]))
    return seed_reference(x, w)["y"]


def int16_accumulation(x, w):
    r = seed_reference(x, w)
    return jnp.matmul(r["x_q"], r["w_q"], preferred_element_type=jnp.int16)  # MARK


def convolution(x, w):
    return jax.lax.conv_general_dilated(x[None, None], w[None, None], (1, 1), "VALID")  # MARK


def debug_print(x, w):
    jax.debug.print("x = {}", x)  # MARK
    return seed_reference(x, w)["y"]


def scalar_conversion(x, w):
    n = int(jnp.argmax(x[0]))  # MARK
    return x[:, n]


def test_seed_reference_solution_is_clean():
    assert verify(seed_reference, X, W) == []
    assert_int8(seed_reference, X, W)
    x = np.random.default_rng(0).normal(size=(B, D_IN)).astype(np.float32)
    assert verify(seed_reference, x, np.ones((D_IN, D_OUT), np.float32)) == []  # concrete arrays too


@pytest.mark.parametrize(
    "fn, code, primitive",
    [
        (dequantized_matmul, "JX101", "dot_general"),
        (matmul_of_scales, "JX101", "dot_general"),
        (broadcast_multiply_sum, "JX103", "mul"),
        (float_broadcast_multiply_sum, "JX103", "mul"),
        (host_callback, "JX301", "pure_callback"),
        (python_if_on_zero, "JX201", "TracerBoolConversionError"),
        (int16_accumulation, "JX102", "dot_general"),
        (convolution, "JX104", "conv_general_dilated"),
        (debug_print, "JX302", "debug_print"),
        (scalar_conversion, "JX202", None),
    ],
)
def test_each_rejected_solution_is_one_finding_at_the_users_line(fn, code, primitive):
    findings = verify(fn, X, W)
    assert [f.code for f in findings] == [code], findings
    (finding,) = findings
    assert isinstance(finding, Finding)
    assert finding.file == __file__
    assert finding.line == _line(fn, "# MARK")
    if primitive is not None:
        assert finding.primitive == primitive
    assert str(finding).startswith(f"{__file__}:{finding.line}: {code} ")
    with pytest.raises(AssertionError, match=code):
        assert_int8(fn, X, W)


def test_messages_say_what_to_do_instead():
    (f101,) = verify(dequantized_matmul, X, W)
    assert "preferred_element_type=jnp.int32" in f101.message and "f32[4,16] x f32[16,3]" in f101.message
    (f201,) = verify(python_if_on_zero, X, W)
    assert "jnp.where" in f201.message and "lax.cond" in f201.message
    (f103,) = verify(broadcast_multiply_sum, X, W)
    assert "4x16x3" in f103.message


def test_nested_jaxprs_are_checked():
    inner = jax.jit(lambda a, b: a @ b)

    def f(x, w):
        y = jax.lax.cond(jnp.sum(x) > 0, lambda: inner(x, w), lambda: jnp.zeros((B, D_OUT)))
        return jax.lax.scan(lambda c, _: (c, jnp.tanh(c @ w)), x, None, length=2)[1], y

    codes = [f.code for f in verify(f, X, W)]
    assert codes == ["JX101", "JX101"]


def test_static_leaves_and_jaxpr_input():
    def f(x, w, activation):
        return activation(x @ w)

    assert [f.code for f in verify(f, X, W, jnp.tanh)] == ["JX101"]
    assert [f.code for f in verify(jax.make_jaxpr(f, static_argnums=2)(X, W, jnp.tanh))] == ["JX101"]


def test_a_broadcast_product_that_is_not_a_matmul_is_fine():
    def scale_rows_and_sum(x, w):
        # rank 3 product of one broadcast operand: no outer-product structure
        t = jnp.broadcast_to(x[:, :, None], (B, D_IN, D_OUT)) * jnp.ones((B, D_IN, D_OUT))
        return jnp.sum(t, axis=1) + seed_reference(x, w)["y"]

    assert verify(scale_rows_and_sum, X, W) == []


# -- int8ify's output keeps the contract -----------------------------------------------------------------
K = jax.random.PRNGKey(0)


def mlp(x, w1, w2):
    return jax.nn.gelu(x @ w1) @ w2


def attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def scanned(x, w1, w2):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w1) @ w1.T, None), x, None, length=3)[0] @ w1 @ w2


def conditional(x, w1, w2):
    return jax.lax.cond(jnp.sum(x) > 0, lambda: (x @ w1) @ w2, lambda: -(x @ w1) @ w2)


def looped(x, w1, w2):
    def body(c):
        i, h = c
        return i + 1, jnp.tanh(h @ w1) @ w1.T

    return jax.lax.while_loop(lambda c: c[0] < 2, body, (0, x))[1] @ w1 @ w2


def rematted(x, w1, w2):
    return jax.checkpoint(lambda a: jax.nn.relu(a @ w1) @ w2)(x)


def custom_jvp(x, w1, w2):
    return dense_with_custom_jvp(jax.nn.relu(dense_with_custom_jvp(x, w1)), w2)


def vmapped(x, w1, w2):
    return jax.vmap(lambda row: (row @ w1) @ w2)(x)


ARGS = (jax.ShapeDtypeStruct((4, 16), jnp.float32), jax.ShapeDtypeStruct((16, 8), jnp.float32),
        jax.ShapeDtypeStruct((8, 5), jnp.float32))
QKV = tuple(jax.ShapeDtypeStruct((2, 6, 2, 8), jnp.float32) for _ in range(3))


@pytest.mark.parametrize(
    "fn, args",
    [(mlp, ARGS), (attention, QKV), (scanned, ARGS), (conditional, ARGS), (looped, ARGS),
     (rematted, ARGS), (custom_jvp, ARGS), (vmapped, ARGS)],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_int8ify_output_is_clean(fn, args):
    assert verify(fn, *args), "the float program should have findings"
    assert verify(int8ify(fn), *args) == []
    assert_int8(int8ify(fn), *args)
    assert verify(jax.jit(int8ify(fn)), *args) == []


def test_int8ify_with_options_is_clean():
    for options in (dict(granularity="per-tensor"), dict(block_size=4)):
        assert verify(int8ify(mlp, **options), *ARGS) == []
    kept = verify(int8ify(mlp, min_contracting_size=10), *ARGS)  # the 8-long contraction stays float
    assert [f.code for f in kept] == ["JX101"]


def test_assert_int8_lists_every_finding():
    def two(x, w):
        jax.debug.print("{}", x)
        return x @ w

    with pytest.raises(AssertionError) as info:
        assert_int8(two, X, W)
    text = str(info.value)
    assert "2 int8 contract finding(s)" in text and "JX101" in text and "JX302" in text


def test_partial_for_static_numbers():
    def f(x, w, n):
        return jnp.matmul(x[:n].astype(jnp.int8), w.astype(jnp.int8), preferred_element_type=jnp.int32)

    assert verify(functools.partial(f, n=2), X, W) == []
