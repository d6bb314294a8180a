"""Packaging for int8ify: the jaxpr rewrite (``jaxpr_rewrite``) and its flake8 plugin (``lint_plugin``).

Everything is declared in pyproject.toml (metadata, the tested JAX range, extras, the flake8 entry point);
this file remains for tools that still call ``setup.py`` directly.
"""

from setuptools import setup

setup()
