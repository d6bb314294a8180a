"""JX30x: callbacks from traced code into the Python host."""

from __future__ import annotations

import libcst as cst

from ..dataflow import FunctionWalk
from ..names import CALLBACK_FUNCS, CALLBACK_PREFIXES, DEBUG_FUNCS
from ._base import TRACED, Rule
from .matmul import short_name

__all__ = ["HostCallback", "DebugCallback"]


class HostCallback(Rule):
    code = "JX301"
    name = "host-callback"
    scope = TRACED
    message = ("host callback `{name}` in traced code leaves the compiled int8 program and runs in "
               "Python; compute it with jnp/lax operations instead")
    VALID = [
        """
        import jax

        def host(x):
            return jax.pure_callback(print, None, x)
        """,
    ]
    INVALID = [
        """
        import jax, numpy as np

        @jax.jit
        def f(x):
            return jax.pure_callback(np.sin, x, x)
        """,
        """
        import jax
        from jax.experimental import io_callback

        @jax.jit
        def f(x):
            io_callback(print, None, x)
            return x
        """,
        """
        import jax
        from jax.experimental import host_callback as hcb

        @jax.jit
        def f(x):
            return hcb.id_tap(lambda a, t: None, x)
        """,
    ]

    def visit_Call(self, node: cst.Call, walk: FunctionWalk) -> None:
        q = walk.qualname(node.func)
        if q is not None and (q in CALLBACK_FUNCS or q.startswith(CALLBACK_PREFIXES)):
            self.report(walk, node, name=short_name(q))


class DebugCallback(Rule):
    code = "JX302"
    name = "debug-callback"
    scope = TRACED
    message = ("`{name}` is a host callback in disguise (it breaks the callback-free int8 program); "
               "remove it before shipping")
    VALID = [
        """
        import jax

        def host(x):
            jax.debug.print("{}", x)
        """,
    ]
    INVALID = [
        """
        import jax

        @jax.jit
        def f(x):
            jax.debug.print("x = {}", x)
            return x
        """,
        """
        import jax
        from jax import debug

        @jax.jit
        def f(x):
            debug.breakpoint()
            return x
        """,
    ]

    def visit_Call(self, node: cst.Call, walk: FunctionWalk) -> None:
        q = walk.qualname(node.func)
        if q is not None and q in DEBUG_FUNCS:
            self.report(walk, node, name=short_name(q))
