"""int8ify against the JAX world's int8 libraries on one Flax MLP, in one process, interleaved.

    python benchmarks/peers.py [--quick] [--batches 256 32 1] [--width 1024] [--repeats 1] [--pairs 0]
                               [--out benchmarks/results/peers.md]

The model: 4 x ``nn.Dense(1024)`` (``--width``) + gelu (the last layer linear), float32. Variants, each compiled
ahead of time (but the eager one) and timed interleaved round by round (medians after warm-up;
``benchmarks/harness.py``), speed printed as float32 time / variant time:

* ``float32``                 the Flax model as written;
* ``bf16``                    the same with bfloat16 weights and input, on an accelerator (a CPU's bf16 is emulated);
* ``Qwix PTQ``                ``qwix.quantize_model`` with int8 weights and activations, weights quantized once
                              (``qwix.quantize_params``), when qwix is installed;
* ``AQT SERVE``               ``aqt_flax.AqtDotGeneral`` (int8 ``config_v4``) in SERVE mode with weights frozen by a
                              CONVERT pass, when aqtp is installed;
* ``hand W8A8``               the same int8 program by hand with the plain formulas, weights pre-quantized;
* ``int8ify+qparams``         ``int8ify`` with weights quantized once (dynamic per-row activation scales);
* ``int8ify static``          the same with static activation scales (``activations="static"``);
* ``int8ify (weights/call)``  ``jax.jit(int8ify(model))`` on the float weights: quantized on every call;
* ``int8ify eager``           ``int8ify(model)`` called directly on the float weights: an eager call quantizes the
                              weights that come back once and reuses their codes. Each call gets its input as a new
                              array (:func:`new_array`, no copy): an eager call reuses the codes of any array it
                              was handed before, the input's too, which a real call's new input never has;
* ``int8ify closed over``     ``jax.jit(int8ify(lambda x: model.apply(params, x)))``: weights the function closes
                              over are quantized once, when its program is traced;
* ``bare int8 dots``          only the model's int8 x int8 -> int32 dots;
* ``floor``                   the int8 dots plus the model's own bias and gelu on their int32 results, each dot's
                              input a cast to int8, the float input's too (what any int8 program of this model must
                              pay: no reduction or scale pass);
* ``floor, int8 input``       the floor handed its input as int8 codes (the floor of earlier runs): no program of a
                              float model gets that, and XLA:CPU's runtime can run it faster or slower than the floor;
* ``floor + NaN check``       the floor with what NaN propagation adds to it: a minimum over each dot's int8 input,
                              beside the dot, poisoning the rows it marks. More work, yet XLA:CPU runs it faster
                              than the floor, whose kernels form a chain (docs/performance.md).

The header names the CPU (``/proc/cpuinfo``), JAX and the peers' versions, so runs compare across machines (XLA's
int8 dots are ~7x float32 on a Xeon with AMX-INT8 and ~1.5x on an AMD EPYC without it). A second table reads the
CPU speed targets off the measured times (``TARGETS``): which hold on this machine, by how much.

A variant's place in a round of many moves its time (what ran before it evicted its weights from the cache, or left
the other core busy): on an AMX Xeon, weights closed over ran 5-32% faster than the same weights passed quantized in
rounds of all the variants, 0.93-1.14x their time with the two alone. ``--pairs N`` therefore also times each
target in pairs (:func:`pair_ratios`): its variant and one baseline alone in every round, ``N`` measurements with
the two orders alternating, per baseline; a third table gives those ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

# speed.py beside this file, and the package itself where it is not installed (a checkout on an accelerator machine)
sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")]

from harness import (AsCalled, Report, compile_ahead, environment, package_version, speedups, table,  # noqa: E402
                     table_row, time_interleaved)
from speed import hand_dense, rel_error  # noqa: E402

from jaxpr_rewrite import int8ify, quantize, quantize_params  # noqa: E402

WIDTH, LAYERS = 1024, 4


class MLP(nn.Module):
    """``LAYERS`` x Dense(width) + gelu, the last layer linear; ``dot_general`` is what the peers inject."""

    dot_general_cls: object = None
    width: int = WIDTH

    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            x = nn.Dense(self.width, dot_general_cls=self.dot_general_cls, name=f"dense_{i}")(x)
            if i < LAYERS - 1:
                x = nn.gelu(x)
        return x


class Target(NamedTuple):
    """A speed target read off one batch's times: ``variant`` takes at most ``factor`` times the fastest of
    ``against`` (those measured) at batches of at least ``min_batch``."""

    text: str
    variant: str
    against: tuple
    factor: float = 1.0
    min_batch: int = 1

    def baselines(self, batch: int, measured) -> list[str]:
        """The baselines of ``against`` among ``measured`` (variant names), ``[]`` where the target does not apply
        (a smaller batch, the variant not measured, nothing to compare)."""
        if batch < self.min_batch or self.variant not in measured:
            return []
        return [name for name in self.against if name in measured]

    def reading(self, batch: int, times: dict) -> tuple | None:
        """``(ratio, baseline)`` for this batch's ``times`` (ms by variant): the variant's time over the fastest
        baseline's, or ``None`` where the target does not apply (:meth:`baselines`)."""
        present = self.baselines(batch, times)
        if not present:
            return None
        baseline = min(present, key=times.get)
        return times[self.variant] / times[baseline], baseline


