"""The ``"int8-fused"`` backend: a float activation times a 2-D weight (pre-quantized, or float and quantized in the
program) as one Pallas kernel on an NVIDIA GPU. The kernel runs here in Pallas' interpreter (the same float64 and
integer arithmetic), against the ``"int8"`` backend's program bit for bit (dynamic and static activation scales)
and against the independent numpy reference of the contract; the program lowered for CUDA holds one kernel per
fitting dot (one for sibling dots of one activation) and leaves the others to XLA; sharded operands stay
sharded."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import CPU, examples, iter_eqns, reference_dot, with_zero_and_non_finite_rows
from jaxpr_rewrite import Int8ifyError, int8ify, quantize_params
from jaxpr_rewrite._platforms.fused_gpu_dot import fused_dot, fused_dots

TINY = np.finfo(np.float32).tiny
# (rows, contraction, columns): blocks that divide and that overhang, contractions of 32-wide to 128-wide steps
SHAPES = [(1, 64, 128), (8, 256, 200), (70, 384, 64), (3, 1056, 130)]

# the kernels are CUDA's program: each test traces its programs for CUDA, CPU and TPU (runs take the CPU's)
pytestmark = pytest.mark.usefixtures("every_platform_programs")


def _dense(params, x):
    return x @ params["w"]


def _dense_transposed(params, x):
    return x @ params["w"].T


@st.composite
def cases(draw):
    rows, k, n = draw(st.sampled_from(SHAPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "quarters", "bfloat16", "tiny", "huge", "binades"]))
    x = rng.normal(size=(rows, k))
    if kind == "quarters":  # rich in rounding ties
        x = rng.integers(-300, 300, size=(rows, k)) / 4.0
    elif kind == "bfloat16":
        x = np.array(jnp.asarray(x * 3, jnp.bfloat16).astype(jnp.float32))
    elif kind in ("tiny", "huge"):
        x = x * 2.0 ** (-120 if kind == "tiny" else 120)
    elif kind == "binades":
        x = x * 2.0 ** rng.integers(-100, 100, size=(rows, 1))
    x = np.array(x, np.float32)
    x[np.abs(x) < TINY] = 0.0  # XLA reads subnormal inputs as zero; the kernel on a GPU reads them as they are
    x, bad_rows = with_zero_and_non_finite_rows(draw, x, max_bad=2)
    transposed = draw(st.booleans())
    w = np.array(rng.normal(size=(n, k) if transposed else (k, n)), np.float32)
    w[:, 0] = 0  # an all-zero weight column (or row of the transposed layout): scale 1
    return x, w, transposed, bad_rows


@pytest.fixture(autouse=True, scope="module")
def _on_the_cpu_where_the_default_device_is_a_tpu():
    """The kernel is a GPU's, run here in Pallas' interpreter, whose float64 and unsigned arithmetic XLA:TPU does not
    compile (``Binary op add with different element types: s32 and u32``): on a TPU host the tests run on the CPU."""
    with jax.default_device(CPU if jax.default_backend() == "tpu" else None):
        yield


# Pallas' interpreter fills the out-of-bounds part of a float64 block with NaN after the kernel's x64 context
@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64 requested in full:UserWarning")
@examples(20)
@given(cases(), st.booleans())
def test_the_kernel_is_the_int8_backends_program_bit_for_bit(case, per_call):
    """With the weight from quantize_params, or float and quantized in the program (``per_call``)."""
    x, w, transposed, bad_rows = case
    fn = _dense_transposed if transposed else _dense
    params = {"w": jnp.asarray(w)} if per_call else quantize_params(fn, {"w": jnp.asarray(w)}, jnp.asarray(x))
    want = np.asarray(int8ify(fn)(params, jnp.asarray(x)))
    got = np.asarray(jax.jit(lambda p, v: fused_dot(v, p["w"], int(transposed), interpret=True))(params, x))
    np.testing.assert_array_equal(got, want)  # NaN where the other has NaN
    assert np.isnan(got[bad_rows]).all()  # a row holding NaN or Inf: every output NaN (its codes 0, its scale Inf)
    finite = np.setdiff1d(np.arange(x.shape[0]), bad_rows)
    reference = reference_dot(x[finite], w.T if transposed else w, (((1,), (0,)), ((), ())))
    # (results below float32's normal range are flushed to zero by XLA)
    np.testing.assert_allclose(got[finite], reference, rtol=2e-7, atol=TINY)


@examples(10)
@given(cases(), st.sampled_from([0.5, 1.0, 3.0]))
def test_with_a_static_scale_the_kernel_is_the_int8_backends_program_bit_for_bit(case, beyond):
    """Calibrated on the finite rows, then run on them times ``beyond``: at 3 most values saturate at +-127."""
    x, w, transposed, bad_rows = case
    fn = _dense_transposed if transposed else _dense
    finite = np.setdiff1d(np.arange(x.shape[0]), bad_rows)
    calibration = x[finite] if finite.size and np.abs(x[finite]).max() > 0 else np.ones_like(x)
    params = quantize_params(fn, {"w": jnp.asarray(w)}, jnp.asarray(calibration), activations="static")
    run = np.array(x * np.float32(beyond), np.float32)
    want = np.asarray(int8ify(fn)(params, jnp.asarray(run)))
    got = np.asarray(jax.jit(lambda p, v: fused_dot(v, p["w"], int(transposed), interpret=True))(params, run))
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[bad_rows]).all()


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64 requested in full:UserWarning")
@examples(6)
@given(st.lists(st.tuples(st.sampled_from(["dynamic", "static", "float"]), st.booleans(),
                          st.sampled_from([64, 130, 200])), min_size=2, max_size=3),
       st.sampled_from([1, 70]), st.integers(0, 2**32 - 1))
def test_sibling_dots_in_one_kernel_give_each_dots_numbers(weights, rows, seed):
    """Weights of one activation in one grid, each in its own range of column blocks: each result is the ``int8``
    backend's for its weight alone, bit for bit, whatever their kinds, layouts and widths (blocks that overhang)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(rows, 256)), jnp.float32)
    operands, fns = [], []
    for kind, transposed, n in weights:
        fn = _dense_transposed if transposed else _dense
        w = {"w": jnp.asarray(rng.normal(size=(n, 256) if transposed else (256, n)), jnp.float32)}
        operands.append(w if kind == "float" else quantize_params(fn, w, x, activations=kind))
        fns.append(fn)
    contractings = [int(transposed) for _, transposed, _ in weights]
    got = jax.jit(lambda v, ws: fused_dots(v, [w["w"] for w in ws], contractings, interpret=True))(x, operands)
    for out, fn, params in zip(got, fns, operands):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(int8ify(fn))(params, x)))


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64 requested in full:UserWarning")
def test_under_vmap_a_batch_of_activations_is_more_rows_and_a_batch_of_weights_a_batched_kernel():
    """The kernel's partitioning rule (custom_partitioning) has no batching rule of its own: vmap failed."""
    rng = np.random.default_rng(5)
    xs = jnp.asarray(rng.normal(size=(3, 20, 128)), jnp.float32)
    ws = jnp.asarray(rng.normal(size=(2, 128, 64)), jnp.float32)
    params = quantize_params(_dense, {"w": ws[0]}, xs[0])
    run = lambda v, w: fused_dot(v, w, 0, interpret=True)  # noqa: E731
    got = jax.jit(jax.vmap(run, in_axes=(0, None)))(xs, params["w"])
    want = np.stack([np.asarray(int8ify(_dense)(params, v)) for v in xs])
    np.testing.assert_array_equal(np.asarray(got), want)
    got = jax.jit(jax.vmap(run, in_axes=(None, 0)))(xs[0], ws)  # float weights, one per example
    want = np.stack([np.asarray(int8ify(_dense)({"w": w}, xs[0])) for w in ws])
    np.testing.assert_array_equal(np.asarray(got), want)
    siblings = jax.jit(jax.vmap(lambda v: fused_dots(v, (params["w"], ws[1]), (0, 0), interpret=True)))(xs)
    for got, weight in zip(siblings, ({"w": params["w"]}, {"w": ws[1]})):
        want = np.stack([np.asarray(int8ify(_dense)(weight, v)) for v in xs])
        np.testing.assert_array_equal(np.asarray(got), want)


