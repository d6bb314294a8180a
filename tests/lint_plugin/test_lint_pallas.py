"""Pallas: the kernel given to ``pl.pallas_call`` (directly, through ``functools.partial``, or a
lambda) is traced code, and so are ``@pl.when`` bodies and ``lax.fori_loop`` bodies inside it.

Each snippet's ``# JXnnn:col`` comments are exactly its reports (none: a VALID snippet).
"""

from __future__ import annotations

from lint_helpers import check_annotated

INVALID = '''
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def kernel(x_ref, y_ref, o_ref, *, block):
    o_ref[...] = x_ref[...] @ y_ref[...]  # JX101:17

    @pl.when(pl.program_id(0) == 0)
    def _():
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...])  # JX101:21

    def body(i, acc):
        return acc + pl.dot(x_ref[...], y_ref[...])  # JX101:21

    lax.fori_loop(0, block, body, o_ref[...])


def plain_kernel(x_ref, o_ref):
    if x_ref[0] > 0:  # JX201:4
        o_ref[...] = x_ref[...]


def matmul(x, y):
    out = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    z = pl.pallas_call(functools.partial(kernel, block=4), out_shape=out)(x, y)
    z = pl.pallas_call(plain_kernel, out_shape=out)(z)
    return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] @ x_ref[...]),  # JX101:70
                          out_shape=out)(z)
'''

VALID = '''
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def kernel(x_ref, o_ref, *, block: int, transpose: bool):
    if transpose and block > 1:
        o_ref[...] = x_ref[...].T
    else:
        o_ref[...] = x_ref[...] * 2


def host_reference(x, y):
    return x @ y


def call(x):
    out = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    return pl.pallas_call(functools.partial(kernel, block=4, transpose=True), out_shape=out)(x)
'''


def test_pallas_kernels_are_traced():
    check_annotated(INVALID)


def test_pallas_static_kernel_arguments_are_not_flagged():
    check_annotated(VALID)
