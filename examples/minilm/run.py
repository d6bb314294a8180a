"""all-MiniLM-L6-v2 in pure JAX, float32 vs ``int8ify``: accuracy and speed report.

    python examples/minilm/run.py                                  # built-in sentences: full report + speed
    python examples/minilm/run.py --sentences S.json --out E.npz   # embed a JSON list of sentences
    python examples/minilm/run.py --plot report.png --no-bench     # accuracy only, figure written elsewhere

``--out`` writes an npz with ``float32`` and ``int8`` arrays of embeddings (N x 384) and the ``sentences``
(``.npz`` is appended to a name without it, as numpy does). The report gives the per-sentence cosine of int8 vs
float32, the Spearman correlation of the pairwise similarity matrices (upper triangle), the nearest-neighbour
agreement, the int8 error of each encoder layer, and the speed of both encoders at batch 32 and 128 on a fixed
sequence of 128 tokens (jit-compiled, same process, interleaved repeats, medians after warm-up). The speed part
runs by default only on the built-in sentences (``--bench`` / ``--no-bench`` override).

Sentences are cut at the model's limit of 256 tokens (a warning on stderr names each one that is cut); each
batch is padded only to its longest sentence, rounded up to a multiple of 16 tokens so that batches of similar
lengths share one compilation (the speed part alone keeps its fixed 128). The cosine histogram and the
per-layer errors are drawn to ``minilm_report.png`` in the current directory (``--plot PATH`` / ``--no-plot``;
needs matplotlib).

Progress lines on stdout carry the seconds since the start. Exit status: 0 on success, 2 for a usage error
(found before any model work), 1 when the embeddings or the figure could not be written where asked (the
embeddings are then saved to a fallback path, which the run names).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import model as minilm  # noqa: E402

try:
    from jaxpr_rewrite import (calibrate_activation_dots, default_platform, dot_eqns, int8ify, quantize_params,
                               report)
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(1, str(HERE.parents[1]))
    from jaxpr_rewrite import (calibrate_activation_dots, default_platform, dot_eqns, int8ify, quantize_params,
                               report)

# The speed benchmark times fixed shapes: every batch padded (or cut) to this many tokens.
BENCH_SEQ_LEN = 128
# The per-layer error report runs the float program once more with every dot also computed in int8; a few
# sentences show the pattern at a fraction of the cost.
LAYER_REPORT_SENTENCES = 8
# The percentile of |x| the --static-scales run also calibrates on: the rarest outliers saturate, every other value
# gets a finer scale (99.99 measured best on this model; 99.9 clips too much).
STATIC_PERCENTILE = 99.99
# Below three sentences a similarity ranking has at most one pair and every nearest neighbour is forced.
MIN_SENTENCES_FOR_SIMILARITY = 3
DEFAULT_PLOT = Path("minilm_report.png")
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
PLOT_INSTALL_HINT = "plotting needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)"

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
# Input and output paths (checked before any model work)
# ----------------------------------------------------------------------------------------------------------


def read_sentences(path: Path) -> list[str]:
    """The JSON list of strings in ``path``; raises ``ValueError`` with one sentence saying what is wrong."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"--sentences file {path} does not exist") from None
    except OSError as error:
        raise ValueError(f"cannot read --sentences file {path}: {error.strerror or error}") from None
    try:
        text = data.decode("utf-8-sig")  # tolerates the byte-order mark some editors write
    except UnicodeDecodeError as error:
        raise ValueError(f"--sentences file {path} is not UTF-8 text (byte 0x{data[error.start]:02x} at "
                         f"offset {error.start})") from None
    if not text.strip():
        raise ValueError(f'--sentences file {path} is empty; it should hold a JSON list of strings, e.g. '
                         f'["first sentence", "second sentence"]')
    try:
        sentences = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--sentences file {path} is not valid JSON: {error.msg} at line {error.lineno} "
                         f"column {error.colno}") from None
    if not isinstance(sentences, list):
        raise ValueError(f"--sentences file {path} holds a JSON {type(sentences).__name__}, not a list of strings")
    for index, item in enumerate(sentences):
        if not isinstance(item, str):
            raise ValueError(f"--sentences file {path}: item {index} is a JSON {type(item).__name__}, "
                             f"not a string")
    if not sentences:
        raise ValueError(f"--sentences file {path} holds an empty list: nothing to embed")
    return sentences


def npz_path(path: Path) -> Path:
    """The file ``np.savez`` actually writes for ``path``: it appends ``.npz`` to a name without it."""
    return path if path.name.endswith(".npz") else path.with_name(path.name + ".npz")


