"""XLA flags under which a Hopper GPU's int8 GEMMs double every sum (XLA's untested default Triton tiling, K block
16) are refused with the fix, before any program is built; safe flags, and every other device, go through."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from helpers import first_device_is, reference_dot
from jaxpr_rewrite import Int8ifyError, int8_matmul, int8ify, quantize_params
from jaxpr_rewrite._platforms import gpu_gemm_flags
from jaxpr_rewrite._platforms.gpu_gemm_flags import int8_gemm_flag_problem

H200 = "NVIDIA H200 (compute capability 9.0)"
MATMUL = (((1,), (0,)), ((), ()))
rng = np.random.default_rng(11)
X = rng.normal(size=(64, 256)).astype(np.float32)
W = rng.normal(size=(256, 128)).astype(np.float32)


@pytest.mark.parametrize("flags, unchecked", [
    ("--xla_gpu_autotune_level=0", "autotunes nothing"),
    ("--xla_force_host_platform_device_count=8 --xla_gpu_autotune_level=0", "autotunes nothing"),
    ("--xla_gpu_autotune_level=3", "without comparing"),
    ("--xla_gpu_autotune_level=1", "without comparing"),
    ("--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_triton_gemm=true --xla_gpu_autotune_level=0",
     "autotunes nothing"),  # the last setting counts, as in XLA
    ("--xla_gpu_autotune_level=4 --xla_gpu_autotune_level=0", "autotunes nothing"),
])
def test_unchecked_autotuning_is_a_problem_that_names_the_flag_and_both_fixes(flags, unchecked):
    problem = int8_gemm_flag_problem(flags)
    level = flags.rsplit("=", 1)[1]
    assert f"--xla_gpu_autotune_level={level}" in problem and unchecked in problem
    assert "doubled" in problem
    assert "--xla_gpu_enable_triton_gemm=false" in problem and "(4:" in problem


@pytest.mark.parametrize("flags", [
    "",
    "--xla_gpu_autotune_level=4",
    "--xla_gpu_autotune_level=0 --xla_gpu_autotune_level=4",
    "--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_enable_triton_gemm=0 --xla_gpu_autotune_level=2",
    "--xla_gpu_autotune_level=fast",  # XLA refuses it itself
    "--xla_force_host_platform_device_count=8",
])
def test_checked_autotuning_or_cublas_gemms_are_safe(flags):
    assert int8_gemm_flag_problem(flags) is None


def _project(w, x):
    return x @ w


@pytest.mark.parametrize("backend", ["int8", "int8-fused"])
def test_on_a_hopper_gpu_the_rewrite_refuses_unchecked_autotuning(monkeypatch, backend):
    weights = quantize_params(_project, W, X)  # quantizing builds no GEMM
    int8ify(lambda x, w: x @ w, backend=backend)(X, W)  # each dot's shared program, traced and kept
    int8ify(lambda w, x: _project(w, x), backend=backend)(weights, X)
    monkeypatch.setattr(gpu_gemm_flags, "_hopper_device", lambda: H200)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # programs traced for the GPU, as on its host
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    with pytest.raises(Int8ifyError, match=r"NVIDIA H200 .*autotune_level=0.*doubled.*triton_gemm=false"):
        int8ify(lambda x, w: x @ w, backend=backend)(X, W)
    with pytest.raises(Int8ifyError, match="doubled"):
        int8ify(lambda w, x: _project(w, x), backend=backend)(weights, X)
    groups = np.array([20, 44], np.int32)
    with pytest.raises(Int8ifyError, match="doubled"):
        int8ify(lambda x, w, g: lax.ragged_dot(x, w, g), backend=backend)(X, np.stack([W, W]), groups)
    with pytest.raises(Int8ifyError, match="doubled"):
        int8_matmul(X[:8], W)


def test_on_a_hopper_gpu_cublas_gemms_or_the_default_level_give_the_contracts_numbers(monkeypatch):
    monkeypatch.setattr(gpu_gemm_flags, "_hopper_device", lambda: H200)
    want = reference_dot(X, W, MATMUL)
    for flags in ("--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false", ""):
        monkeypatch.setenv("XLA_FLAGS", flags)
        got = np.asarray(int8ify(lambda x, w: x @ w)(X, W), np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_other_devices_ignore_the_gpu_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    assert gpu_gemm_flags._hopper_device() is None  # this CPU
    got = np.asarray(int8ify(lambda x, w: jnp.matmul(x, w))(X, W), np.float64)
    want = reference_dot(X, W, MATMUL)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_a_hopper_hosts_work_put_on_its_cpu_ignores_the_gpu_flags(monkeypatch):
    """The flags are checked for the device a program runs on: a Hopper host's default GPU, not its CPU under
    ``jax.default_device``."""
    class FakeH200:
        platform, compute_capability, device_kind = "gpu", "9.0", "NVIDIA H200"

    first_device_is(monkeypatch, FakeH200())
    assert gpu_gemm_flags._hopper_device() == H200
    with jax.default_device(jax.devices("cpu")[0]):
        assert gpu_gemm_flags._hopper_device() is None