def _projection(params, x):
    """Flax's ``DenseGeneral`` attention projections: ``(d, heads, head_dim)`` in, ``(heads, head_dim, d)`` out."""
    heads = jax.lax.dot_general(x, params["qkv"], (((2,), (0,)), ((), ())))
    return jax.lax.dot_general(jnp.tanh(heads), params["out"], (((2, 3), (0, 1)), ((), ())))


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64 requested in full:UserWarning")
@pytest.mark.parametrize("kind", ["dynamic", "static", "float"])
def test_weights_of_more_axes_contracted_over_leading_or_trailing_ones(kind):
    """A weight of several free or contracting axes is the matrix they flatten to: the kernel's numbers are the
    ``int8`` backend's, bit for bit, and on CUDA both of Flax's attention projections are kernels."""
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.normal(size=(2, 24, 128)), jnp.float32)
    params = {"qkv": jnp.asarray(rng.normal(size=(128, 4, 32)) / 11, jnp.float32),
              "out": jnp.asarray(rng.normal(size=(4, 32, 128)) / 11, jnp.float32)}
    if kind != "float":
        params = quantize_params(_projection, params, x, activations=kind)
    heads = fused_dot(x, params["qkv"], (0,), interpret=True)
    want = jax.jit(int8ify(lambda p, v: jax.lax.dot_general(v, p["qkv"], (((2,), (0,)), ((), ())))))(params, x)
    np.testing.assert_array_equal(np.asarray(heads), np.asarray(want))
    h = jnp.tanh(heads)
    outs = [fused_dot(h, params["out"], (0, 1), interpret=True)]
    if kind == "float":  # the same weight stored (d, heads, head_dim): contracted over its trailing axes
        outs.append(fused_dot(h, jnp.transpose(params["out"], (2, 0, 1)), (1, 2), interpret=True))
    want = jax.jit(int8ify(lambda p, v: jax.lax.dot_general(v, p["out"], (((2, 3), (0, 1)), ((), ())))))(params, h)
    for out in outs:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    assert _kernels(jax.make_jaxpr(int8ify(_projection, backend="int8-fused", late_inlining=False))(params, x)) == 2


