"""report: one row per dot_general (nested ones included) with source, scope, types, dimension numbers,
the rewrite's decision, and the measured int8 error on real inputs."""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import away_from_ties, dense_with_custom_jvp, reference_dot
from jaxpr_rewrite import int8ify
from jaxpr_rewrite._core.reasons import KeptFloat, Why
from jaxpr_rewrite._inspect.report import DotRow, Report, report

MATMUL = (((1,), (0,)), ((), ()))
rng = np.random.default_rng(0)
X = rng.normal(size=(8, 32)).astype(np.float32)
W1 = rng.normal(size=(32, 16)).astype(np.float32)
W2 = rng.normal(size=(16, 4)).astype(np.float32)


def _line(fn, marker):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def model(x, w1, w2):
    with jax.named_scope("encoder"):
        h = jax.nn.relu(x @ w1)  # DOT0
    with jax.named_scope("head"):
        return h @ w2  # DOT1


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def test_rows_describe_each_dot():
    rep = report(model, X, W1, W2)
    assert isinstance(rep, Report) and len(rep) == 2
    r0, r1 = rep
    assert isinstance(r0, DotRow)
    assert (r0.file, r0.line, r0.function) == (__file__, _line(model, "# DOT0"), "model")
    assert r1.line == _line(model, "# DOT1")
    assert (r0.scope, r1.scope) == ("encoder", "head")
    assert (r0.lhs, r0.rhs, r0.out) == ("f32[8,32]", "f32[32,16]", "f32[8,16]")
    assert r0.dimension_numbers == MATMUL
    assert r0.rewritten and r0.reason is None and r1.rewritten
    assert rep.measured


def test_float_convolutions_are_named_in_the_summary():
    """A convolution stays float (int8ify rewrites matmuls): the report used to say "1 dot_general(s)" and nothing
    of it, though the report is where users look."""
    def conv_net(kernel, w, x):
        y = jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME")
        return jax.nn.relu(y.reshape(y.shape[0], -1)) @ w

    rng = np.random.default_rng(5)
    kernel, x = rng.normal(size=(4, 3, 3, 3)).astype(np.float32), rng.normal(size=(2, 3, 8, 8)).astype(np.float32)
    r = report(conv_net, kernel, rng.normal(size=(256, 10)).astype(np.float32), x)
    line = inspect.getsourcelines(conv_net)[1] + 1
    (where,) = r.convolutions
    assert len(r) == 1 and re.fullmatch(rf".*test_report\.py:{line} \(.*conv_net\)", where)
    assert str(r).splitlines()[-1].endswith(
        f"; 1 float convolution(s) not rewritten (int8ify rewrites matmuls only): {where}")
    assert "not rewritten" not in report(lambda w, x: x @ w, np.ones((32, 4), np.float32), X).summary()


def test_measured_error_is_the_int8_dot_against_the_float_dot():
    x = away_from_ties(X, (1,))
    w1 = away_from_ties(W1, (0,))
    rep = report(model, x, w1, W2)
    # the first dot sees the inputs themselves: its error is the contract's against the float product
    want = _rel(reference_dot(x, w1, MATMUL), x.astype(np.float64) @ w1.astype(np.float64))
    assert rep[0].error == pytest.approx(want, rel=1e-3)
    assert 1e-4 < rep[0].error < 5e-2
    # the second dot sees the *float* program's hidden activations, after the relu
    pre = np.asarray(jax.jit(lambda a, b: a @ b)(x, w1))
    h = np.maximum(pre, 0)
    want = _rel(reference_dot(h, W2, MATMUL), h.astype(np.float64) @ W2.astype(np.float64))
    assert rep[1].error == pytest.approx(want, rel=1e-2)
    # ... which the check tells apart from the activations before it
    without_relu = _rel(reference_dot(pre, W2, MATMUL), pre.astype(np.float64) @ W2.astype(np.float64))
    assert rep[1].error != pytest.approx(without_relu, rel=1e-2)
    assert rep.worst() in (rep[0], rep[1])


def test_matmuls_that_share_params_but_not_types_are_measured_each_as_itself():
    """The measuring pass shares one program between matmuls of equal params; a bfloat16 and a float32 dot with
    the same dimension numbers (and no preferred type) must still each be measured in its own dtype."""
    dims = (((1,), (0,)), ((), ()))

    def f(x, w, xb, wb):
        return jax.lax.dot_general(x, w, dims), jax.lax.dot_general(xb, wb, dims)

    x, w = away_from_ties(X, (1,)), away_from_ties(W1, (0,))
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    both = report(f, x, w, xb, wb)
    assert both[0].eqn.params == both[1].eqn.params and both[0].lhs != both[1].lhs
    alone = [report(lambda a, b: jax.lax.dot_general(a, b, dims), *pair)[0].error for pair in ((x, w), (xb, wb))]
    assert [row.error for row in both] == pytest.approx(alone, rel=1e-6)
    assert alone[0] != pytest.approx(alone[1], rel=1e-2)


