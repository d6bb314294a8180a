"""Patterns from real repositories that the linter got wrong, reconstructed as small snippets.

* JX201 false alarms: a mode label compared in a model's ``__call__`` with constants imported from another
  module (maxtext's ``model_mode`` against ``MODEL_MODE_*`` from ``common_types``, passed down to helper
  methods), and a flag bound by ``functools.partial`` to the function's own name before ``jax.pmap``
  (chex's ``fake_test.py``);
* JX201 missed: ``match (x, x.sum()): case (a, 0):`` compares a traced item of the subject;
* JX103 missed: a matrix-vector product written as one expanded operand times another, summed over an axis
  (brax's spatial softmax, distrax's HMM forward step, maxtext's mixing of expert outputs).

Each snippet's ``# JXnnn:col`` comments are exactly its reports (none: no report).
"""

from __future__ import annotations

import numpy as np

from lint_helpers import check_annotated, violations

MAXTEXT_ATTENTION_OP = '''
from flax import linen as nn
from flax import nnx
import jax.numpy as jnp

from MaxText import common_types
from MaxText.common_types import (
    DECODING_ACTIVE_SEQUENCE_INDICATOR,
    MODEL_MODE_AUTOREGRESSIVE,
    MODEL_MODE_PREFILL,
    MODEL_MODE_TRAIN,
)
from .page_manager import MODEL_MODE_DECODE

MODE_TRAIN = common_types.MODEL_MODE_TRAIN


class AttentionOp(nnx.Module):
    def __init__(self, num_kv_heads: int):
        self.num_kv_heads = num_kv_heads

    def generate_attention_mask(self, query, decoder_segment_ids, model_mode):
        mask = None
        if model_mode == MODEL_MODE_AUTOREGRESSIVE:
            mask = decoder_segment_ids == DECODING_ACTIVE_SEQUENCE_INDICATOR
        elif decoder_segment_ids is not None:
            mask = decoder_segment_ids[:, :, None] == decoder_segment_ids[:, None, :]
        return mask

    def apply_attention(self, query, key, decoder_segment_ids, model_mode):
        if model_mode == MODEL_MODE_PREFILL or common_types.MODEL_MODE_PREFILL == model_mode:
            query = query * 2
        if model_mode != MODE_TRAIN and model_mode != MODEL_MODE_DECODE:
            key = key * 2
        return query + key, self.generate_attention_mask(query, decoder_segment_ids, model_mode)

    def __call__(self, query, key, decoder_segment_ids, model_mode, cached_values=None):
        if model_mode != MODEL_MODE_TRAIN:
            key, decoder_segment_ids = cached_values
        return self.apply_attention(query, key, decoder_segment_ids, model_mode=model_mode)


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, x, model_mode):
        return x * 2 if model_mode == common_types.MODEL_MODE_AUTOREGRESSIVE else x


class MultiTokenPredictionBlock(nnx.Module):
    def __call__(self, hidden, target_mask, *, model_mode, deterministic):
        losses = []
        for _ in range(3):
            if model_mode == MODEL_MODE_TRAIN:
                losses.append(jnp.sum(hidden * target_mask))
        return losses
'''

# what still is a traced branch: values the function computed, ordering comparisons, names that are not
# another module's constants, and members of an imported class compared with an unannotated parameter
IMPORTED_CONSTANT_NEAR_MISSES = '''
import jax

from config import Modes, N, PAD_ID, WARMUP_STEPS, threshold


@jax.jit
def step(x, tokens, count, mode, level, ids: jax.Array):
    if x.sum() == PAD_ID:  # JX201:4
        x = -x
    if ids == PAD_ID:  # JX201:4
        x = x + 2
    if count > WARMUP_STEPS:  # JX201:4
        x = x * 2
    tokens = tokens[0]
    if tokens == PAD_ID:  # JX201:4
        x = x + 1
    if level == threshold:  # JX201:4
        x = x - 1
    if mode == Modes.TRAIN:  # JX201:4
        x = x * 3
    if count == N:  # JX201:4
        x = x / 2
    return x
'''

CHEX_FAKE_TEST = '''
import functools

import jax


class PmapFakeTest:
    def test_with_partial(self, num_devices):
        def foo(x, y, flag):
            return (x * 2) + y if flag else (x + y)
        foo = functools.partial(foo, flag=True)

        foo = jax.pmap(foo, axis_size=num_devices)
        foo = jax.jit(foo)
        return foo

    def test_flag_bound_after_the_transform(self, num_devices):
        def bar(x, y, flag):
            return (x * 2) + y if flag else (x + y)  # JX201:34
        traced = jax.pmap(bar, axis_size=num_devices)
        bar = functools.partial(bar, flag=True)
        return traced, bar
'''

