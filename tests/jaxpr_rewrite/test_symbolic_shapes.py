"""``jax.export`` with symbolic shapes: a rewritten program exported for any batch and sequence length gives, at each
concrete shape, the bits of the program traced at that shape, with only int8 dots in its module; a contraction of
symbolic length needs a bound (int32 sums), and without one the error names the dot and the constraint to state."""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import PLATFORMS, dot_problems, examples, reference_dot
from jaxpr_rewrite import Int8ifyError, calibrate_activation_dots, int8ify, quantize_params
from jaxpr_rewrite._numerics.quantize import MAX_INT32_SAFE_CONTRACTION

D = 64


def _dot_operand_types(exported) -> set[tuple[str, str]]:
    """The operand types of every ``dot_general`` in an exported module."""
    return set(re.findall(r"stablehlo\.dot_general .*?: \((tensor<\S+>), (tensor<\S+>)\)", exported.mlir_module()))


def _only_int8_dots(exported) -> bool:
    types = _dot_operand_types(exported)
    return bool(types) and all(re.search(r"[<x]i8>$", t) for pair in types for t in pair)


# the optimized HLO's structure these tests read (a `dot` per int8 dot, the one-row padding, the minimums over codes)
# is XLA:CPU's; elsewhere they check the outputs (a TPU's dots are convolutions, its NaN check another form)
CPU_PROGRAM = jax.default_backend() == "cpu"


def _kernels(program, *args) -> Counter:
    """How many fusions, dots and custom calls ``program``'s optimized HLO at ``args`` holds."""
    return Counter(re.findall(r"= \S+ (fusion|dot|custom-call)\(", program.lower(*args).compile().as_text()))


def _symbol(axis) -> str:
    kind, index = axis
    return f"{kind}{index}"


@given(dot_problems(with_axes=True), st.data())
@examples(12)
def test_any_dimension_numbers_with_symbolic_dims_give_the_traced_programs_bits(problem, data):
    """Any of a dot's dims symbolic (contracting ones bounded): the exported program's output at the drawn shape is
    the program traced at that shape bit for bit, and within the contract's tolerance of the numpy reference."""
    lhs, rhs, dims, lhs_axes, rhs_axes = problem
    labels = sorted(set(lhs_axes) | set(rhs_axes))
    symbolic = [label for label in labels if data.draw(st.booleans())]
    bounds = [f"{_symbol(label)} <= 64" for label in symbolic if label[0] == "contract"]
    symbols = dict(zip(symbolic, jax.export.symbolic_shape(", ".join(map(_symbol, symbolic)), constraints=bounds)
                       if symbolic else ()))

    def spec(x, axes):
        return jax.ShapeDtypeStruct(tuple(symbols.get(a, n) for a, n in zip(axes, x.shape)), x.dtype)

    def f(a, b):
        return jax.lax.dot_general(a, b, dims)

    program = jax.jit(int8ify(f))
    exported = jax.export.export(program)(spec(lhs, lhs_axes), spec(rhs, rhs_axes))
    got = np.asarray(exported.call(lhs, rhs))
    np.testing.assert_array_equal(got, np.asarray(program(lhs, rhs)))
    np.testing.assert_allclose(got.astype(np.float64), reference_dot(lhs, rhs, dims), rtol=2**-7,
                               atol=float(jnp.finfo(lhs.dtype).smallest_subnormal))
    assert _only_int8_dots(exported)


def _attention_block(params, x):
    """A pre-LN-free transformer block: attention over the sequence (its second einsum contracts over it), then a
    gelu MLP."""
    q, k, v = (x @ params[n] for n in ("wq", "wk", "wv"))
    probs = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D), axis=-1)
    x = x + jnp.einsum("bts,bsd->btd", probs, v) @ params["wo"]
    return x + jax.nn.gelu(x @ params["w1"]) @ params["w2"]


def _block_params():
    rng = np.random.default_rng(0)
    params = {n: rng.standard_normal((D, D), np.float32) / 8 for n in ("wq", "wk", "wv", "wo")}
    params["w1"] = rng.standard_normal((D, 4 * D), np.float32) / 8
    params["w2"] = rng.standard_normal((4 * D, D), np.float32) / 16
    return params, rng.standard_normal((2, 16, D), np.float32)