def output_path_problem(path: Path) -> str | None:
    """Why ``--out path`` cannot be written (one sentence), or ``None``."""
    if path.is_dir():
        return f"--out {path} is a directory; give a file name such as {path / 'embeddings.npz'}"
    parent = path.parent
    if not parent.is_dir():
        return f"--out {path}: directory {parent} does not exist"
    return None


def plot_path_problem(path: Path) -> str | None:
    """Why ``--plot path`` cannot be drawn (one sentence), or ``None``; a missing folder is created."""
    if path.is_dir():
        return f"--plot {path} is a directory; give a file name such as {path / DEFAULT_PLOT.name}"
    if path.suffix.lower() not in PLOT_SUFFIXES:
        return f"--plot {path}: the name must end in {', '.join(PLOT_SUFFIXES)} (the suffix picks the format)"
    return None


def save_embeddings(path: Path, f32: np.ndarray, i8: np.ndarray, sentences: list[str]) -> None:
    """Write the npz of ``--out`` (raises ``OSError`` when it cannot)."""
    np.savez(path, float32=f32, int8=i8, sentences=np.asarray(sentences, dtype=str))


def save_with_fallback(path: Path, f32: np.ndarray, i8: np.ndarray, sentences: list[str]) -> Path | None:
    """Save to ``path``; if that fails, say why and save under the same name in the current directory (or the
    temporary directory), never over an existing file, so that finished work is not lost.

    Returns where the embeddings went (``None`` if nowhere could be written).
    """
    try:
        save_embeddings(path, f32, i8, sentences)
        return path
    except OSError as error:
        print(f"error: could not write {path}: {error.strerror or error}", file=sys.stderr, flush=True)
    for directory in _fallback_directories():
        fallback = _unused_path(directory / path.name)
        try:
            save_embeddings(fallback, f32, i8, sentences)
        except OSError as error:
            print(f"error: could not write {fallback} either: {error.strerror or error}", file=sys.stderr,
                  flush=True)
            continue
        print(f"saved the embeddings to {fallback} instead", file=sys.stderr, flush=True)
        return fallback
    return None


def _fallback_directories() -> list[Path]:
    try:
        directories = [Path.cwd()]
    except FileNotFoundError:  # the working directory itself was removed
        directories = []
    return directories + [Path(tempfile.gettempdir())]


def _unused_path(path: Path) -> Path:
    """``path``, or ``name-1.npz``, ``name-2.npz``, ... beside it: the first that does not exist."""
    candidate, number = path, 0
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name.removesuffix('.npz')}-{number}.npz")
    return candidate


def matplotlib_available() -> bool:
    """Whether the figure can be drawn (matplotlib is an optional dependency)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------------------------------------
# Progress
# ----------------------------------------------------------------------------------------------------------


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 'es' if noun.endswith('h') else 's'}"


class Progress:
    """Stage lines on stdout with the seconds since the run started, flushed at once so a long run shows where
    it is."""

    def __init__(self):
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {message}", flush=True)

    def batches(self, label: str, interval_s: float = 10.0):
        """An ``on_batch(done, total)`` callback for :func:`model.embed` that reports at most every
        ``interval_s`` seconds (a large input then shows it is moving without a line per batch)."""
        last_report = self.elapsed()

        def on_batch(done: int, total: int) -> None:
            nonlocal last_report
            if done < total and self.elapsed() - last_report >= interval_s:
                last_report = self.elapsed()
                self(f"  {label}: {done}/{total} sentences")

        return on_batch


# ----------------------------------------------------------------------------------------------------------
# Metrics (numpy only)
# ----------------------------------------------------------------------------------------------------------


def row_cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row of ``a`` with the same row of ``b``."""
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


