"""LLM inference, decode and prefill, on a Llama-3-8B-shaped decoder: bf16 against int8ify and Qwix, in one process.

    python benchmarks/llm.py [--dry-run | --quick] [--workloads decode prefill ...] [--rounds 20] [--reps 10]
                             [--out benchmarks/results/llm-<device>.md]

The model is ``examples/llm/llama.py``'s (``forward(params, tokens, cache, position)``) at Llama-3-8B's layer shape:
d 4096, grouped-query attention with 32 query and 8 key-value heads of 128, SwiGLU 14336, RMSNorm, RoPE; with
**2 layers** and a **vocabulary of 2048**, random weights (speed does not depend on them), bfloat16 params,
activations and cache. A real 8B model's 128256-token LM head is about 7% of its weight bytes; in a 2-layer model it
would be over half of them, and the timings would be the head's, hence the small vocabulary.

Workloads (``--workloads``: names, or ``decode`` / ``prefill`` for all of a kind; default all):

* ``decode-b<batch>-c<cache>``: a serving step, one new token per sequence: the preallocated cache (filled with
  random keys and values) donated to the step (``jax.jit(step, donate_argnums=2)``), written in place at the current
  position and fed back to the next step with the step's own tokens; the positions cycle over the cache's last
  :data:`DECODE_WINDOW` slots, so attention reads a nearly full cache (``forward`` reads the whole preallocated cache
  at every step, the slots not yet written masked). Batch 1 / cache 2048, 32 / 2048, 8 / 8192, 128 / 1024.
* ``prefill-b2-t1024``: 2 prompts of 1024 tokens into an empty cache of 2048 slots (the cache a decode would go on
  in; each call writes the same slots of the cache it gets back, which is the empty cache's work).

Variants, each compiled ahead of time for each workload and timed interleaved round by round
(``benchmarks/harness.py``); speed = bf16's time / the variant's. A round is 50 calls dispatched back to back and
waited for at its end, as a serving loop runs them, the device running step after step a few microseconds apart: a
round's first dispatch and last wait (about 1 ms on a TPU v5e, the same for every variant) then add 20 us to a call
(with 10 calls a round they added 100 us, and brought every decode speed towards 1):

* ``bf16``: the float program.
* ``int8ify as wrapped``: ``int8ify(step)`` handed the bf16 params and the bf16 cache, as a user first wraps it:
  weights and cache quantized on every call. Its trace warns (``RequantizationWarning``) where a dot has too few
  rows to pay for that (every decode step at full size); the tables say so.
* ``int8ify + quantize_params + int8 cache``: weights quantized once (``quantize_params(forward, params, ...)``),
  the cache ``quantize_cache(cache)`` (int8 codes, a scale per token and head), written and read in int8.
* ``int8ify static + int8 cache``: the same with static activation scales
  (``quantize_params(..., activations="static")``) calibrated on a prefill-shaped and a decode-shaped batch of
  random tokens.
* ``Qwix w8a8`` and ``Qwix weight-only``: Qwix PTQ, int8 weights and int8 activations (the attention's dots too,
  which quantize the bf16 cache on every call), or int8 weights only (dequantized to bf16 in the program), when qwix
  is installed. Applied through :class:`QwixLlama`, a thin Flax linen module whose ``__call__`` runs ``forward``
  with the params declared as its params, and ``qwix.quantize_params``; the cache stays bf16 (Qwix does not
  quantize caches).

Per workload: each variant's time and speed; the relative error of its first step's logits against bf16's (the
correctness guard: an int8 variant further than ``Sizes.guard`` is flagged, see :class:`Sizes`); its KV-cache
bytes; its compile time (trace, rewrite, compile); its dots that are int8 x int8, of all its dots, in the traced
program and in the compiled one; and the float passes its step makes over arrays of the cache's size besides the
cache's write (0: the cache is read as it is stored; more: it is converted or quantized on every call). A variant
that fails prints its error in its cells and the others go on. ``--dry-run`` (alias ``--quick``): toy sizes (d 256,
4 heads, short caches) and three rounds, about a minute on a CPU; it prints only, unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import itertools
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

# the harness beside this file, the example's model, and the package itself where it is not installed (a checkout
# on an accelerator machine)
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples" / "llm"), str(HERE.parent)]

import llama  # noqa: E402
from harness import AsCalled, Report, environment, package_version, speedups, table, time_interleaved  # noqa: E402

from jaxpr_rewrite import RequantizationWarning, dot_eqns, int8ify, iter_eqns, quantize_cache  # noqa: E402
from jaxpr_rewrite import quantize_params  # noqa: E402

BF16 = "bf16"
WRAPPED = "int8ify as wrapped"
QPARAMS = "int8ify + quantize_params + int8 cache"
STATIC = "int8ify static + int8 cache"
QWIX_W8A8 = "Qwix w8a8"
QWIX_WEIGHT_ONLY = "Qwix weight-only"
VARIANTS = (BF16, WRAPPED, QPARAMS, STATIC, QWIX_W8A8, QWIX_WEIGHT_ONLY)
INT8_VARIANTS = VARIANTS[1:]

# A decode step's position cycles over the cache's last slots, so that attention reads a nearly full cache
DECODE_WINDOW = 64

LLAMA3_8B_TWO_LAYERS = dataclasses.replace(llama.LLAMA3_8B, n_layers=2, vocab_size=2048)
TOY = dataclasses.replace(LLAMA3_8B_TWO_LAYERS, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                          vocab_size=256)


class Workload(NamedTuple):
    """One timed call: ``decode`` (one token per sequence, the cache nearly full) or ``prefill`` (``tokens`` per
    sequence from position 0 of an empty cache), ``batch`` sequences, a cache of ``cache_len`` slots."""

    kind: str
    batch: int
    cache_len: int
    tokens: int = 1

    @property
    def name(self) -> str:
        return (f"decode-b{self.batch}-c{self.cache_len}" if self.kind == "decode"
                else f"prefill-b{self.batch}-t{self.tokens}")

    @property
    def title(self) -> str:
        """The workload in words, for the tables."""
        if self.kind == "decode":
            return f"decode, batch {self.batch}, cache {self.cache_len}"
        return f"prefill, batch {self.batch} x {self.tokens} tokens, cache {self.cache_len}"

    def positions(self) -> list[int]:
        """The positions of successive calls: the cache's last slots in turn (decode), 0 (prefill)."""
        if self.kind == "prefill":
            return [0]
        window = min(DECODE_WINDOW, self.cache_len // 2)
        return list(range(self.cache_len - window, self.cache_len))


class Sizes(NamedTuple):
    """The model, the workloads, the two calibration shapes of the static variant, the timing's rounds and calls per
    round, and the correctness guard: the relative error of an int8 variant's first-step logits against bf16's that
    flags it.

    The guard differs with the size, as this random model's int8 error does. At the toy size every int8 variant is
    within 1-6% of bf16 (static scales the furthest). At the full size (measured on a CPU at decode batch 1, cache
    2048) the dynamic variants (int8ify, Qwix w8a8) are 9-13% from bf16, weight-only Qwix 4% and static scales 36%
    (23% calibrated on the 99.99th percentile), and none is broken (bf16 itself is 1.4% from float32 there): the
    weights are iid Gaussian, each dot's int8 error 0.7-1.4% (3% for the MLP's down projection, whose input is
    heavy-tailed), and those errors add up over 19 dots; ``p . v`` over a random cache averages thousands of random
    values that cancel, 5% per dot; and the static scale of the attention's output projection is calibrated on
    prefill rows, whose context vectors are far larger than a decode step's over a full random cache (20% on that
    dot). A broken program (garbage, zeros) is off by about 1 or more."""

    config: llama.LlamaConfig
    workloads: tuple
    calibration: tuple
    rounds: int
    reps: int
    guard: float


FULL = Sizes(LLAMA3_8B_TWO_LAYERS,
             (Workload("decode", 1, 2048), Workload("decode", 32, 2048), Workload("decode", 8, 8192),
              Workload("decode", 128, 1024), Workload("prefill", 2, 2048, 1024)),
             (Workload("prefill", 2, 2048, 1024), Workload("decode", 8, 2048)), rounds=10, reps=50, guard=0.5)
DRY_RUN = Sizes(TOY,
                (Workload("decode", 1, 128), Workload("decode", 8, 256), Workload("prefill", 2, 64, 32)),
                (Workload("prefill", 2, 64, 32), Workload("decode", 4, 64)), rounds=3, reps=2, guard=0.1)


# -- the model's inputs -------------------------------------------------------------------------------------------
def random_tokens(config: llama.LlamaConfig, workload: Workload, seed: int):
    """int32 ``[batch, tokens]`` token ids, uniform over the vocabulary (numpy's: no program to compile)."""
    ids = np.random.default_rng(seed).integers(0, config.vocab_size, (workload.batch, workload.tokens), np.int32)
    return jnp.asarray(ids)


def initial_cache(config: llama.LlamaConfig, workload: Workload, seed: int) -> list[dict]:
    """The bf16 cache a workload's first call gets: filled with random keys and values (standard normal, about the
    magnitude this model's projections give) for a decode, as a prompt and earlier steps would have left it; empty
    (zeros) for a prefill. numpy's generator, one array at a time: no program to compile per shape, and at most
    one float32 array on the host."""
    cache = llama.init_cache(config, workload.batch, workload.cache_len, jnp.bfloat16)
    if workload.kind == "prefill":
        return cache
    rng = np.random.default_rng(seed)
    return [{name: jnp.asarray(rng.standard_normal(array.shape, np.float32).astype(jnp.bfloat16))
             for name, array in layer.items()} for layer in cache]


def tree_bytes(tree) -> int:
    """The bytes of a pytree's arrays (a quantized array's codes, scales and factors; Qwix's boxed arrays)."""
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "nbytes"))


