"""Dots nested in higher-order primitives are rewritten, and every other param of those primitives kept."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from helpers import assert_all_dots_int8, away_from_ties, iter_eqns, program_dots, reference_dot
from jaxpr_rewrite import Int8ifyError, int8ify
from jaxpr_rewrite._core.reasons import Why
from jaxpr_rewrite._interpret.rules import RULES, register

MATMUL = (((1,), (0,)), ((), ()))
rng = np.random.default_rng(0)
X = away_from_ties(rng.normal(size=(4, 8)), (1,))
W = away_from_ties(rng.normal(size=(8, 8)), (0,))
WANT = reference_dot(X, W, MATMUL)


def run_and_check(f, expected_dots=None, want=WANT):
    """f(x, w) computes x @ w through some higher-order primitive: only int8 dots, reference numbers."""
    rewritten = int8ify(f)
    assert_all_dots_int8(jax.make_jaxpr(rewritten)(X, W), expected_dots)
    got = jax.jit(rewritten)(X, W)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6)
    return rewritten


def test_nested_jit_keeps_params():
    inner = jax.jit(lambda x, w: x @ w, donate_argnums=(0,), inline=False, keep_unused=True)
    rewritten = run_and_check(lambda x, w: inner(x, w), expected_dots=1)
    before = [e for e in jax.make_jaxpr(lambda x, w: inner(x, w))(X, W).eqns if e.primitive.name == "jit"][0]
    after = [e for e in jax.make_jaxpr(rewritten)(X, W).eqns if e.primitive.name == "jit"][0]
    for name, value in before.params.items():
        if name != "jaxpr":
            assert after.params[name] == value, name
    assert after.params["name"] == "<lambda>"
    assert after.params["donated_invars"] == (True, False)


def test_shared_subjaxpr_is_rewritten_once():
    layer = jax.jit(lambda x, w: x @ w)

    def f(x, w):
        return layer(layer(x, w), w)

    jaxpr = jax.make_jaxpr(int8ify(f))(X, W)
    inner = [e.params["jaxpr"] for e in jaxpr.eqns if e.primitive.name == "jit"]
    assert len(inner) == 2 and inner[0] is inner[1]


def test_scan():
    def f(x, w):
        def body(carry, _):
            return carry, carry @ w

        return lax.scan(body, x, None, length=3)[1][1]

    run_and_check(f, expected_dots=1)


def test_while_loop():
    def f(x, w):
        def body(state):
            i, acc = state
            return i + 1, acc + x @ w

        return lax.while_loop(lambda s: s[0] < 2, body, (0, jnp.zeros((4, 8))))[1] / 2

    run_and_check(f, expected_dots=1)


def test_cond_and_switch():
    def f(x, w):
        a = lax.cond(x[0, 0] > -100, lambda: x @ w, lambda: jnp.zeros((4, 8)))
        b = lax.switch(1, [lambda: jnp.ones((4, 8)), lambda: x @ w, lambda: (x * 2) @ w / 2])
        return (a + b) / 2

    run_and_check(f, expected_dots=3)


def test_checkpoint_keeps_policy_and_flags():
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    def f(x, w):
        return jax.checkpoint(lambda x: x @ w, policy=policy, prevent_cse=False)(x)

    rewritten = run_and_check(f, expected_dots=1)
    (remat,) = [e for e in jax.make_jaxpr(rewritten)(X, W).eqns if e.primitive.name in ("remat2", "checkpoint")]
    assert remat.params["policy"] is policy
    assert remat.params["prevent_cse"] is False
    assert remat.params["differentiated"] is False
    # and under grad (differentiated=True inside)
    g = jax.grad(lambda w: int8ify(f)(X, w).sum())(W)
    np.testing.assert_allclose(g, jax.grad(lambda w: f(X, w).sum())(W), rtol=1e-5)


def test_custom_jvp_user_rule():
    @jax.custom_jvp
    def layer(x, w):
        return jnp.tanh(x @ w)

    @layer.defjvp
    def layer_jvp(primals, tangents):
        x, w = primals
        dx, dw = tangents
        y = layer(x, w)
        return y, (1 - y**2) * (dx @ w + x @ dw)

    rewritten = int8ify(layer)
    assert_all_dots_int8(jax.make_jaxpr(rewritten)(X, W), 1)
    # the exact int8 dot, then the device's own tanh (a TPU's is within about 1e-5 of numpy's)
    y = np.asarray(jnp.tanh(np.float32(WANT)), np.float64)
    np.testing.assert_allclose(rewritten(X, W), y, rtol=1e-6)
    # under differentiation the forward pass is still int8 (the jvp rule's primal is rewritten) ...
    value, grad = jax.value_and_grad(lambda w: rewritten(X, w).sum())(W)
    np.testing.assert_allclose(value, y.sum(), rtol=1e-5)
    # ... and the user's rule gives the tangent, with its tangent dots in float
    np.testing.assert_allclose(grad, X.T @ (1 - y**2), rtol=1e-5, atol=1e-5)


def test_custom_vjp_user_rule():
    @jax.custom_vjp
    def layer(x, w):
        return x @ w

    def fwd(x, w):
        return x @ w, (x, w)

    def bwd(res, g):
        x, w = res
        return g @ w.T, x.T @ g

    layer.defvjp(fwd, bwd)
    rewritten = int8ify(layer)
    assert_all_dots_int8(jax.make_jaxpr(rewritten)(X, W), 1)
    np.testing.assert_allclose(rewritten(X, W), WANT, rtol=1e-6)
    value, grad = jax.value_and_grad(lambda w: rewritten(X, w).sum())(W)
    np.testing.assert_allclose(value, WANT.sum(), rtol=1e-5)
    np.testing.assert_allclose(grad, X.T @ np.ones((4, 8)), rtol=1e-5)
    # the forward pass under grad runs int8: its jaxpr holds only int8 dots before the transpose
    fwd_jaxpr = jax.make_jaxpr(lambda w: jax.vjp(lambda w: rewritten(X, w), w)[0])(W)
    assert_all_dots_int8(fwd_jaxpr, 1)


def test_vmap_of_scan():
    def f(x, w):
        return jax.vmap(lambda row: lax.scan(lambda c, _: (c, c @ w), row, None, length=1)[1][0])(x)

    run_and_check(f, expected_dots=1, want=_per_row_reference())


def _per_row_reference():
    # vmap over rows of x of a vector-matrix product: each row is its own "batch" with its own scale,
    # which is also what the per-row scale of the 2-D contract gives.
    return WANT


def test_unknown_higher_order_primitive_with_float_dot_is_an_error(monkeypatch):
    # Pretend a primitive we do not know: hide the 'scan' rule for this test.
    monkeypatch.delitem(RULES, "scan")
    with pytest.raises(Int8ifyError, match=r"primitive 'scan' at .*test_higher_order.py:\d+.*no rule"):
        int8ify(lambda x, w: lax.scan(lambda c, _: (c, c @ w), x, None, length=1)[1])(X, W)


def test_a_primitive_is_registered_once():
    """Registering a second rule for a primitive is an error, not a silent replacement of the first."""
    scan_rule = RULES["scan"]
    with pytest.raises(Int8ifyError, match=r"\['scan'\] already have a rule"):
        register("scan", rewrite=lambda context, params: params)
    assert RULES["scan"] is scan_rule


def test_higher_order_primitive_without_dots_passes_through():
    f = lambda x, w: lax.scan(lambda c, _: (c * 2, c), x, None, length=2)[1]  # noqa: E731
    assert str(jax.make_jaxpr(int8ify(f))(X, W)) == str(jax.make_jaxpr(f)(X, W))


def test_each_rewritten_dot_is_one_equation_at_its_user_line():
    """Each dot becomes one pjit[name=int8_dot_general] equation with the dot's own source line and scope; its
    body, traced once per operand types and shared, points at the library's int8 program."""
    import jaxpr_rewrite
    from jax.extend import source_info_util

    def f(x, w):
        with jax.named_scope("first"):
            h = x @ w  # DOT1
        with jax.named_scope("second"):
            return jnp.tanh(h) @ w, h.T @ x  # DOT2 (same types as DOT1), DOT3 (other types)

    jaxpr = jax.make_jaxpr(int8ify(f))(X, W)
    calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    assert [e.params["name"] for e in calls] == ["int8_dot_general"] * 3
    lines = [source_info_util.summarize(e.source_info) for e in calls]
    assert all("test_higher_order.py" in line and line.endswith(".f)") for line in lines), lines
    line_numbers = [line.split(":")[1] for line in lines]
    assert line_numbers[1] == line_numbers[2] != line_numbers[0]
    assert [str(e.source_info.name_stack) for e in calls] == ["first", "second", "second"]
    # the first two dots have the same operand types and share one body
    bodies = {id(e.params["jaxpr"]) for e in calls}
    assert len(bodies) == 2
    library = os.path.dirname(jaxpr_rewrite.__file__)
    for e in calls:
        for inner in iter_eqns(e.params["jaxpr"]):
            assert library in source_info_util.summarize(inner.source_info) or not str(
                source_info_util.summarize(inner.source_info)).strip(), inner
    # every other equation of the program keeps the user's line
    others = [e for e in jaxpr.jaxpr.eqns if e not in calls]
    assert all("test_higher_order.py" in source_info_util.summarize(e.source_info) for e in others)


