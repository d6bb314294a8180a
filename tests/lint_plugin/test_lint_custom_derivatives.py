"""Custom derivatives and comparing builtins in traced code.

* ``jax.custom_vjp``/``jax.custom_jvp``: the primal (decorated, or wrapped with ``f = jax.custom_vjp(g)``) and
  the rules registered with ``f.defvjp(fwd, bwd)``, ``f.defjvp(jvp)`` and ``@f.defjvp`` run on traced values;
  ``nondiff_argnums``/``nondiff_argnames`` are Python values (in the primal and ``fwd`` where they are, first in
  ``bwd``/``jvp``).
  ``defvjp``/``defjvp`` of anything else registers nothing. Float matmuls are reported in the primal and ``fwd``
  (the forward pass, which int8ify rewrites), not in ``bwd`` or a ``jvp`` rule (derivatives, kept float).
* ``max``/``min``/``sorted``/``any``/``all`` compare traced values (or take their truth) in Python: JX202, but
  only where the analysis knows the compared values are traced.

Each snippet's ``# JXnnn:col`` comments are exactly its reports (none: a VALID snippet).
"""

from __future__ import annotations

import pytest

from lint_helpers import check_annotated, lint

CUSTOM_INVALID = '''
from functools import partial

import jax
import jax.numpy as jnp


@jax.custom_vjp
def f(x):
    if x.sum() > 0:  # JX201:4
        return x
    return -x


def f_fwd(x):
    return x, (x, float(x.max()))  # JX202:18


def f_bwd(res, g):
    x, _ = res
    if x.sum() > 0:  # JX201:4
        return (g,)
    return (-g,) if g.mean() > 0 else (g,)  # JX201:20


f.defvjp(fwd=f_fwd, bwd=f_bwd)


def g(x, n):
    return x * n


def g_jvp(primals, tangents):
    x, n = primals
    (t, _) = tangents
    while x.max() > n:  # JX201:4
        x = x / 2
    return x, t


g_custom = jax.custom_jvp(g)
g_custom.defjvp(g_jvp)


@partial(jax.custom_jvp, nondiff_argnums=(0,))
def apply(fn, x):
    return fn(x)


@apply.defjvp
def apply_jvp(fn, primals, tangents):
    (x,), (t,) = primals, tangents
    return fn(x), t if x.any() else -t  # JX201:23
'''

CUSTOM_VALID = '''
from functools import partial

import jax
from jax._src.interpreters import ad


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def clip_gradient(x, lo, hi):
    if lo is None or lo < hi:
        return x
    return x


def clip_fwd(x, lo, hi):
    if hi > 0:
        return x, None
    return x, x


def clip_bwd(lo, hi, res, g):
    if lo < hi and res is None:
        return (g,)
    return (g,)


clip_gradient.defvjp(clip_fwd, clip_bwd)


def dropout(x, rate, training):
    return x * (1 - rate) if training else x


def dropout_fwd(x, rate, training):
    return (x * (1 - rate) if training else x), None


def dropout_bwd(rate, training, res, g):
    return (g * (1 - rate) if training else g,)


dropout_custom = jax.custom_vjp(dropout, nondiff_argnames=("rate", "training"))
dropout_custom.defvjp(dropout_fwd, dropout_bwd)


def plain(x):
    return x


class Registry:
    def defvjp(self, fwd, bwd):
        return fwd, bwd


def not_a_rule(res, g):
    if res.sum() > 0:
        return g
    return -g


Registry().defvjp(not_a_rule, not_a_rule)
plain.defvjp = None
ad.defjvp(None, lambda g, x: g if x.sum() > 0 else -g)
'''


@pytest.mark.parametrize("snippet", [CUSTOM_INVALID, CUSTOM_VALID], ids=["invalid", "valid"])
def test_custom_derivative_rules_are_traced(snippet):
    check_annotated(snippet)


MATMULS = '''
import jax
import jax.numpy as jnp


@jax.custom_vjp
def dense(x, w):
    return x @ w  # JX101:11


def dense_fwd(x, w):
    return jnp.dot(x, w), (x, w)  # JX101:11


def dense_bwd(res, g):
    x, w = res
    return g @ w.T, x.T @ g


dense.defvjp(dense_fwd, dense_bwd)


@jax.custom_jvp
def scale(x, w):
    return x * w


@scale.defjvp
def scale_jvp(primals, tangents):
    (x, w), (t, _) = primals, tangents
    return x * w, t @ w
'''


def test_derivative_rules_keep_their_matmuls_float():
    """The primal and ``fwd`` are the forward pass, which int8ify rewrites: a float matmul there is reported
    (JX101). ``bwd`` and a ``jvp`` rule compute derivatives, whose matmuls int8ify keeps float by design: wrapping
    with ``@int8ify`` would change nothing, so they are not (their conditions on tracers still are)."""
    check_annotated(MATMULS)


def test_defvjp_of_a_plain_function_registers_nothing():
    assert lint('''
        import jax

        def f(x):
            return x

        def f_bwd(res, g):
            if res.sum() > 0:
                return (g,)
            return (-g,)

        f.defvjp(f, f_bwd)
        jax.jit(f)
    ''') == []


BUILTINS_INVALID = '''
import jax


@jax.jit
def stats(x, y, ys):
    hi = max(x.sum(), 0.0)  # JX202:9
    lo = min(1, y)  # JX202:9
    pair = sorted((x.max(), y.max()))  # JX202:11
    ok = all([x.any()])  # JX202:9
    big = any(jax.numpy.abs(v).max() > 1 for v in ys)  # JX202:10
    top = max([v.max() for v in ys])  # JX202:10
    return hi, lo, pair, ok, big, top
'''

BUILTINS_VALID = '''
from functools import partial

import jax
import jax.numpy as jnp


@partial(jax.jit, static_argnames=("n",))
def stats(x, xs, params, n, depth: int):
    rows = max(x.shape[0], 1)
    width = max(len(xs), 2)
    k = min(n, 3) + min(depth, 4)
    sizes = [x.shape[0], x.shape[-1]]
    biggest = max(sizes)
    ordered = sorted(v.shape[0] for v in xs)
    names = sorted(params)  # a dict of arrays: its keys
    first = min(params, key=lambda name: params[name].ndim)
    flattest = min([x, xs[0]], key=lambda v: v.ndim)  # compares the static keys
    keys = sorted(name for name in params)  # the loop variable: a dict of arrays' keys
    one = max([x.sum()])  # one item: nothing is compared
    unknown = max(xs)  # a pytree of arrays or a Python list: cannot tell
    present = any(p is None for p in xs) or all(name.startswith("w") for name in params)
    return (jnp.maximum(x, 0.0), rows, width, k, biggest, ordered, names, first, flattest, keys, one, unknown,
            present)
'''


@pytest.mark.parametrize("snippet", [BUILTINS_INVALID, BUILTINS_VALID], ids=["invalid", "valid"])
def test_comparing_builtins_on_traced_values(snippet):
    check_annotated(snippet)