def copied(tree):
    """A copy of a pytree's arrays in new buffers: each variant donates its own cache."""
    return jax.tree_util.tree_map(lambda leaf: jnp.array(leaf, copy=True), tree)


def serve_step(forward_fn: Callable) -> Callable:
    """``step(params, tokens, cache, position) -> (next_tokens [batch, 1], last_logits [batch, vocab], cache)``: one
    call of ``forward_fn`` and the argmax of its last logits (``llama.greedy_step``), the tokens shaped to be the
    next decode step's input and the last logits returned for the correctness guard (a row per sequence: nothing
    next to the step's weights and cache)."""

    def step(params, tokens, cache, position):
        logits, cache = forward_fn(params, tokens, cache, position)
        last = logits[:, -1]
        return jnp.argmax(last, axis=-1).astype(jnp.int32)[:, None], last, cache

    return step


# -- Qwix ---------------------------------------------------------------------------------------------------------
def param_name(path) -> str:
    """A params leaf's name in the Qwix module: its path as ``llama``'s weight sources name it (``layers.0.wq``)."""
    return ".".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)


class QwixWeight:
    """A weight Qwix hands back quantized (its ``WithAux`` box), as ``forward``'s ``x @ w`` can take it.

    ``forward``'s projections are the ``@`` operator, which Qwix does not intercept (it intercepts
    ``jax.lax.dot_general``, ``jnp.dot``, ``jnp.einsum``) and which a box cannot take; ``jnp.dot`` of an activation
    and a 2-D weight is the same contraction, and Qwix quantizes it (its ``dot`` interception)."""

    def __init__(self, boxed):
        self.boxed = boxed

    def __rmatmul__(self, x):
        return jnp.dot(x, self.boxed)


