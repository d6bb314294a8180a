"""Where the user's code is: one place that turns a jaxpr equation (or a Python frame) into a source location.

Every message that points at user code (errors, report rows, verify findings, the command line) goes through
:func:`eqn_location`, so they all print ``file:line (function)`` the same way.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import jax
import jax.extend  # noqa: F401  (makes jax.extend.source_info_util importable)
import jaxlib
from jax.extend import source_info_util

__all__ = ["Location", "UNKNOWN", "describe_source", "eqn_location", "short_path"]

_SUMMARY = re.compile(r"^(?P<file>.*?):(?P<line>\d+)(?::\d+)? \((?P<function>[^()]*)\)$")
# the frame of int8ify's tracer that calls the user's function (tracing.trace)
_TRACER_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_tracing", "tracing.py")
_JAX_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (jax, jaxlib))


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
    ``custom_linear_solve``).

    When that frame is int8ify's own call of the traced function, the function is a library's (a Flax module's
    ``apply`` passed as it is), whose frames JAX leaves out as it leaves out its own: the innermost frame outside
    JAX, the library's line that made the equation, says where it is instead.
    """
    summary = source_info_util.summarize(eqn.source_info)
    match = _SUMMARY.match(summary)
    if match is None:
        return fallback
    if os.path.abspath(match["file"]) == _TRACER_FILE:
        library = _innermost_frame_outside_jax(eqn.source_info)
        if library is not None:
            return library
    return Location(match["file"], int(match["line"]), match["function"])


def _innermost_frame_outside_jax(source_info) -> Location | None:
    frames = getattr(getattr(source_info, "traceback", None), "frames", None) or ()
    for frame in frames:
        if not os.path.abspath(frame.file_name).startswith(_JAX_DIRS):
            return Location(frame.file_name, frame.line_num, frame.function_name)
    return None


def describe_source(eqn, fallback: Location = UNKNOWN) -> str:
    """``file:line (function)`` of ``eqn`` (see :func:`eqn_location`)."""
    return str(eqn_location(eqn, fallback))