def test_no_nested_jit_noise():
    """No jnp-helper jits (jit[_where], jit[clip]) anywhere: the only call is the shared int8 program."""
    jaxpr = jax.make_jaxpr(int8ify(lambda x, w: x @ w))(X, W)
    calls = [e for e in iter_eqns(jaxpr) if e.primitive.name in ("jit", "pjit")]
    assert [e.params["name"] for e in calls] == ["int8_dot_general"]
    assert len(program_dots(jaxpr)) == 1


# -- primitives that hold sub-jaxprs beyond control flow ------------------------------------------------------------
LINEAR_SOLVERS = {
    "linalg.solve": lambda a, b, w: jnp.linalg.solve(a, b @ w),
    "linalg.inv": lambda a, b, w: jnp.linalg.inv(a) @ b,
    "scipy.linalg.solve": lambda a, b, w: jax.scipy.linalg.solve(a, b @ w),
    "sparse.linalg.cg": lambda a, b, w: jax.scipy.sparse.linalg.cg(lambda v: a @ v, b @ w)[0],
}


@pytest.mark.parametrize("name", list(LINEAR_SOLVERS))
def test_linear_solves_are_rewritten_not_refused(name):
    """custom_linear_solve: its forward solve is rewritten; matvec/vecmat/transpose_solve only define
    derivatives and stay float (like a custom_jvp rule's tangent dots), and verify does not count them."""
    fn = LINEAR_SOLVERS[name]
    a = (rng.normal(size=(64, 64)) + 16 * np.eye(64)).astype(np.float32)
    b = rng.normal(size=(64,)).astype(np.float32)
    w = rng.normal(size=(64, 64)).astype(np.float32) / 8
    got = jax.jit(int8ify(fn))(a, b, w)
    want = jax.jit(fn)(a, b, w)  # jitted: one compilation, not one per primitive of the solver
    # cg iterates with int8 matvecs and int8 inner products: it converges to the int8 operator's solution
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < (0.15 if name == "sparse.linalg.cg" else 0.05)
    grads = jax.jit(jax.grad(lambda a: int8ify(fn)(a, b, w).sum()))(a)
    assert np.all(np.isfinite(grads))
    from jaxpr_rewrite import report, verify

    rows = report(fn, a, b, w)
    assert all(r.rewritten or (r.reason.why is Why.DERIVATIVE_ONLY and str(r.reason).startswith(
        "runs only for derivatives")) for r in rows), rows
    assert verify(int8ify(fn), a, b, w) == []


