"""JX201 on Equinox filter transforms, module methods other than ``__call__``, and names bound twice.

* ``eqx.filter_jit``/``filter_grad``/``filter_vmap`` keep non-array leaves Python values: a parameter annotated
  with a Python type (``n: int``) or with a literal default (``training=False``) is not a tracer there;
* a linen, nnx or equinox module's other methods run as traced code when ``__call__`` calls them, and a linen
  method given as ``method=`` to ``model.apply``/``init`` runs like ``__call__``: a branch on a traced value there
  is flagged, the bare truth value of a flag parameter (``if train:``) is not;
* a name defined twice (notebook extracts): ``jax.jit(loss)`` traces the ``def loss`` the name holds when the
  call runs, not an earlier one it replaced or a later one; a local name rebound to a static value
  (``x = x.shape[0]``) is static from there on.

Each snippet's ``# JXnnn:col`` comments are exactly its reports (none: a VALID snippet).
"""

from __future__ import annotations

from lint_helpers import check_annotated

FILTER_JIT_VALID = '''
import equinox as eqx


@eqx.filter_jit
def f(x, n: int, training=False, mode="train", scale: float = 1.0):
    if n > 2 and training:
        x = x * 2
    if mode == "train" or not training:
        x = x + 1
    return x * scale if training else x


@eqx.filter_grad
def loss(model, x, n: int, training=False):
    if n > 2 and training:
        x = x * 2
    return model(x).sum()


@eqx.filter_vmap
def g(x, n: int, training=False):
    return x * n if training else x
'''

FILTER_JIT_INVALID = '''
import equinox as eqx


@eqx.filter_jit
def f(x, n: int, training=False):
    if x.sum() > 0 and training:  # JX201:4
        x = x * 2
    return x if n > 2 else -x
'''

MODULE_METHODS = '''
import equinox as eqx
import flax.linen as nn
from flax import nnx


class Linen(nn.Module):
    def encode(self, x, train):
        if train:
            x = x * 2
        if x.sum() > 0:  # JX201:8
            x = -x
        return x

    @nn.compact
    def __call__(self, x, train=False):
        return self.encode(nn.Dense(3)(x), train)


class Applied(nn.Module):
    def setup(self):
        self.dense = nn.Dense(3)

    def encode(self, x, train):
        if not train:
            x = self.dense(x)
        return -x if x.max() > 0 else x  # JX201:21

    def __call__(self, x):
        return self.dense(x)


def run(params, x):
    return Applied().apply(params, x, True, method=Applied.encode)


class Nnx(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(2, 2, rngs=rngs)

    def encode(self, x, deterministic):
        if deterministic:
            return x
        while x.sum() > 0:  # JX201:8
            x = x - 1
        return x

    def __call__(self, x, deterministic=False):
        return self.encode(self.lin(x), deterministic)


class Eqx(eqx.Module):
    w: object

    def encode(self, x, train, n):
        if train and n > 1:
            x = x * 2
        assert x.min() > 0  # JX201:8
        return x

    def __call__(self, x, train=False):
        return self.encode(x * self.w, train, 3)
'''

REDEFINED_VALID = '''
import jax


def loss(params, x):
    if params > 0:
        return params
    return x


def loss(params, x):
    return (params * x).sum()


grad_fn = jax.grad(loss)


def step(x):
    return x.sum()


step_fn = jax.jit(step)


def step(x):
    if x > 0:
        return x
    return -x


def main(x):
    return jax.jit(loss)(x, x)


@jax.jit
def rebound(x, xs):
    x = x.shape[0]
    if x > 1:
        xs = xs * 2
    n = xs.sum()
    n = len(xs)
    while n > 1:
        n = n // 2
    return xs
'''

REDEFINED_INVALID = '''
import jax

if jax.__version__ > "0.4":
    def loss(params, x):
        return (params * x).sum()
else:
    def loss(params, x):
        if params > 0:  # JX201:8
            return params
        return x


loss_fn = jax.jit(loss)


def step(x):
    return x.sum()


def step(x):
    if x > 0:  # JX201:4
        return x
    return -x


step_fn = jax.jit(step)


@jax.jit
def rebound(x):
    for _ in range(3):
        if x > 1:  # JX201:8
            pass
        x = x.shape[0]
    return x
'''


def test_filter_transforms_keep_python_typed_and_defaulted_parameters_static():
    check_annotated(FILTER_JIT_VALID)


def test_filter_jit_still_flags_branches_on_arrays():
    check_annotated(FILTER_JIT_INVALID)


def test_module_methods_other_than_call_are_traced_and_keep_flags_static():
    check_annotated(MODULE_METHODS)


def test_a_redefined_function_is_traced_only_where_the_name_holds_it():
    check_annotated(REDEFINED_VALID)


def test_conditional_and_later_definitions_and_rebinding_are_still_flagged():
    check_annotated(REDEFINED_INVALID)
