"""all-MiniLM-L6-v2 in pure JAX, float32 vs ``int8ify``: accuracy and speed report.

    python examples/minilm/run.py                                  # built-in sentences: full report + speed
    python examples/minilm/run.py --sentences S.json --out E.npz   # embed a JSON list of sentences

``--out`` writes an npz with ``float32`` and ``int8`` arrays of embeddings (N x 384) and the ``sentences``.
The report gives the per-sentence cosine of int8 vs float32, the Spearman correlation of the pairwise
similarity matrices (upper triangle), the nearest-neighbour agreement, and the speed of both encoders at
batch 32 and 128, sequence 128 (jit-compiled, same process, interleaved repeats, medians after warm-up).
The speed part runs by default only on the built-in sentences (``--bench`` / ``--no-bench`` override).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import model as minilm  # noqa: E402

try:
    from jaxpr_rewrite import int8ify, quantize_params
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(1, str(HERE.parents[1]))
    from jaxpr_rewrite import int8ify, quantize_params

SEQ_LEN = 128

# Calibration for the SmoothQuant factors: separate from the sentences the report evaluates.
CALIBRATION_SENTENCES = [
    "The committee will publish its findings next spring.",
    "Can you recommend a good book about the history of mathematics?",
    "Our flight was cancelled, so we took the night bus instead.",
    "Water boils at a lower temperature at high altitude.",
    "Please remember to water the plants while I am away.",
    "The orchestra rehearsed the symphony for three weeks.",
    "Yes.",
    "Good morning, everyone!",
    "Is this seat taken?",
    "The startup raised twenty million dollars in its latest funding round.",
    "Glaciers are retreating faster than scientists predicted.",
    "He fixed the leaking tap with a new washer.",
]

# Varied topics, with near-paraphrase pairs so that nearest neighbours and similarity rankings mean something.
BUILTIN_SENTENCES = [
    "A man is playing a guitar on stage.",
    "A musician performs a song on his guitar in front of a crowd.",
    "The cat is sleeping on the windowsill in the afternoon sun.",
    "A kitten naps by the sunny window.",
    "The stock market dropped sharply after the interest rate decision.",
    "Shares fell steeply once the central bank raised rates.",
    "How do I reset my password?",
    "I forgot my login credentials; how can I get back into my account?",
    "Plants turn sunlight into chemical energy through photosynthesis.",
    "Photosynthesis lets green plants convert light into stored energy.",
    "Add two cups of flour and a pinch of salt to the bowl.",
    "Mix the flour with a little salt before adding the eggs.",
    "The train to Boston was delayed by forty minutes.",
    "Our train to Boston arrived almost an hour late.",
    "She scored the winning goal in the final minute of the match.",
    "The striker won the game with a last-minute goal.",
    "The new phone has a larger battery and a better camera.",
    "This smartphone model improves battery life and photo quality.",
    "Heavy rain is expected across the region this weekend.",
    "Forecasters predict storms and downpours for Saturday and Sunday.",
    "The museum is closed on Mondays.",
    "You cannot visit the gallery on Monday; it is shut that day.",
    "He is learning to speak Japanese before his trip to Tokyo.",
    "Before travelling to Japan, he is studying the language.",
    "The doctor prescribed antibiotics for the infection.",
    "My physician gave me medication to treat the bacterial infection.",
    "Python lists are mutable, while tuples are immutable.",
    "In Python you can change a list but not a tuple.",
    "The spacecraft entered orbit around Mars after a seven-month journey.",
    "After months of travel, the probe reached Martian orbit.",
    "Please remember to water the plants while I'm away.",
    "Could you keep the garden watered during my holiday?",
    "The company reported record profits for the third quarter.",
    "Quarterly earnings hit an all-time high, the firm announced.",
    "Children were building sandcastles on the beach.",
    "Kids played in the sand by the sea, making castles.",
    "The bridge was closed for repairs after the earthquake.",
    "Engineers shut the damaged bridge following the quake.",
    "I prefer tea to coffee in the morning.",
    "In the mornings I'd rather drink tea than coffee.",
    "JAX compiles numerical Python functions with XLA.",
    "Matrix multiplication dominates the cost of transformer inference.",
    "The orchestra played Beethoven's ninth symphony.",
    "A volcano erupted on the remote island last night.",
    "Int8 quantization trades a little accuracy for speed.",
    "The library extended its opening hours during exams.",
    "Wolves hunt in packs across the frozen tundra.",
    "Please submit your expense report by Friday.",
    # Very short inputs: mean pooling over 3-5 tokens averages little of the quantization noise away.
    "Hello!",
    "Hi there!",
    "Thanks a lot.",
    "Thank you very much.",
]


# ----------------------------------------------------------------------------------------------------------
# Metrics (numpy only)
# ----------------------------------------------------------------------------------------------------------


def row_cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-30)


def _rank(x: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1, ties sharing their average rank."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), np.float64)
    ranks[order] = np.arange(len(x), dtype=np.float64)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    if np.any(counts > 1):
        sums = np.bincount(inverse, weights=ranks)
        ranks = sums[inverse] / counts[inverse]
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation: the Pearson correlation of the ranks."""
    rx, ry = _rank(np.ravel(x)), _rank(np.ravel(y))
    rx -= rx.mean()
    ry -= ry.mean()
    return float(np.sum(rx * ry) / np.sqrt(np.sum(rx * rx) * np.sum(ry * ry)))