def test_bfloat16_activations_and_any_leading_shape():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 3, 5, 128)), jnp.bfloat16)
    params = quantize_params(_dense, {"w": jnp.asarray(rng.normal(size=(128, 96)), jnp.float32)}, x)
    got = fused_dot(x, params["w"], 0, interpret=True)
    assert got.shape == (2, 3, 5, 96) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(int8ify(_dense)(params, x), np.float32).astype(np.float32))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (tests/conftest.py sets them)")
@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64 requested in full:UserWarning")
@pytest.mark.parametrize("transposed, per_call", [(False, False), (True, False), (False, True)])
def test_sharded_rows_and_columns_stay_sharded(transposed, per_call):
    """XLA does not partition a Pallas kernel by itself: without the kernel's partitioning rule it gathered the
    whole activation onto every device and replicated the result (read in the deviceless 2 x H200 compile)."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(64, 256)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(256, 256)), jnp.float32)
    fn = _dense_transposed if transposed else _dense
    params = quantize_params(fn, {"w": w}, x)
    want = np.asarray(int8ify(fn)(params, x))
    columns = NamedSharding(mesh, P("model", None) if transposed else P(None, "model"))
    if per_call:  # a float weight, quantized in the program
        params = {"w": w}
        want = np.asarray(int8ify(fn)(params, x))
        sharded = {"w": jax.device_put(w, columns)}
    else:
        sharded = {"w": params["w"].replace(codes=jax.device_put(params["w"].codes, columns))}
    run = jax.jit(lambda p, v: fused_dot(v, p["w"], int(transposed), interpret=True))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    got = run(sharded, xs)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert got.sharding.spec == P("data", "model")
    assert "all-gather" not in run.lower(sharded, xs).compile().as_text()
    siblings = jax.jit(lambda p, v: fused_dots(v, (p["w"], p["w"]), (int(transposed),) * 2, interpret=True))
    for out in siblings(sharded, xs):
        np.testing.assert_array_equal(np.asarray(out), want)
        assert out.sharding.spec == P("data", "model")
    assert "all-gather" not in siblings.lower(sharded, xs).compile().as_text()


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (tests/conftest.py sets them)")
def test_inside_shard_map():
    """shard_map checks what its body's values vary over; the kernel's result said nothing (a ValueError when the
    program was traced). Traced only: Pallas' interpreter itself fails that check inside shard_map."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(64, 128)), jnp.float32)
    params = quantize_params(_dense, {"w": jnp.asarray(rng.normal(size=(128, 64)), jnp.float32)}, x)
    run = jax.shard_map(lambda p, v: fused_dot(v, p["w"], 0), mesh=mesh, in_specs=(P(), P("data", None)),
                        out_specs=P("data", None))
    traced = jax.jit(run).trace(jax.device_put(params, NamedSharding(mesh, P())),
                                jax.device_put(x, NamedSharding(mesh, P("data", None))))
    assert _kernels(traced.jaxpr) == 1