def _block_variant(kind):
    params, x = _block_params()
    if kind == "float weights":
        return int8ify(_attention_block), params
    if kind == "4-bit weights":
        return int8ify(_attention_block), quantize_params(_attention_block, params, x, bits=4)
    if kind == "block scales":
        return int8ify(_attention_block, block_size=32), params
    scales = calibrate_activation_dots(_attention_block, params, x)
    return (int8ify(_attention_block, activation_scales=scales),
            quantize_params(_attention_block, params, x, activations="static"))


@pytest.mark.parametrize("kind", ["float weights", "4-bit weights", "block scales", "static scales everywhere"])
def test_a_transformer_block_exported_for_any_batch_and_sequence(kind):
    """Batch and sequence symbolic (the sequence bounded, as attention contracts over it): at two concrete shapes the
    exported program gives the traced program's bits, and its module holds only int8 dots."""
    fn, params = _block_variant(kind)
    b, t = jax.export.symbolic_shape("b, t", constraints=("t <= 4096",))
    program = jax.jit(fn)
    exported = jax.export.export(program)(params, jax.ShapeDtypeStruct((b, t, D), jnp.float32))
    rng = np.random.default_rng(1)
    for shape in ((1, 5, D), (3, 24, D)):
        x = rng.standard_normal(shape, np.float32)
        np.testing.assert_array_equal(np.asarray(exported.call(params, x)), np.asarray(program(params, x)))
    assert _only_int8_dots(exported)
    # called at a shape, the exported program compiles to no more kernels than the program traced at that shape
    # (the same on JAX 0.10; fewer on 0.11+, whose CPU program inlines the shared dot programs late)
    if CPU_PROGRAM:
        exported_kernels, traced_kernels = _kernels(jax.jit(exported.call), params, x), _kernels(program, params, x)
        assert exported_kernels["dot"] == traced_kernels["dot"] == 8
        assert sum(exported_kernels.values()) <= sum(traced_kernels.values())
    assert any("?" in a for a, _ in _dot_operand_types(exported))  # the shapes stay symbolic in the module


def test_every_platforms_program_lowers_with_symbolic_shapes():
    """The GPU and TPU programs (``lax.platform_dependent`` branches) lower with symbolic shapes too, and the
    fused GPU kernel, whose grid is laid out when tracing, leaves such a dot to the int8 program."""
    params, x = _block_params()
    qparams = quantize_params(_attention_block, params, x)
    b, t = jax.export.symbolic_shape("b, t", constraints=("t <= 4096",))
    spec = jax.ShapeDtypeStruct((b, t, D), jnp.float32)
    exported = jax.export.export(jax.jit(int8ify(_attention_block)), platforms=PLATFORMS)(qparams, spec)
    assert exported.platforms == PLATFORMS and _only_int8_dots(exported)
    fused = jax.export.export(jax.jit(int8ify(_attention_block, backend="int8-fused")), platforms=["cuda"])(
        qparams, spec)
    assert "__gpu$xla.gpu.triton" not in fused.mlir_module() and _only_int8_dots(fused)


def _keys_scores(x, keys):
    return x @ keys.T  # one query row against a cache of keys: contracts over features, keys' rows symbolic


def _weighted_values(probs, values):
    return probs @ values  # contracts over the cache's length


