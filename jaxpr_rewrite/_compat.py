"""The one module that touches JAX internals (``jax._src``).

Tested against JAX 0.10.2 (see ``JAX_RANGE`` in setup.py). Everything else in the package uses public API;
when a JAX upgrade breaks the rewrite, this file is where to look first.

What needs internals, and why:

* ``trace_to_jaxpr``: sub-jaxprs (scan bodies, cond branches, shard_map bodies) are re-traced at their
  exact input avals (weak types and varying-manual-axes included), which ``jax.make_jaxpr`` cannot take.
* ``shard_map_body_context``: a shard_map body can only be traced inside its mesh axis environment.
* ``wrap_jaxpr_thunk``: custom_jvp/custom_vjp keep their jvp/fwd rules as ``linear_util.WrappedFun`` thunks
  that produce jaxprs; the rewrite wraps them to rewrite what they produce.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

from jax._src import config as _config
from jax._src import core as _core
from jax._src import linear_util as _lu
from jax._src import shard_map as _shard_map
from jax._src.interpreters import partial_eval as _pe
from jax._src.mesh import use_abstract_mesh as _use_abstract_mesh


def trace_to_jaxpr(fn: Callable, in_avals: Sequence[Any], debug_info) -> tuple[Any, list[Any]]:
    """Trace ``fn(*args)`` at exactly ``in_avals`` to a jaxpr.

    Arguments:
        fn: a function of flat positional arrays returning a flat list of arrays.
        in_avals: the abstract values of its arguments, used verbatim.
        debug_info: the ``DebugInfo`` of the jaxpr being rewritten, kept on the result.

    Returns:
        ``(jaxpr, consts)``: an open jaxpr and the values of its constvars.
    """
    wrapped = _lu.wrap_init(fn, debug_info=debug_info)
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return jaxpr, consts


def shard_map_body_context(params) -> contextlib.ExitStack:
    """The axis environment and abstract mesh under which a ``shard_map`` body is traced.

    Arguments:
        params: the ``shard_map`` equation's params.

    Returns:
        A context manager, the same one ``jax._src.shard_map`` uses when it stages the body.
    """
    mesh = params["mesh"]
    manual = params["newly_manual_axes"]
    stack = contextlib.ExitStack()
    stack.enter_context(_shard_map._extend_axis_env(mesh, manual))
    stack.enter_context(_use_abstract_mesh(_shard_map._as_manual_mesh(mesh, manual)))
    stack.enter_context(_config._check_vma(params["check_vma"]))
    return stack


def wrap_jaxpr_thunk(thunk, transform: Callable[[tuple], tuple]):
    """Wrap a ``WrappedFun`` that returns ``(jaxpr, consts, *rest)`` so its result passes through ``transform``.

    Arguments:
        thunk: the custom_jvp ``jvp_jaxpr_fun`` or custom_vjp ``fwd_jaxpr_thunk`` param.
        transform: maps the thunk's result tuple to a new one of the same form.

    Returns:
        A new ``WrappedFun`` with the same debug info; it calls ``thunk`` lazily, as JAX does.
    """

    def wrapped(*args):
        return transform(tuple(thunk.call_wrapped(*args)))

    return _lu.wrap_init(wrapped, debug_info=thunk.debug_info)


def make_debug_info(traced_for: str, fn: Callable, args, kwargs):
    """A ``DebugInfo`` naming ``fn``, so traced jaxprs point at the user's function."""
    from jax._src import api_util

    return api_util.debug_info(traced_for, fn, args, kwargs)

