"""A Llama-architecture decoder in JAX (SmolLM2-135M-Instruct's shape by default) with a functional KV cache.

The weights are defined by Flax NNX modules (:class:`Llama`, :class:`Block`), which give random weights of any
:class:`LlamaConfig` (a Llama-3-8B-shaped decoder for a benchmark as well as the 135M chat model) and the structure
the GGUF loader fills. The forward pass is a pure function of a plain pytree, :func:`params_of`'s nested dict, so that
``int8ify(forward)`` and ``quantize_params(forward, params, ...)`` apply to it directly, the params first:

``forward(params, tokens, cache, position) -> (logits, cache)``

serves prefill (``tokens`` is ``[batch, prompt_length]``) and decode (``[batch, 1]``) alike. The cache is an
explicit pytree passed in and returned, one ``{"k", "v"}`` per layer, each ``[batch, max_len, kv_heads, head_dim]``
and preallocated with zeros (:func:`init_cache`); a call writes its keys and values at ``position`` with
``lax.dynamic_update_slice`` and attends over the whole preallocated cache, the positions not yet written masked.
Grouped-query attention reads the cache arrays as they are, without repeating the key-value heads: the queries
are reshaped to ``[batch, t, kv_heads, group, head_dim]`` and both attention matmuls are einsums with the cache
operands (the key contracted over head_dim, the value over tokens), where a quantized cache can plug in.

Every matmul sits in a ``jax.named_scope`` (``layer_3/attention/q``, ``layer_3/mlp/down``, ``lm_head``), the
names ``int8ify(skip=...)`` and ``report`` match.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-architecture decoder.

    Registered as a static pytree node (no leaves): it travels inside the params pytree as the model's description,
    and ``jit``, ``int8ify`` and ``quantize_params`` see it as part of the tree's structure, never as data.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def group(self) -> int:
        """Query heads per key-value head."""
        return self.n_heads // self.n_kv_heads


jax.tree_util.register_static(LlamaConfig)

SMOLLM2_135M = LlamaConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                           ffn_dim=1536, rope_theta=100000.0, rms_eps=1e-5, tie_embeddings=True)
LLAMA3_8B = LlamaConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                        ffn_dim=14336, rope_theta=500000.0, rms_eps=1e-5, tie_embeddings=False)


# ----------------------------------------------------------------------------------------------------------
# Weights: NNX modules
# ----------------------------------------------------------------------------------------------------------


# Where a module's arrays come from: ``weights(path, shape, kind)`` returns the array of the pure-dict path
# ``path`` ("embed", "layers.3.wq", ...) with ``shape``; ``kind`` is "norm" (an RMSNorm scale) or "weight".
WeightSource = Callable[[str, tuple, str], jax.Array]


def random_weights(seed: int = 0, dtype=jnp.float32) -> WeightSource:
    """Random weights (normal, std 0.02, as Llama initialises them; norm scales 1)."""
    rngs = nnx.Rngs(seed)
    init = nnx.initializers.normal(0.02)

    def weights(path: str, shape: tuple, kind: str) -> jax.Array:
        return jnp.ones(shape, dtype) if kind == "norm" else init(rngs.params(), shape, dtype)

    return weights


class Block(nnx.Module):
    """One decoder layer's weights. Projections are stored ``(in, out)``, so that each is ``x @ w``."""

    def __init__(self, config: LlamaConfig, weights: WeightSource, prefix: str):
        d, q_width, kv_width = config.d_model, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim

        def param(name: str, shape: tuple, kind: str = "weight") -> nnx.Param:
            return nnx.Param(weights(prefix + name, shape, kind))

        self.attn_norm = param("attn_norm", (d,), "norm")
        self.wq, self.wk, self.wv = param("wq", (d, q_width)), param("wk", (d, kv_width)), param("wv", (d, kv_width))
        self.wo = param("wo", (q_width, d))
        self.mlp_norm = param("mlp_norm", (d,), "norm")
        self.w_gate, self.w_up = param("w_gate", (d, config.ffn_dim)), param("w_up", (d, config.ffn_dim))
        self.w_down = param("w_down", (config.ffn_dim, d))


class Llama(nnx.Module):
    """The decoder's weights: token embedding ``(vocab, d)``, the layers, the final norm and, untied, the LM head
    ``(d, vocab)``; each array asked of ``weights`` (:func:`random_weights`, or a file's loader) by its path."""

    def __init__(self, config: LlamaConfig, weights: WeightSource):
        self.config = config
        self.embed = nnx.Param(weights("embed", (config.vocab_size, config.d_model), "weight"))
        self.layers = nnx.List([Block(config, weights, f"layers.{i}.") for i in range(config.n_layers)])
        self.final_norm = nnx.Param(weights("final_norm", (config.d_model,), "norm"))
        if not config.tie_embeddings:
            self.lm_head = nnx.Param(weights("lm_head", (config.d_model, config.vocab_size), "weight"))


