"""Test configuration shared by every test module.

* Eight host CPU devices, so sharding tests have a mesh (must be set before JAX initialises).
* Float dots at float32 on every device, as the tests' numpy references compute them.
* JAX's persistent compilation cache in a folder of this run's own (inherited by the fresh processes tests start):
  many tests compile the same program (the MiniLM encoder at one shape, a CLI command's model in a fresh
  process), and XLA:CPU's compile is most of the suite's time. A cached executable is the one XLA compiled for the
  same program, flags and device, so no test sees a different program; a run never reads another run's cache.
  Under pytest-xdist (``-n 2``, README's test command) pytest's main process sets the folder before it starts its
  workers, so they share it, and it is removed when that process ends.
* Hypothesis profiles: ``ci`` (default) is bounded so the suite fits in a few minutes on 2 cores, since every new
  shape costs an XLA compile; ``thorough`` runs many more examples (``HYPOTHESIS_PROFILE=thorough pytest tests``),
  the properties that set their own count too (``helpers.examples``: 16 times theirs).
* :func:`load_example`: the one way tests import the example programs under ``examples/`` (by path, as the
  scripts themselves are run), and run them as ``__main__``.
"""

import atexit
import importlib.util
import os
import runpy
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# the tests' references are float32 matmuls (numpy's): the float dots a tested program keeps (a gradient's, a user's
# backward rule) run at float32 on accelerators too, not at JAX's default there (TF32 on a GPU, bfloat16 on a TPU)
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "float32")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _compilation_cache = tempfile.mkdtemp(prefix="int8ify-tests-xla-cache-")
    atexit.register(shutil.rmtree, _compilation_cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _compilation_cache
    # programs that take XLA a tenth of a second or more: the smaller ones cost more to write than to compile
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
if str(ROOT) not in sys.path:  # a checkout that is not pip-installed
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from jaxpr_rewrite._core import platforms  # noqa: E402  (after the checkout is on the path)

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _load(relative: str):
    """Import ``examples/<relative>`` as a module (its own folder on ``sys.path``, as when it runs)."""
    path = EXAMPLES / relative
    name = "example_" + relative.replace("/", "_").removesuffix(".py")
    if name in sys.modules:
        return sys.modules[name]
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def load_example():
    """``load_example("mlp.py")`` -> the example module."""
    return _load


@pytest.fixture
def run_example(monkeypatch, capsys):
    """``run_example("mlp.py", ["--batch", "8"])`` runs the example as a script and returns what it printed."""

    def run(relative: str, argv=()):
        path = EXAMPLES / relative
        monkeypatch.setattr(sys, "argv", [str(path), *argv])
        monkeypatch.syspath_prepend(str(path.parent))
        runpy.run_path(str(path), run_name="__main__")
        return capsys.readouterr().out

    return run


@pytest.fixture
def every_platform_programs():
    """The test's programs traced for CPU, CUDA and TPU at once (one ``lax.platform_dependent`` branch each), so that
    it can compare each platform's program in one jaxpr and run any of them on the CPU."""
    # JAX caches a function's traces without knowing the platforms int8ify traces for (the default device's, which
    # it does key on, or this test's): a function traced for the CPU alone earlier must be traced again here, and the
    # programs traced here must not serve later tests
    jax.clear_caches()
    with platforms.target(("cpu", "cuda", "tpu")):
        yield
    jax.clear_caches()