def accuracy_lines(sentences: list[str], f32: np.ndarray, i8: np.ndarray) -> list[str]:
    """The accuracy part of the report: per-sentence cosines (the lowest listed), similarity ranking and
    nearest neighbours (``n/a`` below :data:`MIN_SENTENCES_FOR_SIMILARITY` sentences)."""
    cos = row_cosine(f32, i8)
    lines = [f"cosine(int8, float32) per sentence: mean {cos.mean():.5f}  min {cos.min():.5f}  "
             f"median {np.median(cos):.5f}", "  lowest:"]
    for i in np.argsort(cos)[:8]:
        text = sentences[i] if len(sentences[i]) <= 60 else sentences[i][:57] + "..."
        lines.append(f"    {cos[i]:.5f}  {text!r}")
    n = len(sentences)
    if n < MIN_SENTENCES_FOR_SIMILARITY:
        unavailable = f"n/a (needs at least {MIN_SENTENCES_FOR_SIMILARITY} sentences)"
        lines.append(f"similarity matrix Spearman (int8 vs float32): {unavailable}")
        lines.append(f"nearest-neighbour agreement: {unavailable}")
        return lines
    sim = similarity_report(f32, i8)
    lines.append(f"similarity matrix Spearman (int8 vs float32, {n * (n - 1) // 2} pairs): {sim['spearman']:.5f}")
    agree = int(round(sim["nn_agreement"] * n))
    lines.append(f"nearest-neighbour agreement: {sim['nn_agreement']:.3f} ({agree}/{n})")
    return lines


def static_accuracy_lines(sentences: list[str], f32: np.ndarray, embedded: dict) -> list[str]:
    """Dynamic and static activation scales side by side: per variant, mean/min cosine against float32 and, with
    enough sentences, the nearest-neighbour agreement."""
    lines = ["activation scales (cosine of int8 vs float32 embeddings):"]
    for label, i8 in embedded.items():
        cos = row_cosine(f32, i8)
        line = f"  {label:<42} mean {cos.mean():.5f}  min {cos.min():.5f}"
        if len(sentences) >= MIN_SENTENCES_FOR_SIMILARITY:
            agree = int(round(similarity_report(f32, i8)["nn_agreement"] * len(sentences)))
            line += f"  nearest neighbours {agree}/{len(sentences)}"
        lines.append(line)
    return lines


# ----------------------------------------------------------------------------------------------------------
# Per-layer int8 error
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerError:
    """The int8 error of one encoder layer: ``rms`` is the root-mean-square of the measured relative errors of
    its ``dots`` int8 dots; ``worst_scope`` / ``worst_error`` name its largest one."""

    layer: str
    rms: float
    dots: int
    worst_scope: str
    worst_error: float


def layer_errors(rows) -> list[LayerError]:
    """Group the rewritten, measured rows of a :func:`jaxpr_rewrite._inspect.report` by encoder layer (the ``layer_i``
    name scope), in layer order. Dots kept in float (``--skip``) cost nothing and are left out."""
    by_layer: dict[str, list] = {}
    for row in rows:
        layer = row.scope.split("/")[0]
        if row.rewritten and row.error is not None and layer.startswith("layer_"):
            by_layer.setdefault(layer, []).append(row)
    result = []
    for layer in sorted(by_layer, key=lambda name: int(name.removeprefix("layer_"))):
        errors = np.asarray([row.error for row in by_layer[layer]], np.float64)
        worst = max(by_layer[layer], key=lambda row: row.error)
        result.append(LayerError(layer, float(np.sqrt(np.mean(errors ** 2))), len(errors),
                                 worst.scope.removeprefix(layer + "/"), worst.error))
    return result


def layer_error_lines(layers: list[LayerError], n_sentences: int) -> list[str]:
    """The per-layer errors as a short table."""
    lines = [f"int8 error per encoder layer (relative error of each dot vs float32 on "
             f"{_plural(n_sentences, 'sentence')}, RMS over the layer):",
             f"  {'layer':<8}  {'RMS':>8}  {'dots':>4}  largest"]
    for entry in layers:
        lines.append(f"  {entry.layer:<8}  {entry.rms:>8.2e}  {entry.dots:>4}  "
                     f"{entry.worst_error:.2e} {entry.worst_scope}")
    return lines


# ----------------------------------------------------------------------------------------------------------
# Figure
# ----------------------------------------------------------------------------------------------------------


def histogram_bins(n: int) -> int:
    """Enough bins to show the shape of ``n`` cosines without leaving most of them empty."""
    return max(1, min(30, n))


