"""Where the user's code is: one place that turns a jaxpr equation (or a Python frame) into a source location.

Every message that points at user code (errors, report rows, verify findings, the command line) goes through
:func:`eqn_location`, so they all print ``file:line (function)`` the same way.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import jax.extend  # noqa: F401  (makes jax.extend.source_info_util importable)
from jax.extend import source_info_util

__all__ = ["Location", "UNKNOWN", "describe_source", "eqn_location", "short_path"]

_SUMMARY = re.compile(r"^(?P<file>.*?):(?P<line>\d+)(?::\d+)? \((?P<function>[^()]*)\)$")


def short_path(path: str | None) -> str:
    """``path`` relative to the working directory when it lies below it, else its base name."""
    if not path:
        return "?"
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return os.path.basename(path)
    return os.path.basename(path) if rel.startswith("..") else rel


class Location(NamedTuple):
    """A place in the user's code.

    Attributes:
        file: the file name as recorded (``None`` when unknown).
        line: 1-based line number (``None`` when unknown).
        function: the enclosing function's name (``None`` when unknown).
    """

    file: str | None
    line: int | None
    function: str | None

    def __str__(self) -> str:
        if self.line is None:
            return "<unknown location>"
        text = f"{short_path(self.file)}:{self.line}"
        return f"{text} ({self.function})" if self.function else text


UNKNOWN = Location(None, None, None)


def eqn_location(eqn, fallback: Location = UNKNOWN) -> Location:
    """The user's source of ``eqn``: the innermost frame outside JAX that created it, or ``fallback`` when JAX
    recorded no user frame for it (equations built inside a library function, such as ``jnp.linalg.solve``'s
    ``custom_linear_solve``)."""
    summary = source_info_util.summarize(eqn.source_info)
    match = _SUMMARY.match(summary)
    if match is None:
        return fallback
    return Location(match["file"], int(match["line"]), match["function"])


def describe_source(eqn, fallback: Location = UNKNOWN) -> str:
    """``file:line (function)`` of ``eqn`` (see :func:`eqn_location`)."""
    return str(eqn_location(eqn, fallback))
