"""Parameters that arrive as Python values, not tracers:

* values bound with ``functools.partial`` before the function is passed to ``jax.jit``/``pmap``;
* ``shard_map`` body parameters whose ``in_specs`` entry is ``None``;
* parameters annotated with a non-array type: ``bool``/``int``/``str``, an ``Enum`` of the file,
  a ``dict``/``Mapping`` (also through a module-level alias), ``Optional[...]`` of those.

Each snippet's ``# JXnnn:col`` comments are exactly its reports (none: a VALID snippet).
"""

from __future__ import annotations

from lint_helpers import check_annotated

PARTIAL_VALID = '''
import functools

import jax
import numpy as np

_EYE = np.eye(3)


def step(x, flag, proj, n):
    if flag and n > 1:
        x = x * 2
    return x * (proj @ proj).sum()


jitted = jax.jit(functools.partial(step, flag=True, proj=_EYE, n=3))
bound = functools.partial(step, flag=False, proj=_EYE, n=2)
pmapped = jax.pmap(bound)
positional = jax.jit(functools.partial(step, 1.0), static_argnums=(0, 1, 2))
'''

PARTIAL_INVALID = '''
import functools

import jax


def step(x, w, flag):
    if flag:
        x = x * 2
    if x.sum() > 0:  # JX201:4
        x = -x
    return x @ w  # JX101:11


bound = functools.partial(step, flag=True)
pmapped = jax.pmap(bound)


def first_bound(w, x):
    return x @ w  # JX101:11


jitted = jax.jit(functools.partial(first_bound, 3.0), static_argnums=())
'''

SHARD_MAP_VALID = '''
from functools import partial

import jax
from jax.experimental.shard_map import shard_map
from jax.sharding import PartitionSpec as P


def body(x, cfg, scale):
    if cfg and scale > 1:
        x = x * 2
    return x


def run(mesh, x):
    return shard_map(body, mesh, (P("i"), None, None), P("i"))(x, {"a": 1}, 2)


@partial(jax.shard_map, mesh=None, in_specs=(P("i"), None), out_specs=P("i"))
def decorated(x, cfg):
    return x * 2 if cfg else x
'''

SHARD_MAP_INVALID = '''
import jax
from jax.sharding import PartitionSpec as P


def body(x, y):
    if y.sum() > 0:  # JX201:4
        x = x * 2
    return x


def run(mesh, x, y):
    return jax.shard_map(body, mesh=mesh, in_specs=(None, P("i")), out_specs=P("i"))(x, y)
'''

ANNOTATIONS_VALID = '''
import enum
from typing import Mapping, Optional

import jax

LayerCache = dict[str, jax.Array]


class Mode(enum.Enum):
    TRAIN = 1
    EVAL = 2


class Fast(Mode):
    pass


@jax.jit
def f(x, cache: LayerCache, params: Mapping[str, jax.Array], mode: Mode, fast: Optional[Fast],
      maybe: Optional[LayerCache], n: int, flag: bool, name: str, count: int | None):
    if cache and params and mode == Mode.TRAIN and fast and maybe:
        x = x + 1
    if n > 1 and flag and name == "a" and count:
        x = x * 2
    if len(cache) > 2 and "k" in params:
        x = x - 1
    return x
'''

ANNOTATIONS_INVALID = '''
from typing import Optional

import jax

Array = jax.Array


@jax.jit
def f(x: Array, y: jax.Array, z: Optional[jax.Array], cache: dict[str, jax.Array]):
    if x.sum() > 0:  # JX201:4
        x = -x
    if y.max() > 1:  # JX201:4
        y = -y
    if cache["k"].sum() > 0:
        x = x + 1
    return x @ y  # JX101:11
'''


def test_partial_bound_values_are_static():
    check_annotated(PARTIAL_VALID)


def test_partial_bound_function_is_still_traced():
    check_annotated(PARTIAL_INVALID)


def test_shard_map_none_in_specs_are_static():
    check_annotated(SHARD_MAP_VALID)


def test_shard_map_sharded_arguments_are_traced():
    check_annotated(SHARD_MAP_INVALID)


def test_non_array_annotations_are_static():
    check_annotated(ANNOTATIONS_VALID)


def test_array_annotations_stay_traced():
    check_annotated(ANNOTATIONS_INVALID)