MATCH_ON_TUPLES = '''
import jax


def stats(x):
    return x.max(), x.sum()


@jax.jit
def f(x, w, mode):
    match (x, x.sum()):
        case (a, 0):  # the traced item is compared with 0
            x = a
    match x.shape, mode:
        case ((n, m), "train") if n > m:  # shapes and a mode label: static
            x = x.T
    match stats(x):
        case (_, 0.0):
            x = -x
    match [x, w]:
        case [a, b] if a.sum() > b.sum():
            x = b
        case (a, b, c):  # three items never match two: nothing compared
            x = c
    return x
'''
MATCH_ON_TUPLES_REPORTS = [(10, 14, "JX201"), (16, 10, "JX201"), (20, 23, "JX201")]

# the three contractions, with the shapes of the code they come from
BRAX_SPATIAL_SOFTMAX = '''
import jax
import jax.numpy as jnp


@jax.jit
def spatial_softmax(features, pos_x, pos_y):
    softmax = jax.nn.softmax(features, axis=-2)  # [batch, height * width, channels]
    expected_x = jnp.sum(softmax * pos_x[..., None], axis=-2)  # JX103:17
    expected_y = jnp.sum(softmax * pos_y[..., None], axis=-2)  # JX103:17
    return jnp.concatenate([expected_x, expected_y], axis=-1)
'''

DISTRAX_HMM_FORWARD = '''
import jax
import jax.numpy as jnp


def forward(init, trans, obs):
    def step(alpha, obs_probs):
        alpha = (alpha[:, None] * trans).sum(axis=0) * obs_probs  # JX103:16
        return alpha / alpha.sum(), None

    return jax.lax.scan(step, init, obs)
'''

MAXTEXT_MIXING = '''
import flax.linen as nn
import jax.numpy as jnp


class Mixer(nn.Module):
    @nn.compact
    def __call__(self, pre, x):
        mixed = jnp.sum(pre[:, :, :, None] * x, axis=2)  # JX103:16
        scaled_rows = (x * pre[..., None]).sum(-1)  # summed over the inserted axis: scaled row sums
        return mixed, scaled_rows
'''

_JX103_MESSAGE = ("JX103 broadcast multiply + sum emulates a matmul that the int8 rewrite cannot see, so it stays "
                  "float; use jnp.matmul/lax.dot_general on int8 operands with preferred_element_type=jnp.int32 "
                  "(or jnp.einsum under @int8ify)")


def test_a_mode_label_compared_with_another_modules_constants_is_not_a_traced_branch():
    check_annotated(MAXTEXT_ATTENTION_OP)


def test_computed_values_and_other_names_compared_with_constants_are_still_traced_branches():
    check_annotated(IMPORTED_CONSTANT_NEAR_MISSES)
    first = violations(IMPORTED_CONSTANT_NEAR_MISSES)[0]
    assert first.message == ("JX201 Python `if` on a traced value (TracerBoolConversionError under jit); "
                             "use jnp.where or lax.cond")


def test_a_flag_bound_by_partial_to_the_functions_own_name_is_static():
    check_annotated(CHEX_FAKE_TEST)


def test_a_match_compares_the_traced_items_of_a_tuple_subject():
    reports = violations(MATCH_ON_TUPLES)
    assert [(v.line, v.col, v.code) for v in reports] == MATCH_ON_TUPLES_REPORTS
    match, _, guard = reports
    assert match.message == ("JX201 Python `match` on a traced value (TracerBoolConversionError under jit); "
                             "use lax.switch on an index, or jnp.where")
    assert guard.message.startswith("JX201 Python `case guard` on a traced value")


def test_one_expanded_operand_summed_over_an_axis_it_spans_is_an_emulated_matmul():
    for snippet in (BRAX_SPATIAL_SOFTMAX, DISTRAX_HMM_FORWARD, MAXTEXT_MIXING):
        check_annotated(snippet)
        assert {v.message for v in violations(snippet)} == {_JX103_MESSAGE}


def test_the_flagged_products_are_contractions():
    """What JX103 now reports computes a matrix-vector product, batched or not (float64 numpy against the
    einsum that writes it as one), at the sizes of the models they come from."""
    rng = np.random.default_rng(0)
    softmax, pos = rng.random((8, 256, 64)), rng.random(256)
    np.testing.assert_allclose(np.sum(softmax * pos[..., None], axis=-2), np.einsum("bnc,n->bc", softmax, pos))
    alpha, trans = rng.random(128), rng.random((128, 128))
    np.testing.assert_allclose((alpha[:, None] * trans).sum(axis=0), alpha @ trans)
    pre, x = rng.random((4, 64, 8)), rng.random((4, 64, 8, 128))
    np.testing.assert_allclose(np.sum(pre[:, :, :, None] * x, axis=2), np.einsum("bsk,bskd->bsd", pre, x))
