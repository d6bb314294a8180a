"""Equinox: ``eqx.Module.__call__`` (and the methods it calls) is traced code; array-typed fields are
traced, ``eqx.field(static=True)`` and Python-typed fields are static.

Each snippet's ``# JXnnn:col`` comments are exactly its reports (none: a VALID snippet).
"""

from __future__ import annotations

from lint_helpers import check_annotated

INVALID = '''
import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


class MLP(eqx.Module):
    weight: jax.Array
    bias: Float[Array, "out"]
    scale: jnp.ndarray
    table: Array

    def __call__(self, x):
        y = self.weight @ x  # JX101:12
        if self.bias.sum() > 0:  # JX201:8
            y = y + self.bias
        y = y * self.scale if self.scale.max() > 1 else y  # JX201:30
        return self._lookup(y)

    def _lookup(self, y):
        while (self.table > y).any():  # JX201:8
            y = y + 1
        return y
'''

VALID = '''
from typing import Callable, Optional

import equinox as eqx
import jax
import jax.numpy as jnp


class MLP(eqx.Module):
    weight: jax.Array
    act: Callable
    n_layers: int
    shape: tuple[int, ...]
    dropout: Optional[bool]
    use_bias: bool = eqx.field(static=True)
    norm: object = eqx.field(static=True, default=None)
    name: str = "mlp"

    def __call__(self, x):
        if self.use_bias and self.n_layers > 1 and self.shape[0] > 0 and self.name and self.dropout:
            x = x + 1
        if self.norm is not None and self.norm:
            x = x * 2
        return self.act(x)

    def __init__(self, weight):
        self.weight = weight @ weight
'''


def test_equinox_module_call_and_array_fields_are_traced():
    check_annotated(INVALID)


def test_equinox_static_fields_are_not_flagged():
    check_annotated(VALID)
