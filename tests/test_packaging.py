"""The package builds into a wheel whose metadata works: the flake8 entry point, the console script, the extras,
both packages and the supported JAX range."""

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT


# What a build writes into its source tree, or a checkout may hold from an earlier build or install.
BUILD_LEFTOVERS = shutil.ignore_patterns("build", "dist", "*.egg-info", ".git", ".tox", ".hypothesis", "__pycache__")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # setuptools builds in the source tree's build/ directory: the wheel is built from a private copy, so that
    # pytest-xdist workers building at once (each runs this module fixture) and an earlier build's leftovers
    # cannot collide, and the checkout is left as it was. The build runs offline in this environment
    # (--no-build-isolation), so it needs the setuptools pyproject.toml asks for: older ones refuse its license field.
    setuptools_version = importlib.metadata.version("setuptools")
    if int(setuptools_version.split(".")[0]) < 77:
        pytest.skip(f"this environment's setuptools {setuptools_version} cannot build the wheel offline "
                    "(pyproject.toml needs setuptools >= 77)")
    source = tmp_path_factory.mktemp("source") / "int8ify"
    shutil.copytree(ROOT, source, ignore=BUILD_LEFTOVERS)
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    cannot_build = ("No module named", "invalid command 'bdist_wheel'")
    if result.returncode != 0 and any(reason in result.stderr for reason in cannot_build):
        pytest.skip("this environment cannot build wheels offline (needs setuptools >= 70, or wheel)")
    assert result.returncode == 0, result.stderr
    (path,) = out.glob("int8ify-*.whl")
    return zipfile.ZipFile(path)


def _read(wheel, suffix):
    (name,) = [n for n in wheel.namelist() if n.endswith(suffix)]
    return wheel.read(name).decode()


def test_wheel_holds_both_packages_and_no_tests(wheel):
    names = wheel.namelist()
    assert "jaxpr_rewrite/__init__.py" in names and "lint_plugin/plugin.py" in names
    assert "jaxpr_rewrite/_compat.py" in names and "lint_plugin/rules/__init__.py" in names
    assert "jx_codes.py" in names  # the code table both packages import
    assert not [n for n in names if n.startswith(("tests/", "examples/", "benchmarks/"))]


def test_entry_points_and_extras(wheel):
    entry_points = _read(wheel, ".dist-info/entry_points.txt")
    assert "[flake8.extension]\nJX = lint_plugin.plugin:Int8Checker" in entry_points
    assert "[console_scripts]\nint8ify = jaxpr_rewrite.cli:main" in entry_points
    metadata = _read(wheel, ".dist-info/METADATA")
    assert "Requires-Dist: jax<0.13,>=0.8" in metadata or "Requires-Dist: jax>=0.8,<0.13" in metadata
    for extra in ("test", "plot", "examples", "deploy"):
        assert f"Provides-Extra: {extra}" in metadata
    assert 'Requires-Dist: matplotlib; extra == "plot"' in metadata
    assert "# int8ify" in metadata  # README as the long description