def similarity_report(f32: np.ndarray, i8: np.ndarray) -> dict:
    """Spearman of the pairwise cosine similarities (upper triangle) and top-1 neighbour agreement."""
    def sims(e):
        e = np.asarray(e, np.float64)
        e = e / np.linalg.norm(e, axis=1, keepdims=True)
        return e @ e.T

    sf, si = sims(f32), sims(i8)
    iu = np.triu_indices(len(f32), k=1)
    np.fill_diagonal(sf, -np.inf)
    np.fill_diagonal(si, -np.inf)
    nn_f, nn_i = np.argmax(sf, axis=1), np.argmax(si, axis=1)
    return {
        "spearman": spearman(sf[iu], si[iu]),
        "nn_agreement": float(np.mean(nn_f == nn_i)),
        "nn_float": nn_f,
        "nn_int8": nn_i,
    }


def count_dots(fn, *args) -> dict:
    """How many dot_generals the traced program has, by operand dtype (walks sub-jaxprs)."""
    counts: dict = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                key = "x".join(str(v.aval.dtype) for v in eqn.invars)
                counts[key] = counts.get(key, 0) + 1
            for sub in _subs(eqn):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return counts


def _subs(eqn):
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "jaxpr") and hasattr(v, "consts"):  # ClosedJaxpr
                yield v.jaxpr
            elif hasattr(v, "eqns"):  # Jaxpr
                yield v


# ----------------------------------------------------------------------------------------------------------
# Speed
# ----------------------------------------------------------------------------------------------------------


