"""How int8ify's choices move SmolLM2-135M-Instruct's next-token predictions: the investigation behind
``run.py``'s recipe (:func:`run.int8_recipe`).

    python examples/llm/accuracy.py          # about 20 variants, a compile each: 5-15 minutes on 2 cores

Every variant is scored on the built-in evaluation passage (``llm_texts.EVALUATION_PASSAGE``, 514 tokens): its
perplexity, the change against float32's, and the fraction of positions whose most likely next token is float32's.
Smoothing factors and the per-dot errors that choose what to skip are measured on the calibration text
(``llm_texts.CALIBRATION_TEXT``), never on the passage. The variants:

* the float references (float32, bfloat16);
* int8ify with ``quantize_params`` as it comes (the tied embedding's head quantized on every call), with the LM
  head in float32 (``skip``), and with the head in int8 from an untied copy of the embedding (quantized once);
* each kind of matmul alone in int8 (the rest float32): its share of the loss;
* SmoothQuant (``smooth_alpha``) at 0.3, 0.5 and 0.7, with the head float or int8;
* SmoothQuant 0.5 with the kinds that lose most kept float32, and with the dots ``report`` finds worst on the
  calibration text kept float32.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_weights  # noqa: E402
import llama  # noqa: E402
import llm_texts  # noqa: E402
import run  # noqa: E402  (which also finds jaxpr_rewrite in a checkout that is not pip-installed)

from jaxpr_rewrite import QuantizationWarning, int8ify, quantize_params, report  # noqa: E402

# each kind of matmul by its name scopes (llama.forward's); the einsums' scopes end in their equation
KINDS = {
    "q/k/v": ("*attention/q", "*attention/k", "*attention/v"),
    "attention einsums": ("*attention/scores*", "*attention/context*"),
    "o": ("*attention/o",),
    "gate/up": ("*mlp/gate", "*mlp/up"),
    "down": ("*mlp/down",),
    "lm_head": ("lm_head",),
}
# how many dots report's largest errors on the calibration text keep in float32
WORST_DOTS = 8
# report measures every dot on this many calibration tokens (the whole text takes minutes)
REPORT_TOKENS = 128


def untied(params: dict) -> dict:
    """``params`` with the LM head as its own array, a transposed copy of the embedding: ``quantize_params`` then
    stores the head's int8 codes once, while the embedding lookup reads the float table."""
    return dict(params, config=dataclasses.replace(params["config"], tie_embeddings=False),
                lm_head=jnp.asarray(params["embed"]).T.copy())


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One int8ify variant: what stays float32, SmoothQuant's alpha, and whether the head gets its own weight."""

    name: str
    skip: tuple = ()
    smooth_alpha: float | None = None
    int8_head: bool = False  # via untied(): the head's matmul in int8 with its codes stored once


def build(recipe: Recipe, params: dict, calibration: list[int]):
    """``(forward, qparams)`` of ``recipe``, its weights quantized on the calibration tokens."""
    params = untied(params) if recipe.int8_head else params
    forward = int8ify(llama.forward, skip=list(recipe.skip)) if recipe.skip else int8ify(llama.forward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", QuantizationWarning)  # the tied embedding, which the gather reads, stays float
        qparams = quantize_params(forward, params, jnp.asarray([calibration], jnp.int32),
                                  llama.init_cache(params["config"], 1, len(calibration)), jnp.int32(0),
                                  smooth_alpha=recipe.smooth_alpha)
    return forward, qparams


def worst_dots(params: dict, calibration: list[int], count: int) -> tuple[str, ...]:
    """The scopes of the ``count`` dots with the largest int8 error (``report``) on the calibration text, with the
    recipe's smoothing and the head float."""
    forward, qparams = build(Recipe("", skip=KINDS["lm_head"], smooth_alpha=run.SMOOTH_ALPHA), params, calibration)
    tokens = calibration[:REPORT_TOKENS]
    rows = report(forward, qparams, jnp.asarray([tokens], jnp.int32),
                  llama.init_cache(params["config"], 1, len(tokens)), jnp.int32(0)).rows
    measured = sorted((row for row in rows if row.error is not None), key=lambda row: row.error, reverse=True)
    return tuple(row.scope for row in measured[:count])


def _patterns_except(kind: str) -> tuple[str, ...]:
    """The scope patterns of every kind of matmul but ``kind``."""
    return tuple(pattern for other, patterns in KINDS.items() if other != kind for pattern in patterns)


def recipes(worst: tuple[str, ...]) -> list[Recipe]:
    head = KINDS["lm_head"]
    alone = [Recipe(f"only {kind} in int8", skip=_patterns_except(kind), int8_head=kind == "lm_head") for kind in KINDS]
    alpha = run.SMOOTH_ALPHA
    return [
        Recipe("int8ify, every dot (head quantized per call)"),
        Recipe("int8ify, head float32", skip=head),
        Recipe("int8ify, head int8 (untied copy)", int8_head=True),
        *alone,
        Recipe("smooth 0.3, head float32", skip=head, smooth_alpha=0.3),
        Recipe(f"smooth {alpha}, head float32 (run.py)", skip=head, smooth_alpha=alpha),
        Recipe("smooth 0.7, head float32", skip=head, smooth_alpha=0.7),
        Recipe(f"smooth {alpha}, head int8 (untied copy)", smooth_alpha=alpha, int8_head=True),
        Recipe(f"smooth {alpha}, head + v float32", skip=head + ("*attention/v",), smooth_alpha=alpha),
        Recipe(f"smooth {alpha}, head + down float32", skip=head + KINDS["down"], smooth_alpha=alpha),
        Recipe(f"smooth {alpha}, head + {len(worst)} worst dots float32", skip=head + worst, smooth_alpha=alpha),
    ]


def main() -> int:
    progress = run.Progress()
    progress("reading the GGUF file")
    reader = gguf_weights.open_gguf()
    params, tokenizer = gguf_weights.load_params(reader), gguf_weights.load_tokenizer(reader)
    passage = run.passage_tokens(tokenizer)
    calibration = tokenizer.encode(llm_texts.CALIBRATION_TEXT).ids
    progress(f"measuring every dot's int8 error on {REPORT_TOKENS} calibration tokens (report)")
    worst = worst_dots(params, calibration, WORST_DOTS)
    print(f"  the {len(worst)} worst: {', '.join(worst)}", flush=True)

    rows = []
    for name, variant in (("float32", run.Variant("float32", llama.forward, params)),
                          ("bfloat16", run.Variant("bfloat16", llama.forward,
                                                   llama.cast_params(params, jnp.bfloat16), jnp.bfloat16))):
        progress(f"scoring {name}")
        rows.append((name, llama.score(variant.score_fn, variant.params, passage,
                                       variant.empty_cache(len(passage)))))
    reference = rows[0][1]
    print(f"\n  {'variant':<48}  {'perplexity':>10}  {'vs float32':>10}  {'top-1 agree':>11}", flush=True)

    def print_row(name, logits):
        ppl = llama.perplexity(logits, passage)
        print(f"  {name:<48}  {ppl:10.3f}  {100 * (ppl / llama.perplexity(reference, passage) - 1):+9.2f}%  "
              f"{llama.top1_agreement(logits, reference):11.3f}", flush=True)

    for name, logits in rows:
        print_row(name, logits)
    for recipe in recipes(worst):
        forward, qparams = build(recipe, params, calibration)
        cache = llama.init_cache(qparams["config"], 1, len(passage))
        logits = llama.score(jax.jit(forward), qparams, passage, cache)
        print_row(recipe.name, logits)
    progress("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