def params_of(model: Llama) -> dict:
    """The plain pytree :func:`forward` reads: ``{"config", "embed", "layers": [{...}, ...], "final_norm"[,
    "lm_head"]}``, the module's ``nnx.Param`` arrays (not copied) and its config."""
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    pure["layers"] = [pure["layers"][i] for i in range(len(pure["layers"]))]  # nnx.List's state is keyed 0, 1, ...
    return {"config": model.config, **pure}


def random_params(config: LlamaConfig, seed: int = 0, dtype=jnp.float32) -> dict:
    """Random weights of ``config`` (:func:`random_weights`), e.g. a Llama-3-8B-shaped decoder to time."""
    return params_of(Llama(config, random_weights(seed, dtype)))


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------


def init_cache(config: LlamaConfig, batch: int, max_len: int, dtype=jnp.float32) -> list[dict]:
    """The preallocated KV cache: per layer ``{"k": zeros[batch, max_len, kv_heads, head_dim], "v": same}``."""
    shape = (batch, max_len, config.n_kv_heads, config.head_dim)
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(config.n_layers)]


def cache_bytes(cache) -> int:
    """The bytes the cache's arrays hold."""
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(cache))


def _rms_norm(x, weight, eps: float):
    """RMSNorm computed in float32 (as Llama's reference does), returned in ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def _rope_tables(positions, head_dim: int, theta: float):
    """cos and sin ``[t, head_dim]`` for the half-split (``rotate_half``) rotary layout, float32."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x, cos, sin):
    """Rotary embedding of ``x[batch, t, ..., head_dim]``: the first half of head_dim pairs with the second."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    extra = (None,) * (x.ndim - 3)  # the head axes between t and head_dim
    cos, sin = cos[(None, slice(None), *extra)], sin[(None, slice(None), *extra)]
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def _attention(config: LlamaConfig, layer: dict, x, layer_cache: dict, position, cos, sin, visible):
    b, t, _ = x.shape
    kv, group, hd = config.n_kv_heads, config.group, config.head_dim
    with jax.named_scope("q"):
        q = (x @ layer["wq"]).reshape(b, t, kv, group, hd)
    with jax.named_scope("k"):
        k = (x @ layer["wk"]).reshape(b, t, kv, hd)
    with jax.named_scope("v"):
        v = (x @ layer["wv"]).reshape(b, t, kv, hd)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    start = (0, position, 0, 0)
    keys = lax.dynamic_update_slice(layer_cache["k"], k.astype(layer_cache["k"].dtype), start)
    values = lax.dynamic_update_slice(layer_cache["v"], v.astype(layer_cache["v"].dtype), start)
    with jax.named_scope("scores"):
        scores = jnp.einsum("btkgd,bskd->bkgts", q, keys.astype(q.dtype)) * (1.0 / np.sqrt(hd))
    scores = jnp.where(visible, scores.astype(jnp.float32), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    with jax.named_scope("context"):
        context = jnp.einsum("bkgts,bskd->btkgd", probs, values.astype(q.dtype)).reshape(b, t, kv * group * hd)
    with jax.named_scope("o"):
        out = context @ layer["wo"]
    return out, {"k": keys, "v": values}


def _mlp(layer: dict, x):
    with jax.named_scope("gate"):
        gate = x @ layer["w_gate"]
    with jax.named_scope("up"):
        up = x @ layer["w_up"]
    with jax.named_scope("down"):
        return (jax.nn.silu(gate) * up) @ layer["w_down"]


def forward(params: dict, tokens, cache: Sequence[dict], position):
    """Logits of ``tokens`` that follow the ``position`` tokens already in ``cache``, and the cache with them added.

    Arguments:
      params: :func:`params_of`'s pytree (float32 or bfloat16 arrays; ``quantize_params``' for ``int8ify(forward)``).
      tokens: int32 ``[batch, t]``: a prompt (prefill) or the last generated token (decode, t = 1).
      cache: :func:`init_cache`'s list, one ``{"k", "v"}`` per layer.
      position: the first token's position (an int32 scalar, traced: one compiled program serves every step).
        ``position + t`` must not exceed the cache's ``max_len`` (``lax.dynamic_update_slice`` would clamp the
        write); :func:`greedy_generate` checks it.

    Returns:
      ``(logits, cache)``: float32 ``[batch, t, vocab]``, and the cache with this call's keys and values written.
    """
    config: LlamaConfig = params["config"]
    _, t = tokens.shape
    max_len = cache[0]["k"].shape[1]
    if t > max_len:
        raise ValueError(f"{t} tokens do not fit a cache of max_len {max_len}")
    positions = position + jnp.arange(t, dtype=jnp.int32)
    cos, sin = _rope_tables(positions, config.head_dim, config.rope_theta)
    # a query sees the keys at its own position and before; the cache's unwritten slots all lie after the last query
    visible = jnp.arange(max_len, dtype=jnp.int32)[None, :] <= positions[:, None]
    x = jnp.take(params["embed"], tokens, axis=0)
    new_cache = []
    for i, (layer, layer_cache) in enumerate(zip(params["layers"], cache)):
        with jax.named_scope(f"layer_{i}"):
            with jax.named_scope("attention"):
                out, layer_cache = _attention(config, layer, _rms_norm(x, layer["attn_norm"], config.rms_eps),
                                              layer_cache, position, cos, sin, visible)
            x = x + out
            with jax.named_scope("mlp"):
                x = x + _mlp(layer, _rms_norm(x, layer["mlp_norm"], config.rms_eps))
        new_cache.append(layer_cache)
    x = _rms_norm(x, params["final_norm"], config.rms_eps)
    with jax.named_scope("lm_head"):
        logits = x @ (params["embed"].T if config.tie_embeddings else params["lm_head"])
    return logits.astype(jnp.float32), new_cache


def cast_params(params: dict, dtype) -> dict:
    """``params`` with every float array cast to ``dtype`` (bfloat16 inference: weights, activations and cache)."""
    return jax.tree_util.tree_map(lambda leaf: leaf.astype(dtype), params)


# ----------------------------------------------------------------------------------------------------------
# Generation and scoring
# ----------------------------------------------------------------------------------------------------------


def greedy_step(forward_fn: Callable) -> Callable:
    """``step(params, tokens, cache, position) -> (next_token [batch], cache)``: one call of ``forward_fn`` and the
    argmax of its last logits, so that only the chosen tokens leave the device. ``jax.jit`` it with
    ``donate_argnums=2`` so the cache is updated in place."""

    def step(params, tokens, cache, position):
        logits, cache = forward_fn(params, tokens, cache, position)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    return step


@dataclasses.dataclass
class Generation:
    """What :func:`greedy_generate` produced, and how long its two phases took."""

    tokens: list[int]  # the generated ids, without the prompt and without the stop token
    prefill_seconds: float  # the call over the whole prompt, up to its first new token on the host
    decode_seconds: float  # every later call, one token each
    decode_steps: int  # how many such calls


def greedy_generate(step: Callable, params, prompt: Sequence[int], cache, max_new_tokens: int,
                    stop_ids: Sequence[int] = ()) -> Generation:
    """Greedy decoding of one sequence: ``step`` (:func:`greedy_step`, jitted) once on the whole prompt, then once
    per new token, the cache passed back in each time.

    Arguments:
      step: ``step(params, tokens, cache, position) -> (next_token, cache)``.
      params: what ``step`` reads its weights from.
      prompt: the prompt's token ids.
      cache: an empty cache (:func:`init_cache`, batch 1) whose max_len holds the prompt and the new tokens.
      max_new_tokens: how many tokens to generate at most.
      stop_ids: tokens that end the answer (they are not returned).

    Returns:
      The :class:`Generation`; its times include compiling ``step`` on a first call.
    """
    max_len = cache[0]["k"].shape[1]
    if not prompt:
        raise ValueError("the prompt is empty: there is nothing to continue")
    if len(prompt) + max_new_tokens > max_len:
        raise ValueError(f"a prompt of {len(prompt)} tokens and {max_new_tokens} new ones do not fit a cache of "
                         f"max_len {max_len}")
    start = time.perf_counter()
    token, cache = step(params, jnp.asarray([prompt], jnp.int32), cache, jnp.int32(0))
    token = int(token[0])  # the host reads it: the call has finished
    prefill_end = time.perf_counter()
    generated, steps = [], 0
    for position in range(len(prompt), len(prompt) + max_new_tokens):
        if token in stop_ids:
            break
        generated.append(token)
        if len(generated) == max_new_tokens:
            break
        token, cache = step(params, jnp.asarray([[token]], jnp.int32), cache, jnp.int32(position))
        token = int(token[0])
        steps += 1
    return Generation(generated, prefill_end - start, time.perf_counter() - prefill_end, steps)


def score(forward_fn: Callable, params, tokens: Sequence[int], cache) -> np.ndarray:
    """The logits ``[len(tokens), vocab]`` (float32, on the host) of one forward pass over ``tokens`` from position 0
    of ``cache`` (empty, batch 1, max_len at least ``len(tokens)``): each position's prediction of the next token."""
    logits, _ = forward_fn(params, jnp.asarray([tokens], jnp.int32), cache, jnp.int32(0))
    return np.asarray(logits[0], np.float32)


def perplexity(logits: np.ndarray, tokens: Sequence[int]) -> float:
    """exp of the mean negative log-likelihood of ``tokens[1:]`` under ``logits[:-1]`` (float64 on the host)."""
    logits = np.asarray(logits[:-1], np.float64)
    targets = np.asarray(tokens[1:])
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return float(np.exp(-log_probs[np.arange(len(targets)), targets].mean()))


def top1_agreement(logits: np.ndarray, reference_logits: np.ndarray) -> float:
    """The fraction of positions whose most likely next token is the reference's."""
    return float(np.mean(np.argmax(logits, axis=-1) == np.argmax(reference_logits, axis=-1)))