def _mlp(params, x):
    for layer in params:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    return x


def _mlp_params(width=256, layers=3):
    rng = np.random.default_rng(1)
    return [{"w": jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32),
             "b": jnp.asarray(rng.normal(size=width) / 10, jnp.float32)} for _ in range(layers)]


def test_off_a_gpu_the_backend_is_the_int8_one():
    params, x = _mlp_params(), jnp.asarray(np.random.default_rng(2).normal(size=(64, 256)), jnp.float32)
    q = quantize_params(_mlp, params, x)
    np.testing.assert_array_equal(np.asarray(int8ify(_mlp, backend="int8-fused")(q, x)),
                                  np.asarray(int8ify(_mlp)(q, x)))
    grad = jax.grad(lambda p: int8ify(_mlp, backend="int8-fused")(p, x).sum())(params)  # straight-through
    assert all(np.isfinite(np.asarray(g["w"])).all() for g in grad)


def _kernels(jaxpr) -> int:
    return sum(e.primitive.name == "pallas_call" for e in iter_eqns(jaxpr, platform="cuda"))


def test_on_cuda_each_pre_quantized_dot_is_one_kernel_and_the_rest_xlas():
    params, x = _mlp_params(), jnp.asarray(np.random.default_rng(3).normal(size=(64, 256)), jnp.float32)
    q = quantize_params(_mlp, params, x)
    fused = int8ify(_mlp, backend="int8-fused", late_inlining=False)
    assert _kernels(jax.make_jaxpr(fused)(q, x)) == 3
    assert _kernels(jax.make_jaxpr(int8ify(_mlp, late_inlining=False))(q, x)) == 0
    static = quantize_params(_mlp, params, x, activations="static")
    assert _kernels(jax.make_jaxpr(fused)(static, x)) == 3
    assert _kernels(jax.make_jaxpr(fused)(params, x)) == 3  # float weights, quantized in the program
    # batch dimensions (attention's einsums), a float64 output: XLA's program
    heads = x.reshape(4, 16, 256)
    assert _kernels(jax.make_jaxpr(int8ify(lambda a, b: jnp.einsum("bij,bkj->bik", a, b),
                                           backend="int8-fused"))(heads, heads)) == 0
    with jax.enable_x64(True):
        wide = int8ify(lambda p, v: jnp.matmul(v, p[0]["w"], preferred_element_type=jnp.float64),
                       backend="int8-fused")
        assert _kernels(jax.make_jaxpr(wide)(q, x)) == 0


def _attention_parts(params, x):
    """Attention's query, key and value projections of one activation, a fourth dot whose weight is computed after
    the first of them (so it cannot join their kernel, which runs there), and a float result of all four."""
    h = jnp.tanh(x)
    q, k, v = h @ params["wq"], h @ params["wk"].T, h @ params["wv"]
    late = h @ (params["wo"] * q.mean())
    return q, k, v, late, jax.nn.softmax(q * k, axis=-1) * v + late