TARGETS = (
    Target("weights quantized once: at most the best peer's time", "int8ify+qparams", ("Qwix PTQ", "AQT SERVE")),
    Target("weights quantized once: at most the hand-written program's time", "int8ify+qparams", ("hand W8A8",)),
    Target("weights quantized once: within 1.25x of the floor", "int8ify+qparams", ("floor",), 1.25, 16),
    Target("static activation scales: within 1.1x of the floor", "int8ify static", ("floor",), 1.1, 16),
    Target("weights quantized on every call: at least float32's speed", "int8ify (weights/call)", ("float32",), 1.0,
           32),
    # an accelerator's own float baseline, measured only there (a CPU's bf16 is emulated)
    Target("weights quantized once: at most bf16's time", "int8ify+qparams", ("bf16",)),
    Target("static activation scales: at most bf16's time", "int8ify static", ("bf16",)),
    Target("weights quantized on every call: at least bf16's speed", "int8ify (weights/call)", ("bf16",), 1.0, 32),
)


def target_lines(runs_by_batch: dict) -> list[str]:
    """The Markdown table of :data:`TARGETS` read off ``runs_by_batch`` (batch -> a list of measurements, each ms by
    variant): with one measurement its ratio and whether it holds; with several the range of the ratios, their
    median and in how many the target holds."""
    lines = table(["target", "batch", "time / baseline", "holds"])
    for target in TARGETS:
        for batch, runs in runs_by_batch.items():
            readings = [reading for reading in (target.reading(batch, times) for times in runs) if reading is not None]
            if not readings:
                continue
            ratios = sorted(ratio for ratio, _ in readings)
            baselines = " / ".join(dict.fromkeys(baseline for _, baseline in readings))
            held = sum(ratio <= target.factor for ratio in ratios)
            if len(readings) == 1:
                ratio, holds = f"{ratios[0]:.2f}", "yes" if held else "no"
            else:
                ratio = f"{ratios[0]:.2f}-{ratios[-1]:.2f} (median {statistics.median(ratios):.2f})"
                holds = f"{held} of {len(readings)}"
            lines.append(table_row([target.text, batch, f"{ratio} x {baselines}", holds]))
    return lines


def pair_ratios(variants: dict, target: Target, batch: int, measurements: int, rounds: int, reps: int) -> dict:
    """``target``'s ratios timed in pairs: for each of its baselines in ``variants`` (name -> ``(fn, args)``), the
    target's variant and that baseline alone in each round, ``measurements`` times, the two orders alternating.

    Returns:
        baseline -> the measurements' ratios (variant time / baseline time); empty where the target does not apply
        at this batch or nothing is there to compare.
    """
    ratios = {}
    for baseline in target.baselines(batch, variants):
        pair = [target.variant, baseline]
        ratios[baseline] = []
        for i in range(measurements):
            order = pair if i % 2 == 0 else pair[::-1]
            times = time_interleaved({name: variants[name] for name in order}, rounds, reps)
            ratios[baseline].append(times[target.variant] / times[baseline])
    return ratios


def pair_lines(readings: dict) -> list[str]:
    """The Markdown table of :data:`TARGETS` timed in pairs: ``readings`` maps ``(target, batch)`` to
    :func:`pair_ratios`' result. Each baseline's range and median; the target holds where every baseline's median
    ratio is within its factor (at most the best peer's time: at most each peer's)."""
    lines = table(["target", "batch", "time / baseline, in pairs", "holds"])
    for (target, batch), ratios in readings.items():
        if not ratios:
            continue
        medians = {name: statistics.median(values) for name, values in ratios.items()}
        text = "; ".join(f"{min(values):.2f}-{max(values):.2f} (median {medians[name]:.2f}) x {name}"
                         for name, values in ratios.items())
        holds = "yes" if max(medians.values()) <= target.factor else "no"
        lines.append(table_row([target.text, batch, text, holds]))
    return lines


