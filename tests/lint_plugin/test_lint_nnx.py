"""flax.nnx: module ``__call__`` (and the methods it calls) and the bodies of nnx transforms are traced
code; Variables (``self.w.value``, ``self.w[...]``) are arrays, config set in ``__init__`` is static.

Each snippet's ``# JXnnn:col`` comments are exactly its reports (none: a VALID snippet).
"""

from __future__ import annotations

import pytest

from lint_helpers import check_annotated

MODULE_INVALID = '''
import jax.numpy as jnp
from flax import nnx
from jax import lax


class Block(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.zeros((din, dout)))
        self.b = nnx.Variable(jnp.zeros((dout,)))

    def __call__(self, x):
        y = x @ self.w.value  # JX101:12
        if self.b[...].sum() > 0:  # JX201:8
            y = -y
        if (self.b > 0).any():  # JX201:8
            y = y * 2
        z = self.w @ self.w  # JX101:12
        return self._patches(y + z)

    def _patches(self, y):
        return lax.conv_general_dilated_patches(y, (3, 3), (1, 1), "SAME")  # JX104:15

    def not_called_from_call(self, y):
        return y @ y
'''

MODULE_VALID = '''
import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
    def __init__(self, din: int, dout: int, *, use_bias: bool = True, rate=0.1, mode: str = "a",
                 rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.zeros((din, dout)))
        self.use_bias = use_bias
        self.rate = rate
        self.heads = dout // 2
        self.mode = mode
        self.kind = "block"
        self.bias = nnx.Param(jnp.zeros((dout,))) if use_bias else None
        if use_bias:
            self.scale = nnx.Param(jnp.ones((dout,)))
        else:
            self.scale = None

    def __call__(self, x, deterministic: bool = False):
        if self.use_bias and self.rate > 0 and self.heads > 1 and self.mode == "a" and self.kind:
            x = x + 1
        if not deterministic:
            x = x * 2
        # a Variable's truthiness is len() of its array: static
        bias = self.bias[...] if self.bias else None
        if self.bias and self.scale and not self.w:
            x = (x + bias) * self.scale
        return x
'''

MATCH_INVALID = '''
import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
    def __init__(self, din: int, dout: int, kind: str, *, rngs: nnx.Rngs):
        match kind:
            case "dense":
                self.w = nnx.Param(jnp.zeros((din, dout)))
                self.scaled = False
            case _:
                self.w = nnx.Variable(jnp.ones((din, dout)))
                self.scaled = True

    def __call__(self, x):
        if self.scaled:
            x = x * 2
        if self.w[...].sum() > 0:  # JX201:8
            x = -x
        return x
'''

TRANSFORMS_INVALID = '''
import jax.numpy as jnp
from flax import nnx
from jax import lax


@nnx.jit
def step(x, w):
    return x @ w  # JX101:11


@nnx.vmap
def mapped(x, w):
    return jnp.dot(x, w)  # JX101:11


@nnx.grad
def loss(x):
    if x.sum() > 0:  # JX201:4
        return x.sum()
    return -x.sum()


@nnx.remat
def block(x):
    return lax.conv(x, x, (1, 1), "SAME")  # JX104:11


def fori_body(i, x):
    return x @ x  # JX101:11


def scan_body(carry, x):
    if carry.sum() > 0:  # JX201:4
        carry = carry + x
    return carry, x


def true_fun(x):
    return jnp.matmul(x, x)  # JX101:11


def shard_body(x):
    return jnp.einsum("ij,jk->ik", x, x)  # JX101:11


def run(x, pred, mesh, spec):
    x = nnx.fori_loop(0, 3, fori_body, x)
    carry, _ = nnx.scan(scan_body)(x, x)
    y = nnx.cond(pred, true_fun, lambda v: v, x)
    value, grads = nnx.value_and_grad(lambda v: (v @ v).sum())(x)  # JX101:49
    return nnx.shard_map(shard_body, mesh=mesh, in_specs=spec, out_specs=spec)(y)
'''

TRANSFORMS_VALID = '''
from functools import partial

import jax.numpy as jnp
from flax import nnx


@partial(nnx.jit, static_argnums=(1,))
def step(x, n):
    if n > 2:
        x = x * 2
    return x * n


def untraced(x, w):
    return x @ w
'''


@pytest.mark.parametrize("snippet", [MODULE_INVALID, MATCH_INVALID, TRANSFORMS_INVALID],
                         ids=["module", "match-in-init", "transforms"])
def test_nnx_traced_code_is_flagged(snippet):
    check_annotated(snippet)


@pytest.mark.parametrize("snippet", [MODULE_VALID, TRANSFORMS_VALID], ids=["module", "transforms"])
def test_nnx_static_config_is_not_flagged(snippet):
    check_annotated(snippet)
