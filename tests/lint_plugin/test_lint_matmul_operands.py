"""Which operands make a matmul JX101, and how the message names it.

* ``jnp.einsum(spec, *operands)`` is a matmul;
* ``@`` between host numpy values (module-level ``np.array`` constants, ``np.*`` results) is not a
  traced matmul;
* a matmul of operands known to be int or bool is called by its dtype (``int32 matmul``) or a
  ``non-int8 matmul``, not a float matmul.

Each snippet's ``# JXnnn:col`` comments are exactly its reports (none: a VALID snippet).
"""

from __future__ import annotations

from lint_helpers import check_annotated, violations

EINSUM_STARRED_INVALID = '''
import jax
import jax.numpy as jnp


@jax.jit
def contract(spec, *operands):
    return jnp.einsum(spec, *operands)  # JX101:11


@jax.jit
def contract_list(x, w, b):
    ops = [x, w]
    y = jnp.einsum("ij,jk->ik", *ops)  # JX101:8
    return jnp.einsum("ij,jk,k->i", x, *[w, b])  # JX101:11
'''

EINSUM_STARRED_VALID = '''
import jax
import jax.numpy as jnp
import numpy as np

_OPS = (np.eye(2), np.eye(2))


@jax.jit
def f(x):
    gram = jnp.einsum("ij,jk->ik", *_OPS)
    return x * gram.sum()


def untraced(spec, *operands):
    return jnp.einsum(spec, *operands)
'''

HOST_NUMPY_VALID = '''
import jax
import numpy as np

_BASIS = np.array([[1.0, 0.0], [0.0, 1.0]])
_EYE = np.eye(2)
SCALE = 2.0


@jax.jit
def f(x):
    gram = _BASIS @ _BASIS.T
    proj = np.ones((2, 2)) @ np.eye(2)
    both = (_EYE * SCALE) @ proj
    return x * gram.sum() * both.sum()
'''

HOST_NUMPY_INVALID = '''
import jax
import jax.numpy as jnp
import numpy as np

_BASIS = np.array([[1.0, 0.0], [0.0, 1.0]])
_W = jnp.ones((2, 2))


@jax.jit
def f(x):
    a = x @ _BASIS  # JX101:8
    b = _W @ _W  # JX101:8
    c = np.ones((2, 2)) @ x  # JX101:8
    return a, b, c
'''


def test_einsum_with_starred_operands_is_a_matmul():
    check_annotated(EINSUM_STARRED_INVALID)


def test_einsum_with_starred_host_operands_is_not_flagged():
    check_annotated(EINSUM_STARRED_VALID)


def test_matmul_of_host_numpy_values_is_not_flagged():
    check_annotated(HOST_NUMPY_VALID)


def test_matmul_with_a_traced_or_jnp_operand_is_still_flagged():
    check_annotated(HOST_NUMPY_INVALID)


INT_MATMULS = '''
import jax
import jax.numpy as jnp


@jax.jit
def f(x, mask, w):
    counts = x.astype(jnp.int32)
    a = counts @ counts.T  # JX101:8
    b = (mask > 0) @ (mask > 0).T  # JX101:8
    c = counts @ (mask > 0)  # JX101:8
    d = jnp.matmul(jnp.argmax(x, axis=1), jnp.int32(w))  # JX101:8
    e = counts @ w  # JX101:8
    f = x.astype(jnp.float32) @ counts  # JX101:8
    g = jnp.abs(counts) @ jnp.clip(counts, 0, 9).T  # JX101:8
    h = jnp.asarray(counts) @ jax.lax.stop_gradient(counts).clip(0, 9)  # JX101:8
    return a, b, c, d, e, f, g, h
'''


def test_int_and_bool_matmuls_are_named_by_their_dtype():
    check_annotated(INT_MATMULS)
    what = [v.message.split(" `")[0] for v in violations(INT_MATMULS)]
    assert what == ["JX101 int32 matmul", "JX101 bool matmul", "JX101 non-int8 matmul", "JX101 int32 matmul",
                    "JX101 float matmul", "JX101 float matmul",
                    # dtype-preserving functions and methods (one table with the int8 tracking)
                    "JX101 int32 matmul", "JX101 int32 matmul"]
