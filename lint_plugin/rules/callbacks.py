"""JX30x: callbacks from traced code into the Python host."""

from __future__ import annotations

import libcst as cst

from jx_codes import DEBUG_CALLBACK, HOST_CALLBACK

from ..names import CALLBACK_FUNCS, CALLBACK_PREFIXES, DEBUG_FUNCS, short_name
from ..walk import FunctionWalk
from ._base import TRACED, Invalid, Rule

__all__ = ["DebugCallback", "HostCallback"]


class HostCallback(Rule):
    """A host callback in traced code.

    ``jax.pure_callback``, ``jax.experimental.io_callback`` and ``jax.experimental.host_callback.*``
    leave the compiled program to run Python on the host; the int8 program must not. The function such
    a call runs is host code: it is not traced, and the other rules do not look inside it
    (``jax.debug.callback`` is JX302, as :func:`jaxpr_rewrite.verify` reports it).
    """

    entry = HOST_CALLBACK
    scope = TRACED
    message = ("host callback `{name}` in traced code leaves the compiled int8 program and runs in "
               "Python; {instead} instead")
    VALID = [
        """
        import jax

        def host(x):
            return jax.pure_callback(print, None, x)
        """,
    ]
    INVALID = [
        Invalid("""
        import jax, numpy as np

        @jax.jit
        def f(x):
            return jax.pure_callback(np.sin, x, x)
        """, line=5, col=11),
        Invalid("""
        import jax
        from jax.experimental import io_callback

        @jax.jit
        def f(x):
            io_callback(print, None, x)
            return x
        """, line=6, col=4),
        Invalid("""
        import jax
        from jax.experimental import host_callback as hcb

        @jax.jit
        def f(x):
            return hcb.id_tap(lambda a, t: None, x)
        """, line=6, col=11),
    ]

    def visit_Call(self, node: cst.Call, walk: FunctionWalk) -> None:
        q = walk.qualname(node.func)
        if q is not None and (q in CALLBACK_FUNCS or q.startswith(CALLBACK_PREFIXES)):
            self.report(walk, node, name=short_name(q))


class DebugCallback(Rule):
    """``jax.debug.print``, ``jax.debug.breakpoint`` or ``jax.debug.callback`` in traced code.

    All are host callbacks in disguise: fine while debugging, but they break the callback-free int8
    program. The function ``jax.debug.callback`` runs is host code, as for JX301.
    """

    entry = DEBUG_CALLBACK
    scope = TRACED
    message = "`{name}` is a host callback in disguise (it breaks the callback-free int8 program); {instead}"
    VALID = [
        """
        import jax

        def host(x):
            jax.debug.print("{}", x)
        """,
    ]
    INVALID = [
        Invalid("""
        import jax

        @jax.jit
        def f(x):
            jax.debug.print("x = {}", x)
            return x
        """, line=5, col=4),
        Invalid("""
        import jax
        from jax import debug

        @jax.jit
        def f(x):
            debug.breakpoint()
            return x
        """, line=6, col=4),
        Invalid("""
        import jax

        @jax.jit
        def f(x):
            jax.debug.callback(print, x)
            return x
        """, line=5, col=4),
    ]

    def visit_Call(self, node: cst.Call, walk: FunctionWalk) -> None:
        q = walk.qualname(node.func)
        if q is not None and q in DEBUG_FUNCS:
            self.report(walk, node, name=short_name(q))