def test_options_of_an_int8ified_function_decide():
    rep = report(int8ify(model, skip=["head*"]), X, W1, W2)
    assert [r.rewritten for r in rep] == [True, False]
    assert rep[1].reason == KeptFloat(Why.SKIP_PATTERN, "name scope 'head' matches skip pattern 'head*'")
    assert rep[1].error is not None  # what rewriting it would cost
    rep = report(int8ify(model, min_contracting_size=20), X, W1, W2)
    assert rep[1].reason.why is Why.SMALL_CONTRACTION and "min_contracting_size=20" in str(rep[1].reason)
    rep = report(int8ify(model, skip_if=lambda eqn: eqn.invars[0].aval.shape[-1] == 32), X, W1, W2)
    assert rep[0].reason == KeptFloat(Why.SKIP_IF, "skip_if returned True")


def test_abstract_inputs_trace_only():
    spec = [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (X, W1, W2)]
    rep = report(model, *spec)
    assert not rep.measured and [r.error for r in rep] == [None, None]
    assert "-" in str(rep)


def nested(x, w1, w2, codes):
    inner = jax.jit(lambda a, b: a @ b)
    h = inner(x, w1)  # 0: jit
    h = jax.checkpoint(lambda a: jnp.tanh(a @ w1.T))(h)  # 1: remat
    h = jax.lax.cond(jnp.sum(x) > -1e9, lambda a: a @ w1, lambda a: -(a @ w1), h)  # 2, 3: cond branches
    h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w1.T) @ w1, None), h, None, length=3)  # 4, 5: scan
    h = jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w1.T) @ w1), (0, h))[1]  # 6, 7
    h = dense_with_custom_jvp(h, w2)  # 8: custom_jvp primal
    ints = jnp.matmul(codes, codes.T, preferred_element_type=jnp.int32)  # 9: integer
    return h, ints


def test_nested_dots_are_listed_and_measured():
    codes = rng.integers(-127, 128, size=(4, 6)).astype(np.int8)
    rep = report(nested, X, W1, W2, codes)
    assert len(rep) == 10
    assert [r.rewritten for r in rep] == [True] * 9 + [False]
    assert rep[9].reason == KeptFloat(Why.INTEGER_DOT, "integer dot")
    assert rep[9].lhs == "i8[4,6]" and rep[9].out == "i32[4,4]"
    errors = [r.error for r in rep]
    # cond: branch 0 is the false branch, not taken
    assert errors[2] is None and rep[2].note == "n/a (branch not taken)"
    for i in (0, 1, 3, 4, 5, 6, 7, 8):
        assert errors[i] is not None and 0 < errors[i] < 0.1, (i, rep[i])
    assert rep[8].line == _line(dense_with_custom_jvp, "# CJVP")
    assert errors[9] is None
    table = str(rep)
    assert "n/a (branch not taken)" in table and "integer dot" in table


def test_table_is_aligned():
    rep = report(int8ify(model, skip="head"), X, W1, W2)
    lines = str(rep).splitlines()
    header, rows, summary = lines[0], lines[1:-1], lines[-1]
    for column in ("source", "scope", "operands", "dimension numbers", "int8", "error", "why not"):
        assert column in header
    col = header.index("int8")
    assert [row[col:col + 3].strip() for row in rows] == ["yes", "no"]
    assert summary.startswith("2 dot_general(s): 1 rewritten to int8, 1 kept in float, 0 integer")
    assert "test_report.py:" in rows[0]


def test_static_arguments_of_an_int8ified_function():
    f = int8ify(lambda x, w, act: act(x @ w), static_argnames="act")
    rep = report(f, X, W1, act=jnp.tanh)
    assert len(rep) == 1 and rep[0].error is not None


def test_report_with_prequantized_weights():
    """QuantizedArray inputs are reported through their dequantized values."""
    from jaxpr_rewrite import quantize_params

    rng = np.random.default_rng(11)
    params = {"w": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)

    def f(params, x):
        return x @ params["w"]

    q = quantize_params(f, params, x)
    rows = list(int8ify(f).report(q, x))
    assert len(rows) == 1 and rows[0].rewritten and rows[0].error is not None and rows[0].error < 0.05


def test_a_nan_error_is_the_worst_and_the_summary_names_it():
    """Python's ``max`` skips a NaN key that does not come first: the summary named a finite error as the largest
    while another dot's outputs held NaN (Inf in its weight, Inf - Inf in the error)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 512)).astype(np.float32)
    w1, w2 = (rng.standard_normal((512, 256)).astype(np.float32) for _ in range(2))
    w2[3, 4] = np.inf
    r = report(int8ify(lambda p, x: (x @ p["w1"], x @ p["w2"])), {"w1": w1, "w2": w2}, x)
    assert np.isfinite(r.rows[0].error) and np.isnan(r.rows[1].error)
    assert r.worst().index == 1
    assert re.search(r"largest int8 error nan at #1 ", r.summary())