class QwixLlama(nn.Module):
    """``llama.forward`` as a Flax linen module, for ``qwix.quantize_model``: its params are the model's params
    declared as the module's, by name (:func:`param_name`), and ``__call__`` runs ``forward`` with them.

    Qwix's PTQ finds a matmul's weight among the current module's params by identity; ``forward``'s ``x @ w`` runs
    inside ``jnp.matmul``'s own ``jit``, where the weight is a new tracer, so the provider is made with
    ``disable_jit=True`` (Qwix's option for this), under which the matmul sees the param itself."""

    layout: tuple  # (name, shape, dtype) of each params leaf, in the params' flattened order
    treedef: Any  # the params' tree structure (with the model's config)

    @nn.compact
    def __call__(self, tokens, cache, position):
        leaves = [self.param(name, nn.initializers.zeros, shape, dtype) for name, shape, dtype in self.layout]
        leaves = [leaf if isinstance(leaf, jax.Array) else QwixWeight(leaf) for leaf in leaves]
        return llama.forward(jax.tree_util.tree_unflatten(self.treedef, leaves), tokens, cache, position)


def qwix_forward(params: dict, example: tuple, weight_only: bool) -> tuple[Callable, Any]:
    """Qwix PTQ of ``forward`` (int8 weights, and int8 activations unless ``weight_only``; every matmul, the
    attention's included), the weights quantized once with ``qwix.quantize_params``.

    Arguments:
        params: the bf16 params (``llama.random_params``).
        example: ``(tokens, cache, position)`` of any workload (shapes only: Qwix's abstract init).
        weight_only: int8 weights, activations left bf16.

    Returns:
        ``(forward_fn, qparams)``: ``forward_fn(qparams, tokens, cache, position) -> (logits, cache)``.
    """
    import qwix

    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = [param_name(path) for path, _ in paths_and_leaves]
    layout = tuple((name, leaf.shape, leaf.dtype) for name, (_, leaf) in zip(names, paths_and_leaves))
    rule = qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8,
                                 act_qtype=None if weight_only else jnp.int8)
    model = qwix.quantize_model(QwixLlama(layout, treedef), qwix.PtqProvider([rule], disable_jit=True))
    abstract = jax.eval_shape(model.init, jax.random.PRNGKey(0), *example)
    qparams = qwix.quantize_params(dict(zip(names, (leaf for _, leaf in paths_and_leaves))), abstract["params"])

    def forward_fn(qparams, tokens, cache, position):
        return model.apply({"params": qparams}, tokens, cache, position)

    return forward_fn, qparams


