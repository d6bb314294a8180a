"""Name scopes: nested scopes joined, JAX's transform wrappers taken off, ``skip`` patterns matched."""

from __future__ import annotations

import fnmatch
import re

__all__ = ["join_scope", "matching_pattern", "user_scope"]


def join_scope(outer: str, inner) -> str:
    """Nested name scopes joined by ``/``."""
    inner = str(inner)
    return f"{outer}/{inner}" if outer and inner else outer or inner


# JAX names the scopes of a transformed function after the transform: ``jvp(attn)`` under grad, ``vmap(block)``
# under vmap, ``transpose(jvp(attn))`` in a backward pass (``jax._src.source_info_util.Transform``).
_TRANSFORM_WRAPPER = re.compile(r"^(?:jvp|transpose|vmap|pmap)\((.*)\)$")


def user_scope(scope: str) -> str:
    """``scope`` with JAX's transform wrappers taken off each name: ``vmap(jvp(block))/attn`` -> ``block/attn``."""
    names = []
    for name in scope.split("/"):
        while (wrapped := _TRANSFORM_WRAPPER.match(name)) is not None:
            name = wrapped.group(1)
        names.append(name)
    return "/".join(names)


def matching_pattern(scope: str, patterns) -> str | None:
    """The first of ``patterns`` (``fnmatch`` syntax, case-insensitive on every platform) that matches ``scope``,
    as JAX wrote it or with the transform wrappers off (so ``skip=["attn"]`` still matches under ``grad`` and
    ``vmap``), or ``None``. Case-insensitive because frameworks capitalise their scopes differently:
    ``*attention*`` matches Flax's ``MultiHeadDotProductAttention_0`` and Equinox's ``MultiheadAttention``."""
    scopes = (scope.lower(), user_scope(scope).lower())
    for pattern in patterns:
        if any(fnmatch.fnmatchcase(s, pattern.lower()) for s in scopes):
            return pattern
    return None
