"""Pallas: the kernel given to ``pl.pallas_call`` (directly, through ``functools.partial``, or a
lambda) is traced code, and so are ``@pl.when`` bodies and ``lax.fori_loop`` bodies inside it.

Each snippet's ``# JXnnn:col`` comments are exactly its reports (none: a VALID snippet).
"""

from __future__ import annotations

import re

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


# A grouped matmul on TPU: the kernel given to ``pl.pallas_call`` runs a per-tile body through
# ``pltpu.emit_pipeline`` (a function this plugin does not know, so the body counts as a callback
# run at trace time), and the body picks its step through ``lax.cond`` between wrappers under
# ``jax.named_scope``. The kernel is walked before its caller marks it as outside ``@int8ify``;
# the bodies it passes on must still be checked as such.
GROUPED_MATMUL = '''
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _tile_body(lhs_ref, rhs_ref, out_ref, acc_ref, *, tile_k):
    def accumulate(first: bool, last: bool):
        lhs = lhs_ref.reshape(-1, tile_k)[...]
        part = jnp.matmul(lhs, rhs_ref[...], preferred_element_type=jnp.float32)  # JX101:15
        if not first:
            part += acc_ref[...]
        if last:
            out_ref[...] = part.astype(out_ref.dtype)
        else:
            acc_ref[...] = part

    @jax.named_scope("first_step")
    def first_step():
        accumulate(True, False)

    @jax.named_scope("last_step")
    def last_step():
        accumulate(False, True)

    lax.cond(pl.program_id(2) == 0, first_step, last_step)


def _grouped_kernel(group_sizes_ref, lhs_ref, rhs_ref, out_ref, acc_ref, *, tile_k):
    pipeline = pltpu.emit_pipeline(functools.partial(_tile_body, tile_k=tile_k), grid=(2, 2, 2),
                                   in_specs=(None, None), out_specs=None)
    pipeline(lhs_ref, rhs_ref, out_ref, scratches=[acc_ref])


def _weight_grad_body(lhs_ref, grad_ref, out_ref):
    dims = (((0,), (0,)), ((), ()))
    out_ref[...] += lax.dot_general(lhs_ref[...], grad_ref[...], dims,  # JX101:20
                                    preferred_element_type=jnp.float32)


def _weight_grad_kernel(group_sizes_ref, lhs_ref, grad_ref, out_ref):
    pltpu.emit_pipeline(_weight_grad_body, grid=(2,), in_specs=(None, None), out_specs=None)(
        lhs_ref, grad_ref, out_ref)


@jax.jit(static_argnames=["tile_k"])
def grouped_matmul(lhs, rhs, group_sizes, *, tile_k=128):
    out = jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[-1]), lhs.dtype)
    return pl.pallas_call(functools.partial(_grouped_kernel, tile_k=tile_k), out_shape=out)(group_sizes, lhs, rhs)


@jax.jit
def grouped_weight_grad(lhs, grad, group_sizes):
    out = jax.ShapeDtypeStruct((lhs.shape[1], grad.shape[1]), jnp.float32)
    return pl.pallas_call(_weight_grad_kernel, out_shape=out)(group_sizes, lhs, grad)
'''


def test_float_matmuls_in_tpu_grouped_matmul_pipeline_bodies_are_flagged():
    check_annotated(GROUPED_MATMUL)


def test_the_same_bodies_under_int8ify_are_not_flagged():
    under_int8ify = (GROUPED_MATMUL.replace("import jax\n", "import jax\nfrom int8ify import int8ify\n")
                     .replace("@jax.jit", "@int8ify"))
    check_annotated(re.sub(r"  # JX101:\d+", "", under_int8ify))