def _attention_projections(params, x):
    return _attention_parts(params, x)[-1]


def _projection_params(width=256):
    rng = np.random.default_rng(7)
    return {name: jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32)
            for name in ("wq", "wk", "wv", "wo")}


@pytest.mark.parametrize("weights", ["dynamic", "static", "smoothed", "float"])
def test_sibling_dots_of_one_activation_are_one_kernel(weights):
    """The query, key and value projections: one kernel where bfloat16 has XLA merge them into one GEMM; the
    fourth dot's weight does not exist yet when they run: a kernel of its own. Off a GPU the numbers are the
    ``int8`` backend's, bit for bit, and so are the straight-through gradients but for the order in which the
    activation's cotangents from its three dots are added."""
    params = _projection_params()
    x = jnp.asarray(np.random.default_rng(8).normal(size=(64, 256)), jnp.float32)
    options = {"dynamic": {}, "static": {"activations": "static"}, "smoothed": {"smooth_alpha": 0.5}}
    if weights != "float":
        params = quantize_params(_attention_projections, params, x, **options[weights])
    fused = int8ify(_attention_projections, backend="int8-fused", late_inlining=False)
    # SmoothQuant leaves the transposed key weight unsmoothed: its dot reads the activation, the others its rescaling
    assert _kernels(jax.make_jaxpr(fused)(params, x)) == (3 if weights == "smoothed" else 2)
    plain = int8ify(_attention_projections)
    # the dots bit for bit; the softmax after them only closely: XLA:GPU compiles it into a different kernel in
    # each program (with the int8 backend's epilogues fused into it, a Triton fusion of 4 warps, else of 1), whose
    # row sums are added in a different order
    parts = [jax.jit(int8ify(_attention_parts, **backend))(params, x)
             for backend in ({"backend": "int8-fused", "late_inlining": False}, {})]
    for got, want in zip(parts[0][:-1], parts[1][:-1]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(np.asarray(parts[0][-1]), np.asarray(parts[1][-1]), rtol=1e-5, atol=1e-6)
    grads = [jax.grad(lambda v, f=f: f(params, v).sum())(x) for f in (fused, plain)]
    np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(grads[1]), rtol=1e-5, atol=1e-7)


def _weight_made_on_the_way(params, x):
    h = jnp.tanh(x)
    return h @ params["wq"] + h @ (params["wk"] * 2.0).astype(jnp.bfloat16).astype(jnp.float32)


def test_a_weight_computed_after_the_first_sibling_is_computed_there():
    """The second weight is scaled by a literal and cast after the first dot: those equations run early, at the
    first dot, and the two dots are one kernel (a literal operand of them failed the rewrite)."""
    params = {k: v for k, v in _projection_params().items() if k in ("wq", "wk")}
    x = jnp.asarray(np.random.default_rng(10).normal(size=(16, 256)), jnp.float32)
    fused = int8ify(_weight_made_on_the_way, backend="int8-fused", late_inlining=False)
    assert _kernels(jax.make_jaxpr(fused)(params, x)) == 1
    np.testing.assert_array_equal(np.asarray(jax.jit(fused)(params, x)),
                                  np.asarray(jax.jit(int8ify(_weight_made_on_the_way))(params, x)))


def test_the_kernel_lowers_for_cuda_as_a_triton_kernel():
    params, x = _mlp_params(), jnp.ones((64, 256), jnp.float32)
    q = quantize_params(_mlp, params, x)
    traced = jax.jit(int8ify(_mlp, backend="int8-fused", late_inlining=False)).trace(q, x)
    try:
        lowered = traced.lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as error:  # JAX 0.12 asks the GPU for its compute capability
        if "No supported GPU devices found" not in str(error):
            raise
        pytest.skip("this JAX lowers Triton kernels only with a GPU")
    assert "xla.gpu.triton" in lowered  # Pallas' Triton kernel, not a Mosaic GPU one