def test_an_unbounded_symbolic_contraction_names_the_dot_and_the_bound_to_state():
    """Whether int32 sums can overflow depends on the contraction's length: without a bound the error names the
    dot, its line and the constraint to state, and that constraint makes the export work."""
    t, = jax.export.symbolic_shape("t")
    program = jax.jit(int8ify(_weighted_values))
    specs = (jax.ShapeDtypeStruct((4, t), jnp.float32), jax.ShapeDtypeStruct((t, D), jnp.float32))
    with pytest.raises(Int8ifyError) as error:
        jax.export.export(program)(*specs)
    message = str(error.value)
    assert re.search(r"dot_general at \S*test_symbolic_shapes\.py:\d+ \(_weighted_values\) \(float32\[4,t\], "
                     r"float32\[t,64\]\) contracts over t products", message)
    constraint = re.search(r'constraints=\("([^"]+)",\)', message).group(1)
    assert constraint == f"t <= {MAX_INT32_SAFE_CONTRACTION}"
    t, = jax.export.symbolic_shape("t", constraints=(constraint,))
    exported = jax.export.export(program)(jax.ShapeDtypeStruct((4, t), jnp.float32),
                                          jax.ShapeDtypeStruct((t, D), jnp.float32))
    probs, values = np.random.default_rng(2).standard_normal((2, 4, 40), np.float32)
    values = np.random.default_rng(3).standard_normal((40, D), np.float32)
    np.testing.assert_array_equal(np.asarray(exported.call(probs, values)), np.asarray(program(probs, values)))
    # a contraction known to be longer than int32 sums allow cannot be cut into chunks of symbolic length
    t, = jax.export.symbolic_shape("t", constraints=(f"t >= {MAX_INT32_SAFE_CONTRACTION + 1}",))
    with pytest.raises(Int8ifyError, match=r"contracts over t products"):
        jax.export.export(program)(jax.ShapeDtypeStruct((4, t), jnp.float32), jax.ShapeDtypeStruct((t, D), jnp.float32))


def test_symbolic_free_dims_need_no_bound():
    """Only contractions need a bound: one query row against a symbolic number of keys (the one-row padding that
    takes XLA:CPU's faster int8 path keeps working) exports unbounded."""
    t, = jax.export.symbolic_shape("t")
    program = jax.jit(int8ify(_keys_scores))
    exported = jax.export.export(program)(jax.ShapeDtypeStruct((1, D), jnp.float32),
                                          jax.ShapeDtypeStruct((t, D), jnp.float32))
    rng = np.random.default_rng(4)
    for rows in (1, 9):
        x, keys = rng.standard_normal((1, D), np.float32), rng.standard_normal((rows, D), np.float32)
        np.testing.assert_array_equal(np.asarray(exported.call(x, keys)), np.asarray(program(x, keys)))


@pytest.mark.parametrize("constraint, int8", [(None, None), ("t >= 32", True), ("t <= 16", False)])
def test_min_contracting_size_with_a_symbolic_contraction(constraint, int8):
    """``min_contracting_size`` keeps short contractions float; a symbolic one must be known to be short or long."""
    t, = jax.export.symbolic_shape("t", constraints=(constraint, "t <= 4096") if constraint else ())
    program = jax.jit(int8ify(_weighted_values, min_contracting_size=32))
    specs = (jax.ShapeDtypeStruct((4, t), jnp.float32), jax.ShapeDtypeStruct((t, D), jnp.float32))
    if int8 is None:
        with pytest.raises(Int8ifyError, match=r"contracts over t products, a symbolic length that must be "
                                               r"known to be >= 32: min_contracting_size=32 keeps shorter ones float"):
            jax.export.export(program)(*specs)
        return
    exported = jax.export.export(program)(*specs)
    assert _only_int8_dots(exported) == int8
    assert int8 or _dot_operand_types(exported) == {("tensor<4x?xf32>", "tensor<?x64xf32>")}


def test_backends_with_float_sums_need_no_bound():
    """The scaled-matmul backends sum in float32: an unbounded symbolic contraction exports."""
    t, = jax.export.symbolic_shape("t")
    program = jax.jit(int8ify(_weighted_values, backend="mxfp8"))
    exported = jax.export.export(program)(jax.ShapeDtypeStruct((4, t), jnp.float32),
                                          jax.ShapeDtypeStruct((t, D), jnp.float32))
    rng = np.random.default_rng(5)
    probs, values = rng.standard_normal((4, 40), np.float32), rng.standard_normal((40, D), np.float32)
    np.testing.assert_array_equal(np.asarray(exported.call(probs, values)), np.asarray(program(probs, values)))