def plot_report(cosines: np.ndarray, layers: list[LayerError], title: str):
    """The report's figure: the per-sentence cosine histogram (mean and min marked) and the per-layer RMS
    int8 error as bars. Returns the matplotlib ``Figure``."""
    from jaxpr_rewrite._inspect.plotting import COLORS, bar_chart, new_figure

    fig, (hist_ax, layer_ax) = new_figure(1, 2, width=11.0, height=4.2)
    hist_ax.hist(cosines, bins=histogram_bins(len(cosines)), color=COLORS["rewritten"])
    hist_ax.axvline(float(np.mean(cosines)), color="black", linestyle="--", label=f"mean {np.mean(cosines):.5f}")
    hist_ax.axvline(float(np.min(cosines)), color=COLORS["kept"], linestyle=":", linewidth=2,
                    label=f"min {np.min(cosines):.5f}")
    hist_ax.set_title(f"cosine(int8, float32) of {len(cosines)} sentence embeddings", fontsize=9)
    hist_ax.set_xlabel("cosine")
    hist_ax.set_ylabel("sentences")
    hist_ax.legend(fontsize=8)
    bar_chart(layer_ax, [entry.layer for entry in layers], [entry.rms for entry in layers],
              title="int8 error per encoder layer (RMS of its dots' relative errors)",
              ylabel="relative error vs float32")
    fig.suptitle(title, fontsize=10)
    return fig


# ----------------------------------------------------------------------------------------------------------
# Speed
# ----------------------------------------------------------------------------------------------------------


def bench(fns: dict, params, tokenizer, sentences, batch: int, repeats: int, warmup: int = 1) -> dict:
    """Median wall time (ms) of each jit-compiled fn at (batch, BENCH_SEQ_LEN); runs are interleaved."""
    tiled = [sentences[i % len(sentences)] for i in range(batch)]
    ids, mask = minilm.tokenize(tokenizer, tiled, BENCH_SEQ_LEN)
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sentences", type=Path, help="UTF-8 JSON file holding a list of sentences")
    ap.add_argument("--out", type=Path, help="write float32/int8 embeddings to this .npz")
    ap.add_argument("--batch-size", type=int, default=32, help="batch size for embedding (default 32)")
    ap.add_argument("--plot", type=Path, default=DEFAULT_PLOT,
                    help=f"where to draw the report's figure (PNG, SVG or PDF by suffix; default {DEFAULT_PLOT})")
    ap.add_argument("--no-plot", dest="plot", action="store_const", const=None, help="draw no figure")
    ap.add_argument("--bench", dest="bench", action="store_true", default=None, help="run the speed part")
    ap.add_argument("--no-bench", dest="bench", action="store_false", help="skip the speed part")
    ap.add_argument("--bench-batches", type=int, nargs="+", default=[32, 128],
                    help=f"batch sizes the speed part times, each at {BENCH_SEQ_LEN} tokens (default 32 128)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per encoder and batch (default 5)")
    ap.add_argument("--smooth-alpha", type=float, default=0.5,
                    help="SmoothQuant migration strength (at most 1) for quantize_params, calibrated on sentences "
                         "apart from the evaluated ones (default 0.5; a negative value turns smoothing off)")
    ap.add_argument("--static-scales", action="store_true",
                    help="also embed with static activation scales (quantize_params(activations='static'), "
                         f"calibrated on the calibration sentences by absmax and by the {STATIC_PERCENTILE}th "
                         "percentile), then with the attention einsums' activations static too "
                         "(calibrate_activation_dots), and print their accuracy beside the dynamic one; the speed "
                         "part then times the absmax ones too")
    ap.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                    help="keep dots whose name scope matches this fnmatch pattern in float32, e.g. "
                         "'*attention/value' (int8ify's skip option; repeatable)")
    return ap


@dataclass
class Inputs:
    """What a run works on, once the command line has been checked."""

    sentences: list[str]
    out_path: Path | None  # the file np.savez writes (``.npz`` appended when missing)
    plot_path: Path | None  # None: no figure (--no-plot, or matplotlib missing)
    run_bench: bool
    smooth_alpha: float | None


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Inputs:
    """Every usage error, found before the model is loaded: ``parser.error`` prints it and exits with 2."""
    if args.batch_size <= 0:
        parser.error(f"--batch-size must be positive, got {args.batch_size}")
    if args.repeats <= 0:
        parser.error(f"--repeats must be positive, got {args.repeats}")
    if any(batch <= 0 for batch in args.bench_batches):
        parser.error(f"--bench-batches must be positive, got {' '.join(map(str, args.bench_batches))}")
    if args.smooth_alpha > 1:
        parser.error(f"--smooth-alpha must be at most 1, got {args.smooth_alpha}")
    sentences = list(BUILTIN_SENTENCES)
    if args.sentences is not None:
        try:
            sentences = read_sentences(args.sentences)
        except ValueError as error:
            parser.error(str(error))
    out_path = npz_path(args.out) if args.out is not None else None
    if out_path is not None and (problem := output_path_problem(out_path)) is not None:
        parser.error(problem)
    plot_path = args.plot
    if plot_path is not None and (problem := plot_path_problem(plot_path)) is not None:
        parser.error(problem)
    if plot_path is not None and not matplotlib_available():
        print(f"no figure: {PLOT_INSTALL_HINT}; continuing without it", file=sys.stderr, flush=True)
        plot_path = None
    return Inputs(
        sentences=sentences,
        out_path=out_path,
        plot_path=plot_path,
        run_bench=args.bench if args.bench is not None else args.sentences is None,
        smooth_alpha=args.smooth_alpha if args.smooth_alpha >= 0 else None,
    )


