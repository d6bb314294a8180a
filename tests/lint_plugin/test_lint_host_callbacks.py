"""The function a host callback runs (``jax.pure_callback``, ``io_callback``, ``jax.debug.callback``) is
host code: its numpy matmuls are not JX101. The callback call itself is still JX301.

Each snippet's ``# JXnnn:col`` comments are exactly its reports.
"""

from __future__ import annotations

from lint_helpers import check_annotated

CALLBACKS = '''
import functools

import jax
import numpy as np
from jax.experimental import io_callback


def host_matmul(a, b):
    if a.sum() > 0:
        a = -a
    return a @ b


def host_print(a, label):
    print(label, float(a.max()))


@jax.jit
def f(x, w):
    y = jax.pure_callback(host_matmul, x, x, w)  # JX301:8
    z = jax.pure_callback(lambda a: a @ a, x, x)  # JX301:8
    io_callback(functools.partial(host_print, label="x"), None, x)  # JX301:4
    jax.debug.callback(callback=host_print, label="y", a=y)  # JX302:4
    return y @ z  # JX101:11
'''


def test_host_callable_of_a_callback_is_host_code():
    check_annotated(CALLBACKS)


def test_function_passed_as_an_ordinary_callback_is_still_traced():
    check_annotated('''
    import jax


    def leaf(v):
        return v @ v  # JX101:11


    @jax.jit
    def f(tree):
        return jax.tree.map(leaf, tree)
    ''')