def _triton_accesses(monkeypatch, fn, *args):
    """The ``tt.load`` and ``tt.store`` operations of the Triton kernels ``fn`` lowers to for CUDA, each as the
    number of its operands (a load's pointers, mask and other value; a store's pointers, value and mask)."""
    from jax._src.pallas.triton import lowering as triton_lowering

    modules, lower = [], triton_lowering.lower_jaxpr_to_triton_module

    def recorded(*a, **kw):
        result = lower(*a, **kw)
        modules.append(result.module.operation.get_asm())
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", recorded)
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    except RuntimeError as error:  # JAX 0.12 asks the GPU for its compute capability
        if "No supported GPU devices found" not in str(error):
            raise
        pytest.skip("this JAX lowers Triton kernels only with a GPU")
    assert modules
    found = [(m.group(1), m.group(2).count("%")) for module in modules
             for m in re.finditer(r"tt\.(load|store) ([^:{]*)", module)]
    return [n for op, n in found if op == "load"], [n for op, n in found if op == "store"]


@pytest.mark.parametrize("rows, widths", [(1, (128, 256)), (70, (200, 128)), (3, (130,))])
def test_blocks_that_overhang_their_arrays_are_read_and_written_within_them(monkeypatch, rows, widths):
    """Pallas' Triton lowering does not mask a block that overhangs its array: the kernel does, or a one-row
    activation's block of 16 rows (a width that is not a multiple of 128) reads and writes the memory after the
    result, which for sibling dots is the next result (an H200 gave wrong values for a 1 x 1024 activation)."""
    x = jnp.ones((rows, 256), jnp.float32)
    weights = [jnp.ones((n, 256) if i % 2 else (256, n), jnp.float32) for i, n in enumerate(widths)]
    static = quantize_params(_dense, {"w": jnp.ones((256, 96), jnp.float32)}, x, activations="static")["w"]
    operands = (*weights, static)
    contractings = tuple(i % 2 for i in range(len(widths))) + (0,)
    loads, stores = _triton_accesses(monkeypatch, lambda v, *ws: fused_dots(v, ws, contractings), x, *operands)
    assert stores and all(n == 3 for n in stores)  # pointers, value, mask
    assert all(n == 3 for n in loads if n > 1)  # every masked load has its other value
    assert sum(n == 3 for n in loads) >= len(operands)  # the activation and each weight read under a mask


def test_blocks_that_tile_their_arrays_are_not_masked(monkeypatch):
    """No mask costs the kernel anything where its blocks tile the arrays."""
    x, w = jnp.ones((64, 256), jnp.float32), jnp.ones((256, 256), jnp.float32)
    loads, stores = _triton_accesses(monkeypatch, lambda v, a, b: fused_dots(v, (a, b), (0, 1)), x, w, w)
    assert stores and all(n == 1 for n in loads) and all(n == 2 for n in stores)  # pointers (and value)


@pytest.mark.parametrize("k", [100, 48, 80, 1040])
def test_a_contraction_the_tensor_cores_cannot_tile_in_32_wide_steps_stays_with_xla(k):
    """Triton's int8 dot of a 16-wide contraction block feeds the same 16 values to both halves of a Hopper GPU's
    ``mma.m16n8k32`` and doubles every sum (read in the PTX of XLA's H200 compile): a contraction that is a
    multiple of 16 but not of 32 is XLA's GEMM, as one the tensor cores cannot tile at all."""
    x = jnp.asarray(np.random.default_rng(k).normal(size=(8, k)), jnp.float32)
    q = quantize_params(_dense, {"w": jnp.asarray(np.random.default_rng(0).normal(size=(k, 64)), jnp.float32)}, x)
    fused = int8ify(_dense, backend="int8-fused", late_inlining=False)
    assert _kernels(jax.make_jaxpr(fused)(q, x)) == 0
    np.testing.assert_array_equal(np.asarray(fused(q, x)), np.asarray(int8ify(_dense)(q, x)))


def test_the_backend_is_named_in_the_options_error():
    with pytest.raises(Int8ifyError, match="int8-fused"):
        int8ify(_dense, backend="int8-fusd")
