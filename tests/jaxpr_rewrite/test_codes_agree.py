"""One code per cause, the same everywhere: for a traced value used as a Python value, the lint plugin (reading
the source), ``verify`` (tracing it) and ``int8ify`` (raising ``TracedValueError``) report the same line with
the same JX code and the advice of the one table in ``jx_codes``."""

import importlib.util
import textwrap

import jax
import numpy as np
import pytest

from jaxpr_rewrite import TracedValueError, int8ify
from jaxpr_rewrite._inspect.verify import verify
from jx_codes import CONCRETIZATION, TRACED_CONDITION
from lint_plugin import lint_source

SOURCE = textwrap.dedent('''\
    import math

    import jax
    import jax.numpy as jnp
    import numpy as np


    @jax.jit
    def numpy_sin(x, w):
        return np.sin(x) + 1.0


    @jax.jit
    def numpy_asarray_of_a_matmul(x, w):
        return np.asarray(x @ w)


    @jax.jit
    def math_function(x, w):
        return x * math.exp(x.sum())


    @jax.jit
    def python_if(x, w):
        if x.sum() > 0:
            return x
        return -x


    @jax.jit
    def python_while(x, w):
        while x.sum() > 0:
            x = x - 1.0
        return x


    @jax.jit
    def ternary(x, w):
        return x if x.max() > 0 else -x


    @jax.jit
    def python_and(x, w):
        return (x.sum() > 0) and x


    @jax.jit
    def explicit_bool(x, w):
        return x * bool(x.sum() > 0)


    @jax.jit
    def int_of_a_traced_index(x, w):
        return x[:, int(jnp.argmax(x[0]))]


    @jax.jit
    def float_of_a_reduction(x, w):
        return x / float(x.max())


    @jax.jit
    def item(x, w):
        return x * x.max().item()
''')

EXPECTED = {
    "numpy_sin": CONCRETIZATION,
    "numpy_asarray_of_a_matmul": CONCRETIZATION,
    "math_function": CONCRETIZATION,
    "python_if": TRACED_CONDITION,
    "python_while": TRACED_CONDITION,
    "ternary": TRACED_CONDITION,
    "python_and": TRACED_CONDITION,
    "explicit_bool": CONCRETIZATION,
    "int_of_a_traced_index": CONCRETIZATION,
    "float_of_a_reduction": CONCRETIZATION,
    "item": CONCRETIZATION,
}
_TRACED_VALUE_CODES = {TRACED_CONDITION.code, CONCRETIZATION.code}
X = np.random.default_rng(0).normal(size=(64, 128)).astype(np.float32)
W = np.random.default_rng(1).normal(size=(128, 256)).astype(np.float32)


def _import_as_file(tmp_path_factory, name: str, source: str):
    """``source`` imported from a real file, so JAX's source locations and ``linecache`` point into it."""
    path = tmp_path_factory.mktemp(name) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    return _import_as_file(tmp_path_factory, "traced_values", SOURCE)


def _lint_by_function():
    """``{function name: [(line, code)]}`` of the lint plugin's JX20x reports on SOURCE."""
    lines = SOURCE.splitlines()
    out = {}
    for v in lint_source(SOURCE, raise_errors=True):
        if v.code in _TRACED_VALUE_CODES:
            header = next(text for text in reversed(lines[:v.line]) if text.startswith("def "))
            name = header[len("def "):header.index("(")]
            out.setdefault(name, []).append((v.line, v.code))
    return out


