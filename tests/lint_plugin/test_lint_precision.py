"""JX201 precision on model code: branches on values that cannot be traced are not flagged.

* a parameter compared with a string (a literal or a module-level string constant) or with a member
  of the enum it is annotated with: a traced array is never compared with a string or an enum member;
* sharding metadata: a parameter used as a collective's axis name or as a sharding (``lax.psum(x,
  axis_names)``, ``NamedSharding(mesh, spec)``), or annotated ``PartitionSpec``/``Mesh``/...; its
  entries (``for dim in pspec``) too;
* a Python bool a local helper derives from a shape (``def is_sharded(a): return a.shape[0] > 1``),
  passed on as an argument or captured by a closure.

Each snippet's ``# JXnnn:col`` comments are exactly its reports (none: a VALID snippet); the INVALID
snippets keep the near misses that must still be flagged.
"""

from __future__ import annotations

from lint_helpers import check_annotated

STRING_AND_ENUM_VALID = '''
import enum

import jax
import jax.numpy as jnp

from model.types import HyperConnectionType

MODEL_MODE_TRAIN = "train"


class Mode(enum.Enum):
    TRAIN = 1
    DECODE = 2


@jax.jit
def block(x, model_mode, kind, mhc_type: HyperConnectionType, mode):
    if model_mode != MODEL_MODE_TRAIN:
        x = x * 2
    if kind == "gated" or f"{kind}" == "plain":
        x = jnp.tanh(x)
    if mhc_type == HyperConnectionType.ATTENTION:
        x = x + 1
    y = x if mode is Mode.TRAIN or mode == Mode.DECODE else -x
    return y
'''

STRING_AND_ENUM_INVALID = '''
import jax

from model.types import HyperConnectionType

THRESHOLD = 0.5


@jax.jit
def block(x, mhc_type, other: HyperConnectionType):
    if x.max() > THRESHOLD:  # JX201:4
        x = x * 2
    if mhc_type == HyperConnectionType.ATTENTION:  # JX201:4
        x = x + 1
    if x.sum() == other:  # JX201:4
        x = -x
    return x
'''

SHARDING_VALID = '''
import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec


def reduce_over(x, axis_names):
    if axis_names:
        x = lax.psum(x, axis_names)
    return x


def constrain(x, mesh, pspec):
    if not pspec:
        return x
    axes = [dim or () for dim in pspec]
    return lax.with_sharding_constraint(x, NamedSharding(mesh, pspec)), axes


@jax.jit
def layer(x, spec: PartitionSpec, names, mesh):
    if spec and len(spec) > 1:
        x = x * 2
    for dim in spec:
        if dim or ():
            x = x + 1
    return constrain(reduce_over(x, names), mesh, spec)
'''

SHARDING_INVALID = '''
import jax
from jax import lax


@jax.jit
def layer(x, names, scale):
    if scale:  # JX201:4
        x = x * 2
    return lax.psum(x, names)
'''

SHAPE_HELPER_VALID = '''
import jax
from jax import lax


def is_sharded(a):
    return a.shape[0] > 1


def apply(x, sharded):
    if sharded:
        return x * 2
    return x


@jax.jit
def step(x):
    sharded = is_sharded(x)

    def body(carry, _):
        if sharded:
            carry = carry + 1
        return carry, None

    y, _ = lax.scan(body, x, None, length=3)
    if is_sharded(y) and not sharded:
        y = -y
    return apply(y, sharded)
'''

SHAPE_HELPER_INVALID = '''
import jax


def positive(a):
    return a.sum() > 0


def apply(x, flag):
    if flag:  # JX201:4
        return x * 2
    return x


@jax.jit
def step(x):
    if positive(x):  # JX201:4
        x = -x
    return apply(x, positive(x))
'''


def test_comparisons_with_strings_and_enum_members_are_static():
    check_annotated(STRING_AND_ENUM_VALID)


def test_comparisons_with_other_constants_are_still_flagged():
    check_annotated(STRING_AND_ENUM_INVALID)


def test_sharding_metadata_is_static():
    check_annotated(SHARDING_VALID)


def test_a_parameter_only_used_as_an_axis_name_does_not_make_others_static():
    check_annotated(SHARDING_INVALID)


def test_bools_from_shapes_through_a_helper_are_static():
    check_annotated(SHAPE_HELPER_VALID)


def test_bools_from_values_through_a_helper_are_still_flagged():
    check_annotated(SHAPE_HELPER_INVALID)