def _recurrence(w, xs):
    def step(h, x):
        h = jnp.tanh(h @ w + x)
        return h, h

    return jax.lax.scan(step, jnp.zeros(xs.shape[1:], xs.dtype), xs)[1]


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_a_scan_over_a_symbolic_number_of_steps(bits):
    """A recurrence over a symbolic number of steps and batch rows, its weight float or quantized (a scan that takes
    a QuantizedArray is run again by the rewrite, its length read off the ``xs``)."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((D, D), np.float32) / 8
    xs = rng.standard_normal((5, 3, D), np.float32)
    weight = w if bits is None else quantize_params(_recurrence, w, xs, bits=bits)
    t, b = jax.export.symbolic_shape("t, b")
    program = jax.jit(int8ify(_recurrence))
    exported = jax.export.export(program)(weight, jax.ShapeDtypeStruct((t, b, D), jnp.float32))
    for shape in ((5, 3, D), (2, 1, D)):
        xs = rng.standard_normal(shape, np.float32)
        np.testing.assert_array_equal(np.asarray(exported.call(weight, xs)), np.asarray(program(weight, xs)))
    assert _only_int8_dots(exported)


def _dot_shapes(program, *args) -> list[str]:
    """The result types of the dots in ``program``'s optimized HLO at ``args``, sorted."""
    return sorted(re.findall(r"= (\S+) dot\(", program.lower(*args).compile().as_text()))


def test_a_symbolic_batch_keeps_the_two_row_dot_of_one_row():
    """XLA:CPU runs a one-row int8 dot on a slow matrix-vector path (5x the exported MLP's time at batch 1 in
    benchmarks/deploy.py), so one row is padded to two. Exported for any batch, the program decides that when it
    runs: at one row and at several it compiles to the dots of the program traced at that batch."""
    params, x = _block_params()
    qparams = quantize_params(_attention_block, params, x)
    program = jax.jit(int8ify(lambda p, x: jnp.tanh(x @ p["wq"]) @ p["w1"]))
    batch, = jax.export.symbolic_shape("batch")
    exported = jax.export.export(program)(qparams, jax.ShapeDtypeStruct((batch, D), jnp.float32))
    for rows in (1, 5):
        x = np.random.default_rng(rows).standard_normal((rows, D)).astype(np.float32)
        if CPU_PROGRAM:
            traced_dots = _dot_shapes(program, qparams, x)
            assert _dot_shapes(jax.jit(exported.call), qparams, x) == traced_dots
            assert traced_dots == sorted([f"s32[{max(rows, 2)},{D}]{{1,0}}", f"s32[{max(rows, 2)},{4 * D}]{{1,0}}"])
        np.testing.assert_array_equal(np.asarray(exported.call(qparams, x)), np.asarray(program(qparams, x)))


def _code_minimums(program, *args) -> int:
    """The int8 reductions (minimums over codes, the NaN check beside a dot) in ``program``'s optimized HLO."""
    return len(re.findall(r"= s8\[[^\]]*\]\S* reduce\(", program.lower(*args).compile().as_text()))


def test_a_symbolic_batch_quantizes_one_row_as_the_traced_program_does():
    """A single row or a small matrix is quantized with the NaN-safe absmax on CPU and a larger one with a check on
    its codes (``operands.quantize_operand``). Exported for any batch, the program decides that when it runs: no
    codes' minimum at one row and at five (320 values), one per dot at 64 (4096), as in the program traced at each
    batch, and the same outputs."""
    params, x = _block_params()
    qparams = quantize_params(_attention_block, params, x)
    program = jax.jit(int8ify(lambda p, x: jnp.tanh(x @ p["wq"]) @ p["w1"]))
    batch, = jax.export.symbolic_shape("batch")
    exported = jax.export.export(program)(qparams, jax.ShapeDtypeStruct((batch, D), jnp.float32))
    for rows, minimums in ((1, 0), (5, 0), (64, 2)):
        x = np.random.default_rng(rows).standard_normal((rows, D)).astype(np.float32)
        x[-1, 3] = np.nan
        if CPU_PROGRAM:
            assert (_code_minimums(jax.jit(exported.call), qparams, x) == _code_minimums(program, qparams, x)
                    == minimums)
        got, want = np.asarray(exported.call(qparams, x)), np.asarray(program(qparams, x))
        np.testing.assert_array_equal(got, want)
        assert np.isnan(got[-1]).all() and (rows == 1 or np.isfinite(got[:-1]).all())