# -- what a compiled step holds -----------------------------------------------------------------------------------
def hlo_dots(hlo_text: str) -> tuple[int, int]:
    """``(int8 x int8 dots, all dots)`` of a compiled program's HLO text: its ``dot`` and ``convolution``
    instructions, the fused computations' included. An operand's type is printed beside it (``s8[4,256]{1,0} %x``)
    or read off the instruction that defines it (``%x = s8[4,256]{1,0} ...``): XLA prints either, by platform."""
    defined = dict(re.findall(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[", hlo_text, re.M))
    int8 = total = 0
    for operands in re.findall(r"=\s*\S+\s+(?:dot|convolution)\((.*)$", hlo_text, re.M):
        if re.match(r"\s*\w+\[", operands):
            types = re.findall(r"(?:^|,)\s*(\w+)\[", operands)[:2]
        else:
            types = [defined.get(name) for name in re.findall(r"%?([\w.\-]+)", operands)[:2]]
        total += 1
        int8 += types == ["s8", "s8"]
    return int8, total


def jaxpr_dots(jaxpr) -> tuple[int, int]:
    """``(int8 x int8 dots, all dots)`` of a traced program, nested programs included."""
    dots = list(dot_eqns(jaxpr))
    return sum(all(v.aval.dtype == jnp.int8 for v in eqn.invars[:2]) for eqn in dots), len(dots)


def float_cache_passes(jaxpr, cache_shape: tuple) -> int:
    """Equations of a traced step that make a floating array of the cache's shape, the cache's own write
    (``dynamic_update_slice``) aside: 0 where the step reads the cache as it is stored, more where it converts or
    quantizes the whole cache on every call."""
    return sum(1 for eqn in iter_eqns(jaxpr) if eqn.primitive.name != "dynamic_update_slice"
               for v in eqn.outvars
               if tuple(getattr(v.aval, "shape", ())) == cache_shape and jnp.issubdtype(v.aval.dtype, jnp.floating))


# -- variants -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Variant:
    """One way of running the model: its step (:func:`serve_step` of a forward, plain or ``int8ify``'d), its params
    and how it holds the cache; or the error that kept it from being made."""

    name: str
    step: Callable | None = None
    params: Any = None
    prepare_cache: Callable = copied  # the variant's own cache from the workload's bf16 one (its own buffers)
    weights: str = ""  # how the weights are held, in words
    prepare_seconds: float | None = None  # quantizing the weights (and calibrating), once
    error: str | None = None


def error_cell(error: BaseException) -> str:
    """An exception as one short table cell."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"failed: {type(error).__name__}: {first_line[:160]}".replace("|", "/")


def make_variants(sizes: Sizes, params: dict, names=VARIANTS) -> dict[str, Variant]:
    """The variants of ``names``, their weights quantized once where they are; one that fails to be made holds its
    error."""
    # the static scales' calibration batches; the decode-shaped one is also the example the weights' uses are traced
    # with (their shapes do not matter)
    calibration = [(random_tokens(sizes.config, w, 10 + i), initial_cache(sizes.config, w, 10 + i),
                    jnp.int32(w.positions()[-1])) for i, w in enumerate(sizes.calibration)]
    example = calibration[-1]
    int8_step = int8ify(serve_step(llama.forward))

    def quantized_once(**options):
        return quantize_params(llama.forward, params, *example, **options)

    def calibrated_static():
        return quantized_once(activations="static", calibration=calibration)

    def qwix(weight_only: bool):
        forward_fn, qparams = qwix_forward(params, example, weight_only)
        return serve_step(forward_fn), qparams

    makers = {
        BF16: lambda: (serve_step(llama.forward), params, copied, "bf16"),
        WRAPPED: lambda: (int8_step, params, copied, "bf16, quantized on every call"),
        QPARAMS: lambda: (int8_step, quantized_once(), quantize_cache, "int8 codes + scales (quantize_params)"),
        STATIC: lambda: (int8_step, calibrated_static(), quantize_cache,
                         "int8 codes + scales + static activation scales"),
        QWIX_W8A8: lambda: (*qwix(False), copied, "int8 (qwix.quantize_params)"),
        QWIX_WEIGHT_ONLY: lambda: (*qwix(True), copied, "int8 (qwix.quantize_params)"),
    }
    if package_version("qwix"):
        importlib.import_module("qwix")  # imported ahead, so that no variant's preparation time holds it
    variants = {}
    for name in names:
        if name.startswith("Qwix") and not package_version("qwix"):
            variants[name] = Variant(name, error="qwix not installed")
            continue
        start = time.perf_counter()
        try:
            step, variant_params, prepare_cache, weights = makers[name]()
            jax.block_until_ready(variant_params)
        except Exception as error:  # noqa: BLE001  (a failing variant is reported in its cells; the rest go on)
            variants[name] = Variant(name, error=error_cell(error))
            continue
        seconds = time.perf_counter() - start if variant_params is not params else None
        variants[name] = Variant(name, step, variant_params, prepare_cache, weights, seconds)
    return variants


class Served:
    """A variant's compiled step called as a server calls it: the cache donated and fed back, a decode's next
    tokens fed back, the positions in turn (device scalars, made once)."""

    def __init__(self, compiled, params, tokens, cache, positions: list, feed_back_tokens: bool):
        self.compiled, self.params, self.tokens, self.cache = compiled, params, tokens, cache
        self.positions = itertools.cycle(positions)
        self.feed_back_tokens = feed_back_tokens

    def __call__(self):
        tokens, logits, self.cache = self.compiled(self.params, self.tokens, self.cache, next(self.positions))
        if self.feed_back_tokens:
            self.tokens = tokens
        return logits


@dataclasses.dataclass
class Prepared:
    """A variant ready to time on one workload, and what was read off it."""

    served: Served
    compile_seconds: float
    first_logits: np.ndarray
    cache_bytes: int
    int8_dots: tuple  # (int8 x int8, all) in the traced program
    compiled_int8_dots: tuple  # the same in the compiled HLO
    float_cache_passes: int
    requantization_warnings: int


def prepare(variant: Variant, workload: Workload, tokens, cache, positions: list) -> Prepared:
    """``variant``'s step traced, compiled ahead of time for ``workload`` (its cache donated) and called once: that
    first call's logits are the correctness guard's; the program's int8 dots, float passes over the cache and
    ``RequantizationWarning``s are counted."""
    cache_shape = jax.tree_util.tree_leaves(cache)[0].shape  # one layer's keys: [batch, cache_len, heads, head_dim]
    cache = variant.prepare_cache(cache)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RequantizationWarning)
        start = time.perf_counter()
        traced = jax.jit(variant.step, donate_argnums=2).trace(variant.params, tokens, cache, positions[0])
        compiled = traced.lower().compile()
        compile_seconds = time.perf_counter() - start
    cache_bytes = tree_bytes(cache)
    served = Served(compiled, variant.params, tokens, cache, positions, workload.kind == "decode")
    first_logits = np.asarray(served(), np.float64)
    return Prepared(served, compile_seconds, first_logits, cache_bytes, jaxpr_dots(traced.jaxpr),
                    hlo_dots(compiled.as_text()), float_cache_passes(traced.jaxpr, cache_shape),
                    sum(issubclass(w.category, RequantizationWarning) for w in caught))


# -- one workload -------------------------------------------------------------------------------------------------
def time_variants(prepared: dict[str, Prepared], rounds: int, reps: int, errors: dict) -> dict[str, float]:
    """Milliseconds per call of each prepared variant, interleaved (``harness.time_interleaved``); should one fail
    on the way, each is timed alone and a failing one's error goes into ``errors``."""
    timed = {name: (AsCalled(p.served), ()) for name, p in prepared.items()}
    try:
        return time_interleaved(timed, rounds, reps)
    except Exception:  # noqa: BLE001  (timed alone below, so that one failure names its variant)
        times = {}
        for name, variant in timed.items():
            try:
                times.update(time_interleaved({name: variant}, rounds, reps))
            except Exception as error:  # noqa: BLE001
                errors[name] = error_cell(error)
        return times


def human_bytes(nbytes: int) -> str:
    """Bytes in KiB, MiB or GiB, three significant digits or more."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}" if nbytes < 100 * size else f"{nbytes / size:.0f} {unit}"
    return f"{nbytes / 2**10:.3g} KiB" if nbytes < 100 * 2**10 else f"{nbytes / 2**10:.0f} KiB"


def result_row(name: str, prepared: Prepared, ms: float, speed: str, reference, guard: float) -> tuple[list, str]:
    """A timed variant's row of its workload's table, and its relative error's text (``""`` where bf16 gave no
    reference), flagged where an int8 variant's is over ``guard``."""
    error = ""
    if reference is not None:
        relative = float(np.linalg.norm(prepared.first_logits - reference) / np.linalg.norm(reference))
        error = f"{relative:.1e}" + (" (over the guard)" if name in INT8_VARIANTS and not relative <= guard else "")
    (traced_int8, traced_all), (compiled_int8, compiled_all) = prepared.int8_dots, prepared.compiled_int8_dots
    warned = prepared.requantization_warnings
    return [name, f"{ms:.3f}", speed, error, human_bytes(prepared.cache_bytes), f"{prepared.compile_seconds:.1f}",
            f"{traced_int8}/{traced_all} / {compiled_int8}/{compiled_all}", prepared.float_cache_passes,
            f"yes ({warned})" if warned else "no"], error


def run_workload(report: Report, sizes: Sizes, variants: dict[str, Variant], workload: Workload, rounds: int,
                 reps: int) -> tuple[dict[str, str], list[str]]:
    """Prepare every variant for ``workload``, time them interleaved and add the workload's table to ``report``; the
    variants' caches and executables are freed on return.

    Returns:
        ``(cells, guard_failures)``: the summary's cell of each variant (bf16's milliseconds, the others' speed, or
        an error), and the int8 variants whose first-step logits are further than ``sizes.guard`` from bf16's.
    """
    start = time.perf_counter()
    tokens = random_tokens(sizes.config, workload, 1)
    positions = [jnp.int32(p) for p in workload.positions()]
    cache = initial_cache(sizes.config, workload, 2)
    prepared, errors = {}, {}
    for name, variant in variants.items():
        if variant.error:
            errors[name] = variant.error
            continue
        try:
            prepared[name] = prepare(variant, workload, tokens, cache, positions)
        except Exception as error:  # noqa: BLE001  (a failing variant is reported in its cells; the rest go on)
            errors[name] = error_cell(error)
    del cache  # each variant holds its own
    times = time_variants(prepared, rounds, reps, errors)
    speeds = speedups(times, BF16) if BF16 in times else {}
    reference = prepared[BF16].first_logits if BF16 in prepared and BF16 not in errors else None

    rows, cells, guard_failures = [], {}, []
    for name in variants:
        if name in errors:
            rows.append([name, errors[name], *[""] * 7])
            cells[name] = errors[name]
            continue
        speed = f"{speeds[name]:.2f}x" if name in speeds else "-"
        row, error = result_row(name, prepared[name], times[name], speed, reference, sizes.guard)
        rows.append(row)
        if error.endswith("(over the guard)"):
            guard_failures.append(f"{workload.name}: {name} ({error.split()[0]})")
        cells[name] = (f"{times[name]:.3f}" if name == BF16 else speed) + (
            " (warned)" if prepared[name].requantization_warnings else "")
    prepared.clear()
    gc.collect()
    report.add("", f"### {workload.title} (`{workload.name}`, {time.perf_counter() - start:.0f} s)", "", *table(
        ["variant", "ms", "speed vs bf16", "first logits: rel. error vs bf16", "KV cache", "compile s",
         "int8 dots: traced / compiled", "float passes over the cache", "RequantizationWarning"], rows))
    return cells, guard_failures


# -- the run ------------------------------------------------------------------------------------------------------
def selected(workloads: tuple, names) -> list[Workload]:
    """The workloads named (a name, or ``decode`` / ``prefill`` for all of a kind), in the benchmark's order."""
    if not names:
        return list(workloads)
    known = {w.name for w in workloads} | {"decode", "prefill"}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; these sizes have {sorted(known)}")
    return [w for w in workloads if w.name in names or w.kind in names]


def device_slug() -> str:
    """The device's kind as a file name part: ``TPU v5 lite`` -> ``tpu-v5-lite``."""
    return re.sub(r"[^a-z0-9]+", "-", jax.devices()[0].device_kind.lower()).strip("-")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", "--quick", dest="dry_run", action="store_true",
                        help="toy sizes (d 256, 4 heads, short caches), three rounds: about a minute on a CPU")
    parser.add_argument("--workloads", nargs="+", help="workload names, or decode / prefill (default: all)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds per workload (default 10; dry run 3)")
    parser.add_argument("--reps", type=int, help="calls per round (default 50; dry run 2)")
    parser.add_argument("--out", help="the result file (default benchmarks/results/llm-<device>.md; a dry run "
                                      "prints only)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    sizes = DRY_RUN if args.dry_run else FULL
    workloads = selected(sizes.workloads, args.workloads)
    rounds, reps = args.rounds or sizes.rounds, args.reps or sizes.reps
    out = args.out or (None if args.dry_run else HERE / "results" / f"llm-{device_slug()}.md")
    config = sizes.config
    report = Report(out)
    report.add(
        environment(("qwix", "flax")), "",
        f"Llama-3-8B-shaped decoder (examples/llm/llama.py): d {config.d_model}, {config.n_heads} query and "
        f"{config.n_kv_heads} key-value heads of {config.head_dim}, SwiGLU {config.ffn_dim}, RMSNorm, RoPE; "
        f"{config.n_layers} layers, vocabulary {config.vocab_size} (a real 8B model's 128256-token head is ~7% of its "
        "weight bytes, in a 2-layer model it would be over half); random bf16 weights, bf16 activations.",
        f"Decode: one token per sequence per step, the cache donated and fed back, positions over the cache's last "
        f"{DECODE_WINDOW} slots (attention reads the whole cache). Prefill: the prompts at position 0 of an empty "
        f"cache. ms per call: median of {rounds} interleaved rounds of {reps} calls (benchmarks/harness.py); speed "
        "= bf16's time / the variant's. Compile s: trace, rewrite and compile of the step. Int8 dots: int8 x int8 "
        "of all dots in the traced program / in the compiled one. Float passes over the cache: equations making a "
        "float array of the cache's size besides its write (0: the cache is read as stored). The guard: each int8 "
        f"variant's first-step logits within {sizes.guard:.0%} of bf16's (a random model's int8 error: the script's "
        "docstring, Sizes).")

    params = llama.random_params(config, 0, jnp.bfloat16)
    variants = make_variants(sizes, params)
    bf16_bytes = tree_bytes(params)
    report.add("", *table(["variant", "weights", "weight bytes", "quantized once, s"], [
        [name, variant.error or variant.weights,
         "" if variant.error else f"{human_bytes(tree_bytes(variant.params))} "
                                  f"({tree_bytes(variant.params) / bf16_bytes:.2f}x bf16's)",
         "" if variant.prepare_seconds is None else f"{variant.prepare_seconds:.1f}"]
        for name, variant in variants.items()]))
    report.save()

    cells, guard_failures = {}, []
    for workload in workloads:
        cells[workload], failures = run_workload(report, sizes, variants, workload, rounds, reps)
        guard_failures += failures
        report.save()  # each finished workload kept, should a later one not finish

    report.add("", "### Summary: bf16 ms, the others' speed vs bf16", "",
               *table(["workload", "bf16 ms", *INT8_VARIANTS],
                      [[w.name, *(cells[w].get(name, "-") for name in VARIANTS)] for w in workloads]), "",
               f"Correctness guard (int8 variants' first-step logits within {sizes.guard:.0%} of bf16's): "
               + ("holds for every variant measured" if not guard_failures else "fails for " + "; ".join(
                   guard_failures)),
               f"Total wall time: {time.perf_counter() - start:.0f} s")
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