def flax_mlp(width: int = WIDTH):
    """The benchmark's model and its (seeded) float32 params."""
    model = MLP(width=width)
    return model, model.init(jax.random.PRNGKey(0), jnp.ones((1, width)))


def new_array(x):
    """``x`` as a new ``jax.Array`` on the same buffer (no copy): an array an eager ``int8ify`` call has not seen.

    An eager call keeps the codes of every array it is handed a second time (weights come back), so a benchmark
    that hands it the same input array on every call times it with the input's quantization skipped: on a TPU v5e
    9% of the MLP's time at d 4096 (``benchmarks/results/tpu-v5-lite.md``, the twelfth run)."""
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, [x])


def layers(params):
    return [params["params"][f"dense_{i}"] for i in range(LAYERS)]


def calibration_batches(batch: int, width: int) -> list:
    """The static scales' calibration data for a run at ``batch``: four random inputs of at least 32 rows, the same in
    every benchmark that times static scales on this MLP."""
    return [(jax.random.normal(jax.random.PRNGKey(100 + i), (max(batch, 32), width)),) for i in range(4)]


def hand_program(params):
    """Weights quantized once, by hand; the forward pass with the plain formulas."""
    weights = []
    for layer in layers(params):
        q = quantize(layer["kernel"], (0,))
        weights.append({"w": {"codes": q.codes, "scales": q.scale_values()}, "b": layer["bias"]})

    def run(weights, x):
        for i, layer in enumerate(weights):
            x = hand_dense(x, layer["w"]) + layer["b"]
            x = nn.gelu(x) if i < LAYERS - 1 else x
        return x

    return jax.jit(run), weights


def floor_program(params, x, nan_check: bool = False):
    """The int8 dots of the model with its own bias and gelu applied to their (converted) int32 results; with
    ``nan_check``, each dot's output rows are poisoned where a minimum over its int8 input finds the code -128.

    Every dot's int8 input is a cast, standing in for any quantization (no reduction, no scale): the model's float
    input ``x`` too, as any int8 program of a float model must convert it, in a pass of its own. The bare dots are
    handed int8 inputs and codes of their own (copies), so that neither program finds the other's weights in the
    cache when they are timed one after the other."""
    codes = [quantize(layer["kernel"], (0,)).codes for layer in layers(params)]
    biases = [layer["bias"] for layer in layers(params)]

    # the codes are int8 (made above); the linter cannot see their dtype through the lists
    def run(x, codes, biases):
        x = x.astype(jnp.int8)
        for i, (w, b) in enumerate(zip(codes, biases)):
            h = lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)  # noqa: JX101
            h = h.astype(jnp.float32) + b
            if nan_check:
                h = h + jnp.where(jnp.min(x, axis=1) == -128, jnp.nan, 0.0)[:, None]
            h = nn.gelu(h) if i < LAYERS - 1 else h
            x = h.astype(jnp.int8) if i < LAYERS - 1 else h
        return x

    def bare(x, codes):
        return [lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)  # noqa: JX101
                for w in codes]

    bare_args = (x.astype(jnp.int8), [jnp.array(c, copy=True) for c in codes])
    return (jax.jit(run), (x, codes, biases)), (jax.jit(bare), bare_args)


def qwix_program(model, params, x):
    import qwix

    rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.int8, act_qtype=jnp.int8)]
    ptq = qwix.quantize_model(model, qwix.PtqProvider(rules))
    abstract = jax.eval_shape(ptq.init, jax.random.PRNGKey(0), x)
    qparams = qwix.quantize_params(params["params"], abstract["params"])
    return jax.jit(lambda p, x: ptq.apply({"params": p}, x)), qparams


