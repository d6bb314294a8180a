"""Module objects handed to traced code: ``nn.apply(fn, module)``, ``method="encode"``, and a model passed into a
transformed function.

* ``flax.linen.apply(fn, module)`` (and ``nn.init``/``nn.init_with_output``): ``fn`` runs like a method of the
  module; its first parameter is the bound module, the others are traced, and the bare truth value of an
  unannotated one (``if train:``) is a Python flag;
* ``model.apply(variables, x, method="encode")`` traces ``encode`` of ``model``'s linen class, as
  ``method=Model.encode`` does, when that class is known;
* ``model.encode(x)`` in traced code (``@nnx.jit``, ``@eqx.filter_jit``, ``@jax.jit``) traces ``encode`` of
  ``model``'s class when the source says which class it is: ``model = Model(...)``, ``model: Model``, or the calls
  of the file passing a ``Model(...)``. Where it does not (two classes, a reassignment, no annotation and no call),
  nothing is followed.

Each snippet's ``# JXnnn:col`` comments are exactly its reports. Every snippet but the last has a report that only
the resolution above finds, next to the code it must leave alone; the last shows that ``model(x)`` runs a traced
``__call__`` whatever the class (module ``__call__`` methods were traced code before).
"""

from __future__ import annotations

from lint_helpers import check_annotated

NN_APPLY_INVALID = '''
import flax.linen as nn
from flax import linen
from flax.linen import apply as bind_and_call


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x)

    def encode(self, x):
        return x if x.sum() > 0 else -x  # JX201:20


def decode(module, x, w):
    if x.sum() > 0:  # JX201:4
        x = -x
    return module(x) @ w  # JX101:11


def init_decode(module, x):
    return module(x) if x.max() > 0 else x  # JX201:24


def aliased(module, x):
    assert x.min() > 0  # JX201:4
    return module.encode(x)


def run(variables, rng, x, w):
    y = nn.apply(decode, Model())(variables, x, w)
    _, v = linen.init_with_output(init_decode, Model())(rng, x)
    return y, v, bind_and_call(aliased, Model())(variables, x)
'''

NN_APPLY_VALID = '''
import flax.linen as nn


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x)


def decode(module, x, train, n: int, mode="eval"):
    if train:
        x = x * 2
    if n > 1 and mode == "train":
        x = x + 1
    x = x if not train else -x
    y = -x if x.mean() > 0 else x  # JX201:14
    return maybe_apply(module, y)


def maybe_apply(module, y):
    return module(y) if module else y


def not_applied(module, x, train):
    if x.sum() > 0:
        x = -x
    return module(x)


def run(variables, x):
    return nn.apply(decode, Model())(variables, x, True, 2)
'''

METHOD_NAME_INVALID = '''
import flax.linen as nn


class AutoEncoder(nn.Module):
    def setup(self):
        self.enc = nn.Dense(3)

    def encode(self, x, train):
        if train:
            x = x * 2
        if x.sum() > 0:  # JX201:8
            x = -x
        return self.enc(x)

    def decode(self, z):
        return z @ z.T  # JX101:15

    def project(self, z, w):
        return z if w.max() > 0 else -z  # JX201:20

    def __call__(self, x):
        return self.enc(x)


def run(variables, x, w):
    model = AutoEncoder()
    z = model.apply(variables, x, True, method="encode")
    z = AutoEncoder().apply(variables, z, method='decode')
    return model.apply(variables, z, w, method=model.project)
'''

METHOD_NAME_VALID = '''
import flax.linen as nn


def load():
    return None


class AutoEncoder(nn.Module):
    def encode(self, x):
        if x.sum() > 0:
            x = -x
        return x

    def decode(self, z, train):
        if not train:
            return z
        return -z if z.max() > 0 else z  # JX201:21

    def __call__(self, x):
        return x


def unknown_model(variables, x):
    return load().apply(variables, x, method="encode")


def reassigned(variables, x):
    model = AutoEncoder()
    model = load()
    return model.apply(variables, x, method="encode")


def run(variables, x):
    return AutoEncoder().apply(variables, x, False, method="decode")


def scoped():
    class AutoEncoder(nn.Module):
        def encode(self, x):
            return x

    return AutoEncoder().apply({}, 0, method="encode")
'''

PASSED_MODEL_INVALID = '''
import equinox as eqx
import jax
from flax import nnx


class Net(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(2, 2, rngs=rngs)

    def encode(self, x, deterministic):
        if deterministic:
            return x
        if x.mean() > 0:  # JX201:8
            x = -x
        return self.lin(x)

    def score(self, x):
        return x @ x.T  # JX101:15


@nnx.jit
def step(model: Net, x):
    return model.encode(x, False)


class Eqx(eqx.Module):
    w: jax.Array

    def encode(self, x):
        return x @ self.w  # JX101:15

    def __call__(self, x):
        return x


@eqx.filter_jit
def apply_eqx(model, x):
    return model.encode(x)


def main(x):
    model = Eqx(x)
    return apply_eqx(model, x)


net = Net(nnx.Rngs(0))


@jax.jit
def closure(x):
    return net.score(x)
'''

PASSED_MODEL_VALID = '''
import equinox as eqx
import jax


class A(eqx.Module):
    w: jax.Array

    def encode(self, x, training):
        if training:
            x = x * 2
        return x if x.sum() > 0 else -x  # JX201:20

    def decode(self, x):
        if x.sum() > 0:
            return x
        return -x


class B(eqx.Module):
    def encode(self, x, training):
        if x.max() > 0:
            return x
        return -x

    def decode(self, x):
        if x.min() > 0:
            return x
        return -x


@eqx.filter_jit
def annotated(model: A, x):
    return model.encode(x, True)


@eqx.filter_jit
def unannotated_and_never_called(model, x):
    return model.decode(x)


@eqx.filter_jit
def called_with_two_classes(model, x):
    return model.decode(x)


@eqx.filter_jit
def rebound(model: A, x):
    model = eqx.tree_at(lambda m: m.w, model, x)
    return model.decode(x)


@eqx.filter_jit
def shadowed(x, models):
    model = A(x)
    return [model.decode(x) for model in models]


def host(model: B, x):
    return model.encode(x, False)


def main(x):
    called_with_two_classes(A(x), x)
    called_with_two_classes(B(), x)
    return host(B(), x)
'''

CALL_ALREADY_TRACED = '''
from flax import nnx


class Net(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(2, 2, rngs=rngs)

    def __call__(self, x, train=False):
        if train:
            x = x * 2
        if x.sum() > 0:  # JX201:8
            return x
        return self.lin(x)


@nnx.jit
def step(model, x):
    return model(x)
'''


def test_nn_apply_traces_fn_like_a_module_method():
    check_annotated(NN_APPLY_INVALID)


def test_nn_apply_keeps_python_flags_static_and_leaves_other_functions_alone():
    check_annotated(NN_APPLY_VALID)


def test_method_given_by_name_or_instance_attribute_is_traced():
    check_annotated(METHOD_NAME_INVALID)


def test_method_name_is_resolved_only_on_a_known_class():
    check_annotated(METHOD_NAME_VALID)


def test_methods_called_on_a_model_of_known_class_are_traced():
    check_annotated(PASSED_MODEL_INVALID)


def test_methods_of_a_model_of_unknown_class_are_not_followed():
    check_annotated(PASSED_MODEL_VALID)


def test_calling_a_passed_model_traces_its_call_method():
    """``model(x)`` runs ``__call__``, which is traced code for every module class (this worked before ``encode``
    and the other methods were followed)."""
    check_annotated(CALL_ALREADY_TRACED)