def test_every_case_is_linted():
    assert set(_lint_by_function()) == set(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_lint_verify_and_int8ify_give_one_code_at_one_line(module, name):
    code = EXPECTED[name]
    linted = _lint_by_function()[name]
    assert [c for _, c in linted] == [code.code], linted
    (line, _), = linted

    (finding,) = verify(getattr(module, name), X, W)
    assert (finding.line, finding.code) == (line, code.code)
    assert finding.message.startswith(f"{code.title.rstrip('.')}: {code.instead} (")
    assert finding.primitive.startswith("Tracer") or finding.primitive == "ConcretizationTypeError"

    with pytest.raises(TracedValueError) as info:
        int8ify(getattr(module, name))(X, W)
    assert (info.value.line, info.value.code) == (line, code.code)
    assert f": {code.code} {code.title.rstrip('.')}: {code.instead} (" in str(info.value)


def test_jax_errors_are_what_the_cases_raise(module):
    """The cases cover JAX's tracer-conversion errors, truth values and arrays and scalars alike."""
    raised = set()
    for name in EXPECTED:
        try:
            jax.make_jaxpr(getattr(module, name))(X, W)
        except Exception as exc:  # collecting which error each case raises
            raised.add(type(exc).__name__)
    assert raised == {"TracerBoolConversionError", "TracerArrayConversionError", "ConcretizationTypeError"}


# What a matmul is, decided once: a contraction (a ``dot_general`` that sums over an index, of any size),
# and a broadcast product when two operands are expanded along different axes (the B x D_in x D_out
# products of an emulated matmul). Each line says what both the lint plugin and ``verify`` report there;
# ``lint:`` marks what only the lint plugin reports: one operand expanded and summed over an axis it spans
# is a matrix-vector product in the source, while in the jaxpr a one-sided broadcast product summed over an
# axis looks like a scaled sum (int8ify's own epilogue followed by a sum over the outputs), so ``verify``
# leaves it.
MATMULS = textwrap.dedent('''\
    import operator

    import jax
    import jax.numpy as jnp


    @jax.jit
    def not_contractions(x, w):
        scaled = jnp.einsum("...k,k->...k", x, w[0, :128])
        outer = jnp.einsum("i,j->ij", x[0], w[0]) + jnp.outer(x[0], w[0]) + jnp.tensordot(x[0], w[0], axes=0)
        return scaled, outer


    @jax.jit
    def one_operand_expanded(x, w):
        a, b = x.reshape(4, 16, 128), w.reshape(4, 16, 128, 4)
        return jnp.sum(a[:, :, :, None] * b, axis=2)  # lint: JX103


    @jax.jit
    def contractions(x, w):
        y = jnp.einsum("bk,kn->bn", x, w) + jnp.einsum("bk,kn", x, w)  # JX101 JX101
        scales = x[:, 0][:, None] @ w[0][None, :] + operator.matmul(x, w)  # JX101 JX101
        return y * scales + x.__matmul__(w) + jnp.linalg.multi_dot([x, w, w.T @ w])  # JX101 JX101 JX101


    @jax.jit
    def two_operands_expanded(x, w):
        return jnp.sum(x[:, :, None] * w[None], axis=1)  # JX103


    project = lambda x, w: x @ w  # JX101
    jitted_lambda = jax.jit(project)
''')
_MATMUL_CODES = {"JX101", "JX103"}


def _expected_matmul_findings(prefix=""):
    """``(line, code)`` of the codes a line's comment names after ``prefix``: ``# JX101 JX101`` (both report
    them), ``# lint: JX103`` (with the prefix ``"lint: "``: the lint plugin only)."""
    found = set()
    for i, text in enumerate(MATMULS.splitlines(), 1):
        comment = text.partition("# ")[2]
        if comment.startswith(prefix + "JX"):
            found |= {(i, code) for code in comment[len(prefix):].split()}
    return found


@pytest.fixture(scope="module")
def matmuls(tmp_path_factory):
    return _import_as_file(tmp_path_factory, "matmul_cases", MATMULS)


def test_lint_and_verify_agree_on_what_a_matmul_is(matmuls):
    expected = _expected_matmul_findings()
    linted = {(v.line, v.code) for v in lint_source(MATMULS, raise_errors=True) if v.code in _MATMUL_CODES}
    assert linted == expected | _expected_matmul_findings("lint: ")
    verified = set()
    for name in ("not_contractions", "one_operand_expanded", "contractions", "two_operands_expanded",
                 "jitted_lambda"):
        verified |= {(f.line, f.code) for f in verify(getattr(matmuls, name), X, W)}
    assert verified == expected


def test_verify_counts_each_contraction(matmuls):
    """Every dot_general that sums an index is one JX101 (two in ``multi_dot`` of three, one for the
    ``w.T @ w`` inside it); the einsums that sum nothing are none."""
    assert verify(matmuls.not_contractions, X, W) == []
    assert [f.code for f in verify(matmuls.contractions, X, W)] == ["JX101"] * 8