def test_custom_vmap_rule_is_rewritten_too():
    @jax.custom_batching.custom_vmap
    def dense(x, w):
        return x @ w

    @dense.def_vmap
    def dense_rule(axis_size, in_batched, x, w):
        return jnp.einsum("bij,jk->bik", x, w), True

    xs = away_from_ties(rng.normal(size=(3, 4, 8)), (2,))
    f = jax.vmap(int8ify(dense), in_axes=(0, None))
    assert_all_dots_int8(jax.make_jaxpr(f)(xs, W))
    np.testing.assert_allclose(np.asarray(f(xs, W), np.float64),
                               np.stack([reference_dot(x, W, MATMUL) for x in xs]), rtol=1e-5)


def test_skipped_dots_inside_a_primitive_without_a_rule_are_fine(monkeypatch):
    """A primitive int8ify has no rule for is an error only when it holds a dot the options rewrite."""
    monkeypatch.delitem(RULES, "scan")
    f = lambda x, w: lax.scan(lambda c, _: (c, c @ w), x, None, length=1)[1]  # noqa: E731
    got = int8ify(f, skip_if=lambda eqn: True)(X, W)
    np.testing.assert_allclose(got, f(X, W), rtol=1e-6)


def test_errors_inside_library_code_point_at_the_users_call(monkeypatch):
    """Equations built inside a library function (jnp.linalg.solve's custom_linear_solve) carry no user frame;
    the error names the user's call instead of a blank location."""
    monkeypatch.delitem(RULES, "custom_linear_solve")
    a = np.eye(8, dtype=np.float32) * 2
    cg = lambda a, b: jax.scipy.sparse.linalg.cg(lambda v: a @ v, b)[0]  # noqa: E731
    with pytest.raises(Int8ifyError, match=r"'custom_linear_solve' at .*test_higher_order.py:\d+"):
        int8ify(cg)(a, np.ones(8, np.float32))