def aqt_program(params, x):
    from aqt.jax.v2 import config as aqt_config
    from aqt.jax.v2 import utils as aqt_utils
    from aqt.jax.v2.flax import aqt_flax

    cfg = aqt_config.config_v4(fwd_bits=8, dlhs_bits=None, drhs_bits=None)

    def dot_general(mode):
        import functools

        return functools.partial(aqt_flax.AqtDotGeneral, cfg, lhs_quant_mode=aqt_utils.QuantMode.TRAIN,
                                 rhs_quant_mode=mode, rhs_freeze_mode=aqt_flax.FreezerMode.CALIBRATION_AND_VALUE)

    width = x.shape[-1]
    convert = MLP(dot_general_cls=dot_general(aqt_utils.QuantMode.CONVERT), width=width)
    _, frozen = convert.apply(params, x, rngs={"params": jax.random.PRNGKey(0)}, mutable=True)
    serve = MLP(dot_general_cls=dot_general(aqt_utils.QuantMode.SERVE), width=width)
    # SERVE reads the frozen int8 weights and scales; nn.Dense still wants its float kernel passed (unused)
    return jax.jit(lambda p, x: serve.apply(p, x, rngs={"params": jax.random.PRNGKey(0)})), frozen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 32, 1])
    parser.add_argument("--width", type=int, default=WIDTH,
                        help="the layers' width (4096 on an accelerator, where the kernels show)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--out", help="also write the table (Markdown) here")
    parser.add_argument("--pairs", type=int, default=0,
                        help="also time each target's variant and baselines in pairs, this many measurements each")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measure each batch this many times (each all variants interleaved); the table gives "
                             "the median time, the targets their ratio in each measurement")
    args = parser.parse_args(argv)
    rounds, reps = (3, 2) if args.quick else (25, 5)

    width = args.width
    model, params = flax_mlp(width)
    apply = model.apply
    report = Report(args.out)
    report.add(environment(("qwix", "aqtp", "flax")), "",
               f"Flax MLP {LAYERS} x Dense({width}) + gelu; ms per call (median of {rounds} interleaved rounds"
               + (f", the median of {args.repeats} such measurements" if args.repeats > 1 else "") + "); "
               "speed = float32 time / variant time; ratios to the bare int8 dots and to the floor", "",
               *table(["batch", "variant", "ms", "speed vs float32", "x bare int8 dots", "x floor", "rel. error"]))
    times_by_batch, in_pairs = {}, {}
    for batch in args.batches:
        x = jax.random.normal(jax.random.PRNGKey(batch), (batch, width))
        wrapped = int8ify(apply)
        dynamic = quantize_params(apply, params, x)
        static = quantize_params(apply, params, x, activations="static", calibration=calibration_batches(batch, width))
        hand, hand_weights = hand_program(params)
        (floor, floor_args), (bare, bare_args) = floor_program(params, x)
        variants = {"float32": (apply, (params, x))}
        if jax.default_backend() != "cpu":  # an accelerator's own float baseline (a CPU's bf16 is emulated)
            variants["bf16"] = (apply, jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), (params, x)))
        if package_version("qwix"):
            fn, qp = qwix_program(model, params, x)
            variants["Qwix PTQ"] = (fn, (qp, x))
        if package_version("aqtp"):
            fn, served = aqt_program(params, x)
            variants["AQT SERVE"] = (fn, (served, x))
        variants.update({
            "hand W8A8": (hand, (hand_weights, x)),
            "int8ify+qparams": (wrapped, (dynamic, x)),
            "int8ify static": (wrapped, (static, x)),
            "int8ify (weights/call)": (wrapped, (params, x)),
            "int8ify eager": (AsCalled(lambda p, v, eager=int8ify(apply): eager(p, new_array(v))), (params, x)),
            "int8ify closed over": (int8ify(lambda v: apply(params, v)), (x,)),
            "bare int8 dots": (bare, bare_args),
            "floor": (floor, floor_args),
            "floor + NaN check": floor_program(params, x, nan_check=True)[0],
            "floor, int8 input": floor_program(params, x.astype(jnp.int8))[0],
        })
        variants = compile_ahead(variants)  # once: every measurement, pair and error below runs these executables
        runs = times_by_batch[batch] = [time_interleaved(variants, rounds, reps) for _ in range(args.repeats)]
        times = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
        speeds = speedups(times, "float32")
        reference = variants["float32"][0](params, x)
        for name, ms in times.items():
            fn, fn_args = variants[name]
            error = "" if name.startswith(("bare int8 dots", "floor")) else f"{rel_error(fn(*fn_args), reference):.2e}"
            report.add(table_row([batch, name, f"{ms:.3f}", f"{speeds[name]:.2f}x",
                                  f"{ms / times['bare int8 dots']:.2f}", f"{ms / times['floor']:.2f}", error]))
        if args.pairs:
            in_pairs.update({(target, batch): pair_ratios(variants, target, batch, args.pairs, rounds, reps)
                             for target in TARGETS})
        report.save()  # each finished batch kept, should a later one not finish
    how = ("the medians above; one measurement, so a ratio within a few percent of its bound can go either way"
           if args.repeats == 1 else f"each of {args.repeats} measurements per batch; the range, median and count")
    report.add("", f"Speed targets on this machine ({how}):", "", *target_lines(times_by_batch))
    if args.pairs:
        report.add("", f"The same targets timed in pairs (the variant and one baseline alone in each round, "
                       f"{args.pairs} measurements with the two orders alternating; the ranges and medians):", "",
                   *pair_lines(in_pairs))
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