def warn_truncated(counts: np.ndarray) -> None:
    """One line on stderr per sentence longer than the model's limit, naming its index and token count."""
    for index in np.flatnonzero(counts > minilm.MAX_LENGTH):
        print(f"warning: sentences[{index}] has {counts[index]} tokens, more than the model's limit of "
              f"{minilm.MAX_LENGTH}: only its first {minilm.MAX_LENGTH} are embedded", file=sys.stderr, flush=True)


def write_figure(path: Path, cosines: np.ndarray, layers: list[LayerError], title: str) -> bool:
    """Draw :func:`plot_report` to ``path``; on failure say why and return False (the report is already out)."""
    import matplotlib.pyplot as plt

    from jaxpr_rewrite._inspect.plotting import save

    fig = plot_report(cosines, layers, title)
    try:
        save(fig, path)
    except OSError as error:
        print(f"error: could not write the figure {path}: {error.strerror or error}", file=sys.stderr, flush=True)
        return False
    finally:
        plt.close(fig)
    return True


def speed_report(progress: Progress, encoders: dict, params, tokenizer, sentences: list[str], batches: list[int],
                 repeats: int) -> None:
    """Print the speed table, one row per batch size as soon as it is measured: each encoder after ``float32``
    gets its time and its speed-up over float32."""
    print(f"\nspeed (jit, every batch padded to a fixed sequence of {BENCH_SEQ_LEN} tokens, median of "
          f"{repeats} interleaved runs after warm-up, {jax.devices()[0].platform}):")
    widths = {name: (max(9, len(name) + 3), max(12, len(name) + 8)) for name in encoders if name != "float32"}
    headers = "".join(f"  {name + ' ms':>{w}}  {'float32/' + name:>{ratio}}" for name, (w, ratio) in widths.items())
    print(f"  {'batch':>5}  {'float32 ms':>10}{headers}", flush=True)
    for batch in batches:
        progress(f"timing batch {batch}: first calls compile, then {repeats} interleaved runs each")
        r = bench(encoders, params, tokenizer, sentences, batch, repeats)
        columns = "".join(f"  {r[name]:>{w}.1f}  {r['float32'] / r[name]:>{ratio - 1}.2f}x"
                          for name, (w, ratio) in widths.items())
        first = ", ".join(f"{name} {s:.1f} s" for name, s in r["first_call_s"].items())
        print(f"  {batch:>5}  {r['float32']:>10.1f}{columns}   (first call: {first})", flush=True)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    inputs = check_arguments(parser, args)
    sentences, alpha = inputs.sentences, inputs.smooth_alpha
    failed_writes = 0

    progress = Progress()
    progress("loading weights and tokenizer")
    params = minilm.load_params()
    tokenizer = minilm.load_tokenizer()
    counts = minilm.token_counts(tokenizer, sentences)
    warn_truncated(counts)

    progress(f"quantizing weights ({'SmoothQuant alpha ' + str(alpha) if alpha is not None else 'no smoothing'}, "
             f"calibrated on {len(CALIBRATION_SENTENCES)} sentences)")
    f32_fn = jax.jit(minilm.encode)
    int8_encode = int8ify(minilm.encode, skip=tuple(args.skip)) if args.skip else int8ify(minilm.encode)
    # Weights quantized once (with SmoothQuant factors unless turned off); every call then quantizes
    # only the activations.
    calibration = minilm.tokenize(tokenizer, CALIBRATION_SENTENCES)
    # Only the dots fed by a LayerNorm are smoothed: their outlier channels are what hurts; smoothing the
    # two output projections too measured slower (XLA then materializes their scaled inputs) and no
    # more accurate.
    qparams = quantize_params(int8_encode, params, *calibration, smooth_alpha=alpha, smooth_skip=("*/output",))
    int8_jit = jax.jit(int8_encode)

    def int8_fn(_float_params, ids, mask):
        return int8_jit(qparams, ids, mask)

    n = len(sentences)
    embedded = {}
    for label, fn in (("float32", f32_fn), ("int8", int8_fn)):
        progress(f"embedding {_plural(n, 'sentence')} in {label} ({_plural(-(-n // args.batch_size), 'batch')} "
                 f"of up to {args.batch_size}; each new padded length compiles once)")
        embedded[label] = minilm.embed(fn, params, tokenizer, sentences, args.batch_size,
                                       on_batch=progress.batches(label))
    f32, i8 = embedded["float32"], embedded["int8"]
    if inputs.out_path is not None:
        written = save_with_fallback(inputs.out_path, f32, i8, sentences)
        if written != inputs.out_path:
            failed_writes += 1
        if written is not None:
            progress(f"wrote {written}: float32 {f32.shape}, int8 {i8.shape}")

    progress("accuracy report")
    kept = f", kept in float32: {', '.join(args.skip)}" if args.skip else ""
    kept += f", SmoothQuant alpha {alpha}" if alpha is not None else ", no smoothing"
    print(f"\nall-MiniLM-L6-v2, {_plural(n, 'sentence')} (longest {int(counts.max())} tokens, cut at "
          f"{minilm.MAX_LENGTH}; each batch padded to its longest, rounded up to a multiple of "
          f"{minilm.PAD_MULTIPLE}){kept}")
    nbytes = lambda tree: sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree))  # noqa: E731
    print(f"parameters: float32 {nbytes(params) / 2**20:.1f} MiB, with int8 weights "
          f"{nbytes(qparams) / 2**20:.1f} MiB ({nbytes(qparams) / nbytes(params):.2f}x)")
    ids, mask = minilm.tokenize(tokenizer, sentences[:2])
    dots = Counter("x".join(str(v.aval.dtype) for v in eqn.invars[:2])
                   for eqn in dot_eqns(jax.make_jaxpr(int8_encode)(qparams, ids, mask), platform=default_platform()))
    print("dot_generals in the int8ify'd program: " + ", ".join(f"{k} {t}" for t, k in sorted(dots.items())))
    print("\n".join(accuracy_lines(sentences, f32, i8)) + "\n", flush=True)
    encoders = {"float32": f32_fn, "int8": int8_fn}
    if args.static_scales:
        embedded_static = {"dynamic": i8}
        calibrations = {"static absmax": None, f"static {STATIC_PERCENTILE}th percentile": STATIC_PERCENTILE}
        for label, percentile in calibrations.items():
            progress(f"quantizing weights with {label} activation scales and embedding again")
            static = quantize_params(int8_encode, params, *calibration, smooth_alpha=alpha,
                                     smooth_skip=("*/output",), activations="static", calibration=[calibration],
                                     activation_percentile=percentile)
            # the attention einsums (two activations, no weight) get static scales of their own
            attention = calibrate_activation_dots(int8_encode, params, *calibration, calibration=[calibration],
                                                  percentile=percentile)
            attention_jit = jax.jit(int8_encode.with_options(activation_scales=attention))
            variants = {label: lambda _p, ids, mask, q=static: int8_jit(q, ids, mask),
                        f"{label}, attention too": lambda _p, ids, mask, q=static, f=attention_jit: f(q, ids, mask)}
            for name, fn in variants.items():
                embedded_static[name] = minilm.embed(fn, params, tokenizer, sentences, args.batch_size,
                                                     on_batch=progress.batches(name))
            if percentile is None:  # the speed part times static scales too (a percentile runs the same program)
                encoders["static"], encoders["static+attn"] = variants.values()
        print("\n".join(static_accuracy_lines(sentences, f32, embedded_static)) + "\n", flush=True)

    sample = sentences[:LAYER_REPORT_SENTENCES]
    progress(f"measuring the int8 error of every dot on {_plural(len(sample), 'sentence')}")
    layers = layer_errors(report(int8_encode, qparams, *minilm.tokenize(tokenizer, sample)))
    print("\n".join(layer_error_lines(layers, len(sample))) + "\n", flush=True)
    if inputs.plot_path is not None:
        if write_figure(inputs.plot_path, row_cosine(f32, i8), layers, f"all-MiniLM-L6-v2: int8ify vs float32{kept}"):
            progress(f"wrote {inputs.plot_path}")
        else:
            failed_writes += 1

    if inputs.run_bench:
        speed_report(progress, encoders, params, tokenizer, sentences, args.bench_batches, args.repeats)
    progress("done" if not failed_writes else "done, but not everything was written where asked (see above)")
    return 1 if failed_writes else 0


if __name__ == "__main__":
    sys.exit(main())
