"""One platform's program per trace: the traced program holds one int8 dot per rewritten matmul and no platform
choice, traced for the default device's platform or the ``platforms`` option; several platforms give one choice per
dot, each branch the platform's program alone; the registry refuses what it cannot serve."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_all_dots_int8, evaluate_as
from jaxpr_rewrite import Int8ifyError, dot_eqns, int8_matmul, int8ify, iter_eqns
from jaxpr_rewrite._core import platforms

RNG = np.random.default_rng(0)
X = RNG.standard_normal((32, 256)).astype(np.float32)
W = RNG.standard_normal((256, 128)).astype(np.float32)


def _names(jaxpr) -> list[str]:
    return [e.primitive.name for e in iter_eqns(jaxpr)]


@pytest.mark.parametrize("program", ["int8ify", "int8_matmul"])
def test_the_traced_program_holds_one_int8_dot_and_no_platform_choice(program, monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # the line count is CPU's program's, on any host
    fn = int8ify(lambda x, w: x @ w) if program == "int8ify" else int8_matmul
    jaxpr = jax.make_jaxpr(fn)(X, W)
    (dot,) = dot_eqns(jaxpr)
    assert [v.aval.dtype for v in dot.invars] == [np.int8, np.int8] and dot.outvars[0].aval.dtype == np.int32
    assert "platform_index" not in _names(jaxpr) and "cond" not in _names(jaxpr)
    assert len(_names(jaxpr)) <= 180  # the quantization, the dot and the epilogue of one platform
    if jax.__version_info__ >= (0, 10):  # JAX 0.8 prints each of an equation's parameters on a line of its own
        assert len(str(jaxpr).splitlines()) <= 200


def _block(params, x):
    """A pre-LN transformer block: attention's projections, q . k, p . v and output, and a two-layer MLP."""
    def norm(v):
        return (v - v.mean(-1, keepdims=True)) / jnp.sqrt(v.var(-1, keepdims=True) + 1e-6)

    b, t, d = x.shape
    h = norm(x)
    q, k, v = ((h @ params[name]).reshape(b, t, 4, d // 4) for name in ("wq", "wk", "wv"))
    scores = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // 4), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", scores, v).reshape(b, t, d) @ params["wo"]
    return x + jax.nn.gelu(norm(x) @ params["w1"]) @ params["w2"]


def test_a_transformer_block_has_one_int8_dot_per_matmul():
    d = 128
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, 4 * d), "w2": (4 * d, d)}
    params = {name: (RNG.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
              for name, shape in shapes.items()}
    x = RNG.standard_normal((2, 16, d)).astype(np.float32)
    matmuls = len(dot_eqns(jax.make_jaxpr(_block)(params, x)))
    jaxpr = jax.make_jaxpr(int8ify(_block))(params, x)
    assert matmuls == 8 and len(assert_all_dots_int8(jaxpr)) == matmuls and len(dot_eqns(jaxpr)) == matmuls
    assert "platform_index" not in _names(jaxpr)


def test_a_program_traced_for_a_tpu_is_the_tpus():
    """``platforms=["tpu"]`` traces the TPU's program on this CPU (to export or compile ahead for one): its integer
    division of the scales' mantissas, where the CPU's program divides in float; the CPU runs both to the same
    numbers."""
    int_divisions = {}
    for platform in ("cpu", "tpu"):
        jaxpr = jax.make_jaxpr(int8ify(lambda x, w: x @ w, platforms=[platform]))(X, W)
        int_divisions[platform] = sum(e.primitive.name == "div" and e.outvars[0].aval.dtype == np.int32
                                      for e in iter_eqns(jaxpr))
        assert len(dot_eqns(jaxpr)) == 1 and "platform_index" not in _names(jaxpr)
    assert int_divisions == {"cpu": 0, "tpu": 2}
    cpu = jax.jit(int8ify(lambda x, w: x @ w))(X, W)
    (tpu,) = evaluate_as("tpu", int8ify(lambda x, w: x @ w, platforms=["tpu"]), X, W)
    np.testing.assert_array_equal(np.asarray(tpu), np.asarray(cpu))


def test_several_platforms_make_one_choice_per_dot_each_branch_one_platforms_program():
    fn = int8ify(lambda x, w: x @ w, platforms=("cpu", "cuda", "tpu"))
    jaxpr = jax.make_jaxpr(fn)(X, W)
    assert _names(jaxpr).count("platform_index") == 1
    for platform in ("cpu", "cuda", "tpu"):
        (dot,) = dot_eqns(jaxpr, platform=platform)
        assert [v.aval.dtype for v in dot.invars] == [np.int8, np.int8]
    assert len(dot_eqns(jaxpr)) == 3
    exported = jax.export.export(jax.jit(fn), platforms=["cpu", "tpu"])(X, W)
    np.testing.assert_array_equal(np.asarray(exported.call(X, W)), np.asarray(jax.jit(int8ify(lambda x, w: x @ w))(
        X, W)))


def test_the_platforms_option_and_the_registry_refuse_what_they_cannot_serve():
    with pytest.raises(Int8ifyError, match=r"platforms must name one or more of \('cpu', 'cuda', 'rocm', 'tpu'\), "
                                           r"got \('metal',\)"):
        int8ify(lambda x, w: x @ w, platforms="metal")
    with pytest.raises(Int8ifyError, match="platforms must name one or more"):
        int8ify(lambda x, w: x @ w, platforms=[])
    with pytest.raises(Int8ifyError, match="a platform is registered for 'tpu' already"):
        platforms.register_platform(type(platforms.PLATFORMS["tpu"])())


def test_the_default_device_chooses_the_program_and_keys_its_cache(monkeypatch):
    """The program is traced for the default device's platform, and kept per platform: after the default backend
    changes (as under ``jax.default_device``), the same wrapper traces the other platform's program."""
    fn = int8ify(lambda x, w: x @ w)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # (as on this host, also where it is a TPU's)
    cpu = fn.rewritten_jaxpr(X, W)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    tpu = fn.rewritten_jaxpr(X, W)
    divisions = [sum(e.primitive.name == "div" and e.outvars[0].aval.dtype == np.int32 for e in iter_eqns(j))
                 for j in (cpu, tpu)]
    assert divisions == [0, 2]