def bench(fns: dict, params, tokenizer, sentences, batch: int, repeats: int, warmup: int = 1) -> dict:
    """Median wall time (ms) of each jit-compiled fn at (batch, SEQ_LEN); runs are interleaved."""
    tiled = [sentences[i % len(sentences)] for i in range(batch)]
    ids, mask = minilm.tokenize(tokenizer, tiled, SEQ_LEN)
    ids, mask = jax.device_put(ids), jax.device_put(mask)
    times = {name: [] for name in fns}
    compile_s = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(params, ids, mask))
        compile_s[name] = time.perf_counter() - t0
        for _ in range(warmup):
            jax.block_until_ready(fn(params, ids, mask))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, ids, mask))
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * float(np.median(t)) for name, t in times.items()} | {"first_call_s": compile_s}


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=Path, help="JSON file holding a list of sentences")
    ap.add_argument("--out", type=Path, help="write float32/int8 embeddings to this .npz")
    ap.add_argument("--batch-size", type=int, default=32, help="batch size for embedding (default 32)")
    ap.add_argument("--bench", dest="bench", action="store_true", default=None, help="run the speed part")
    ap.add_argument("--no-bench", dest="bench", action="store_false", help="skip the speed part")
    ap.add_argument("--bench-batches", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per encoder and batch (default 5)")
    ap.add_argument("--smooth-alpha", type=float, default=0.5,
                    help="SmoothQuant migration strength for quantize_params, calibrated on sentences apart "
                         "from the evaluated ones (default 0.5; a negative value turns smoothing off)")
    ap.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                    help="keep dots whose name scope matches this fnmatch pattern in float32, e.g. "
                         "'*attention/value' (int8ify's skip option; repeatable)")
    args = ap.parse_args(argv)

    if args.sentences is not None:
        sentences = json.loads(args.sentences.read_text(encoding="utf-8"))
        if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
            ap.error("--sentences must hold a JSON list of strings")
    else:
        sentences = list(BUILTIN_SENTENCES)
    run_bench = args.bench if args.bench is not None else args.sentences is None

    params = minilm.load_params()
    tokenizer = minilm.load_tokenizer()
    f32_fn = jax.jit(minilm.encode)
    int8_encode = int8ify(minilm.encode, skip=tuple(args.skip)) if args.skip else int8ify(minilm.encode)
    # Weights quantized once (with SmoothQuant factors unless turned off); every call then quantizes
    # only the activations.
    calibration = minilm.tokenize(tokenizer, CALIBRATION_SENTENCES, SEQ_LEN)
    alpha = args.smooth_alpha if args.smooth_alpha >= 0 else None
    # Only the dots fed by a LayerNorm are smoothed: their outlier channels are what hurts; smoothing the
    # two output projections too measured slower (XLA then materializes their scaled inputs) and no
    # more accurate.
    qparams = quantize_params(int8_encode, params, *calibration, smooth_alpha=alpha, smooth_skip=("*/output",))
    int8_jit = jax.jit(int8_encode)

    def int8_fn(_float_params, ids, mask):
        return int8_jit(qparams, ids, mask)

    if not sentences:
        f32 = i8 = np.zeros((0, minilm.HIDDEN), np.float32)
    else:
        f32 = minilm.embed(f32_fn, params, tokenizer, sentences, args.batch_size, SEQ_LEN)
        i8 = minilm.embed(int8_fn, params, tokenizer, sentences, args.batch_size, SEQ_LEN)
    if args.out is not None:
        np.savez(args.out, float32=f32, int8=i8, sentences=np.asarray(sentences, dtype=str))
        print(f"wrote {args.out}: float32 {f32.shape}, int8 {i8.shape}")
    if len(sentences) == 0:
        return 0

    kept = f", kept in float32: {', '.join(args.skip)}" if args.skip else ""
    kept += f", SmoothQuant alpha {alpha}" if alpha is not None else ", no smoothing"
    print(f"all-MiniLM-L6-v2, {len(sentences)} sentences, padded to {SEQ_LEN} tokens{kept}")
    nbytes = lambda tree: sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree))  # noqa: E731
    print(f"parameters: float32 {nbytes(params) / 2**20:.1f} MiB, with int8 weights "
          f"{nbytes(qparams) / 2**20:.1f} MiB ({nbytes(qparams) / nbytes(params):.2f}x)")
    ids, mask = minilm.tokenize(tokenizer, sentences[:2], SEQ_LEN)
    dots = count_dots(int8_encode, params, ids, mask)
    print("dot_generals in the int8ify'd program: " + ", ".join(f"{n} {k}" for k, n in sorted(dots.items())))

    cos = row_cosine(f32, i8)
    print(f"\ncosine(int8, float32) per sentence: mean {cos.mean():.5f}  min {cos.min():.5f}  "
          f"median {np.median(cos):.5f}")
    order = np.argsort(cos)
    shown = order[: min(8, len(order))]
    print("  lowest:")
    for i in shown:
        text = sentences[i] if len(sentences[i]) <= 60 else sentences[i][:57] + "..."
        print(f"    {cos[i]:.5f}  {text!r}")
    if len(sentences) >= 2:
        sim = similarity_report(f32, i8)
        n = len(sentences)
        print(f"similarity matrix Spearman (int8 vs float32, {n * (n - 1) // 2} pairs): {sim['spearman']:.5f}")
        agree = int(round(sim["nn_agreement"] * n))
        print(f"nearest-neighbour agreement: {sim['nn_agreement']:.3f} ({agree}/{n})")

    if run_bench:
        print(f"\nspeed (jit, sequence {SEQ_LEN}, median of {args.repeats} interleaved runs after warm-up, "
              f"{jax.devices()[0].platform}):")
        print(f"  {'batch':>5}  {'float32 ms':>10}  {'int8 ms':>9}  {'float32/int8':>12}")
        for batch in args.bench_batches:
            r = bench({"float32": f32_fn, "int8": int8_fn}, params, tokenizer, sentences, batch, args.repeats)
            print(f"  {batch:>5}  {r['float32']:>10.1f}  {r['int8']:>9.1f}  {r['float32'] / r['int8']:>11.2f}x"
                  f"   (first call: float32 {r['first_call_s']['float32']:.1f} s, "
                  f"int8 {r['first_call_s']['int8']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
