"""Run a function with room for deep recursion.

libcst's visitors (the position computation) and the expression walk recurse once per nesting
level; a 500-term ``and`` chain or 200 nested calls is valid Python that exceeds the default
recursion limit. Rather than skipping such a file, the engine retries it here: in a thread with a
large stack and a raised recursion limit, so the deep tree is analysed like any other. Where no such
thread can run, the engine skips the deepest code instead (:mod:`lint_plugin.masking`).
"""

from __future__ import annotations

import sys
import threading
from typing import Callable, Dict, TypeVar

__all__ = ["DeepStackUnavailable", "call_with_deep_stack"]

T = TypeVar("T")

_STACK_BYTES = 512 * 1024 * 1024  # address space only: pages are committed as the stack grows
_RECURSION_LIMIT = 100_000


class DeepStackUnavailable(RuntimeError):
    """No thread with a large stack could run here (the platform refused the stack size, or the thread could
    not start, as under an address-space limit); the cause is the error that said so."""


def call_with_deep_stack(fn: Callable[[], T]) -> T:
    """``fn()`` in a thread with a 512 MiB stack and a recursion limit of 100k frames; its exception
    (a ``RecursionError`` even there, or anything else) is raised here, and :class:`DeepStackUnavailable`
    when no such thread can run."""
    outcome: Dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread below
            outcome["error"] = exc

    old_limit = sys.getrecursionlimit()
    try:
        old_size = threading.stack_size(_STACK_BYTES)
    except (ValueError, RuntimeError) as exc:
        raise DeepStackUnavailable("the platform refused the thread stack size") from exc
    # The limit is per interpreter; flake8 checks files one at a time per process, so nothing
    # else runs Python code while the caller waits for this thread.
    sys.setrecursionlimit(max(old_limit, _RECURSION_LIMIT))
    try:
        thread = threading.Thread(target=target, name="jx-deep-stack")
        try:
            thread.start()
        except (RuntimeError, MemoryError) as exc:
            raise DeepStackUnavailable("no thread with a large stack could start") from exc
        thread.join()
    finally:
        threading.stack_size(old_size)
        sys.setrecursionlimit(old_limit)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
