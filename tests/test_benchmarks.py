"""The public benchmarks under ``benchmarks/``: their shared harness (interleaving, medians, tables, the header), a
dry run of each at toy sizes, and what they read off their times.

Dry runs that take tens of seconds are marked ``slow``, which the default run leaves out (``pytest.ini``); run them
with ``python -m pytest -m slow tests/test_benchmarks.py``. ``benchmarks/lint_speed.py``'s dry run is in
``tests/lint_plugin/test_lint_speed_script.py``. ``benchmarks/accelerators.py`` runs under the deviceless
compilers' environments (``../shared/tools``), which CI does not have: its dry run is slow and needs the path of
such an environment's Python in ``INT8IFY_GPU_COMPILE_PYTHON`` or ``INT8IFY_TPU_COMPILE_PYTHON``.
"""

import dataclasses
import importlib
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from conftest import ROOT

from jaxpr_rewrite import dot_eqns, int8ify, iter_eqns

sys.path.insert(0, str(ROOT / "benchmarks"))
import harness  # noqa: E402


@pytest.fixture
def load_benchmark(monkeypatch):
    """``load_benchmark("speed")``: ``benchmarks/speed.py`` imported afresh from this checkout."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))

    def load(name: str):
        sys.modules.pop(name, None)
        return importlib.import_module(name)

    return load


@pytest.fixture
def peers(load_benchmark):
    """``benchmarks/peers.py``, imported afresh."""
    return load_benchmark("peers")


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of each Markdown table row of ``text`` whose first cell is ``first_cell``."""
    return [line[2:-2].split(" | ") for line in text.splitlines() if line.startswith(f"| {first_cell} | ")]


# -- the harness ---------------------------------------------------------------------------------------------------
def test_interleaved_samples_take_each_measurement_in_turn_round_by_round():
    taken = []
    measures = {name: (lambda name=name: taken.append(name) or len(taken)) for name in "abc"}
    assert harness.interleaved_samples(measures, rounds=3) == {"a": [1, 4, 7], "b": [2, 5, 8], "c": [3, 6, 9]}
    assert taken == list("abcabcabc")
    taken.clear()
    harness.interleaved_samples(measures, rounds=3, alternate=True)
    assert taken == list("abccbaabc")


def test_time_interleaved_warms_up_then_gives_the_median_milliseconds_per_call():
    """A fake clock that each call moves on: the warm-up calls are not timed, each sample is its calls' time over
    their number, the result the median of the rounds' samples (not their mean, which one slow round would move)."""
    now, calls = [0.0], []

    def variant(name: str, seconds: list[float]) -> harness.AsCalled:
        durations = iter(seconds)

        def call(x):
            calls.append(name)
            now[0] += next(durations)
            return x

        return harness.AsCalled(call)

    warmup = [100.0, 100.0]  # two calls each, waited for one by one
    fast = variant("fast", warmup + [0.001, 0.001, 0.005, 0.005, 0.002, 0.002])  # 1, 5, 2 ms per call
    slow = variant("slow", warmup + [0.003, 0.003, 0.004, 0.002, 0.060, 0.060])  # 3, 3, 60 ms per call
    times = harness.time_interleaved({"fast": (fast, (1,)), "slow": (slow, (1,))}, rounds=3, reps=2,
                                     clock=lambda: now[0])
    assert calls == ["fast", "fast", "slow", "slow"] + ["fast", "fast", "slow", "slow"] * 3
    assert times == pytest.approx({"fast": 2.0, "slow": 3.0})
    assert harness.speedups(times, "slow") == pytest.approx({"fast": 1.5, "slow": 1.0})


def test_a_variant_compiled_ahead_keeps_its_program_whatever_is_traced_later():
    """A variant's program is the one traced when it was made: a ``jax.jit`` function would compile at its first
    timed call, after the state its trace reads (here a factor; a benchmark's candidate form) has changed."""
    factor = [2.0]

    def scaled(x):
        return x * factor[0]

    x = jnp.arange(4.0)
    before = harness.compile_ahead({"before": (scaled, (x,))})
    factor[0] = 3.0
    jax.clear_caches()
    after = harness.compile_ahead({"after": (scaled, (x,)), "as called": (harness.AsCalled(scaled), (x,))})
    variants = {**before, **after}
    assert isinstance(variants["before"][0], jax.stages.Compiled) and variants["as called"][0].fn is scaled
    assert harness.compile_ahead(variants) == variants  # compiled or marked as called: kept as they are
    assert set(harness.time_interleaved(variants, rounds=1, reps=1)) == {"before", "after", "as called"}
    outputs = {name: np.asarray(fn(*args)) for name, (fn, args) in variants.items()}
    np.testing.assert_array_equal(outputs["before"], [0, 2, 4, 6])
    np.testing.assert_array_equal(outputs["after"], [0, 3, 6, 9])
    np.testing.assert_array_equal(outputs["as called"], [0, 3, 6, 9])


def test_tables_and_the_result_file(tmp_path, capsys):
    assert harness.table(["batch", "variant", "ms"], [(8, "float32", "0.120"), (8, "int8ify", "")]) == [
        "| batch | variant | ms |", "|---|---|---|", "| 8 | float32 | 0.120 |", "| 8 | int8ify |  |"]
    path = tmp_path / "results" / "run.md"
    report = harness.Report(path)
    report.add("header", *harness.table(["a", "b"]))
    report.save()  # the folder made; the file rewritten by each save, so a stopped run keeps its finished parts
    assert path.read_text() == "header\n| a | b |\n|---|---|\n"
    report.add(harness.table_row([1, 2.5]))
    report.save()
    assert path.read_text() == "header\n| a | b |\n|---|---|\n| 1 | 2.5 |\n"
    printed = capsys.readouterr().out.splitlines()
    assert [line for line in printed if not line.startswith("saved to")] == path.read_text().splitlines()
    harness.Report().save()  # no result file: printed only
    assert capsys.readouterr().out == ""


def test_the_header_names_the_device_cpu_and_versions():
    line = harness.environment(("flax", "no-such-distribution"))
    assert line.startswith(f"device: {jax.devices()[0].device_kind}; CPU: ")
    assert f"{os.cpu_count()} cores" in line and re.search(r"\((AMX-INT8|no AMX)\)", line)
    assert f"JAX {jax.__version__}, jaxlib {jaxlib.__version__}" in line
    assert line.endswith(f"; flax {harness.package_version('flax')}") and "no-such-distribution" not in line


# -- speed.py, overhead.py, kernels.py, deploy.py -------------------------------------------------------------------
def test_speed_benchmark_times_each_variant_and_reads_its_error(load_benchmark):
    """The MLP's rows and the compile times at toy sizes (the whole script: the slow dry run below)."""
    speed = load_benchmark("speed")
    params = speed.init_mlp(jax.random.PRNGKey(0), 64, 4)
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 64))
    rows = speed.bench_model("MLP", speed.mlp, params, x, speed.hand_mlp, speed.hand_mlp_weights(params), 1, 1)
    assert [(model, batch, variant) for model, batch, variant, *_ in rows] == [
        ("MLP", 8, variant) for variant in ("float32", "int8ify", "int8ify+qparams", "hand W8A8", "bare int8 dots")]
    values = {variant: (ms, speed_, over_bare, error) for _, _, variant, ms, speed_, over_bare, error in rows}
    assert values["float32"][1] == 1.0 and values["float32"][3] == 0.0
    assert values["bare int8 dots"][2] == 1.0 and math.isnan(values["bare int8 dots"][3])
    for variant, (ms, speed_, over_bare, error) in values.items():
        assert ms > 0 and speed_ == pytest.approx(values["float32"][0] / ms), variant
        assert over_bare == pytest.approx(ms / values["bare int8 dots"][0]), variant
    for variant in ("int8ify", "int8ify+qparams", "hand W8A8"):  # int8 rounding: an error, and a small one
        assert 1e-4 < values[variant][3] < 0.05, (variant, values[variant])
    compile_seconds = speed.compile_times(2, 64)
    assert list(compile_seconds) == ["jit(float32)", "jit(int8ify): trace + rewrite + compile",
                                     "quantize_params (preparation)",
                                     "jit(int8ify) with qparams: trace + rewrite + compile"]
    assert all(seconds > 0 for seconds in compile_seconds.values())


@pytest.mark.slow
def test_speed_benchmark_dry_run(load_benchmark, tmp_path):
    speed = load_benchmark("speed")
    out = tmp_path / "speed.md"
    assert speed.main(["--dry-run", "--out", str(out), "--plot", str(tmp_path / "speed.png")]) == 0
    text = out.read_text()
    assert text.startswith("device: ") and (tmp_path / "speed.png").stat().st_size > 0
    for model in ("MLP 4x64", "transformer block"):
        rows = {row[2]: row[3:] for row in table_rows(text, model)}
        assert list(rows) == ["float32", "int8ify", "int8ify+qparams", "hand W8A8", "bare int8 dots"], model
        assert rows["float32"][1] == "1.00x" and float(rows["float32"][3]) == 0
        for variant in ("int8ify", "int8ify+qparams", "hand W8A8"):
            assert 1e-4 < float(rows[variant][3]) < 0.05, (model, variant, rows[variant])
    quantized = float(re.search(r"quantized [\d,]+ \((\d\.\d+)x\)", text).group(1))
    assert 0.25 < quantized < 0.35  # int8 codes, their scales and float biases: about a quarter of float32's bytes
    assert "| 6-layer MLP (width 64) | seconds |" in text
    assert "| jit(int8ify) with qparams: trace + rewrite + compile | " in text


def test_overhead_benchmark_dry_run(load_benchmark, tmp_path):
    overhead = load_benchmark("overhead")
    out = tmp_path / "overhead.md"
    assert overhead.main(["--dry-run", "--repeats", "1", "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line[2:-2].split(" | ") for line in text.splitlines()[5:] if line.startswith("| ")]
    assert [row[0].strip() for row in rows] == [
        "4-layer MLP: rewrite vs make_jaxpr", "2-layer Flax MLP: first call", "the same, weights from quantize_params",
        "the same, hand-written W8A8 (the floor)", "the same, hand-written W8A8, weights quantized once",
        "2-layer MLP: report vs float first call", "report vs int8ify first call (the floor)",
        "4x128 MLP, closed-over weights: first call"]
    assert [row[4] for row in rows] == ["5.0x", "1.5x", "2.0x", "", "", "2.0x", "", "1.5x"]  # the floors: none
    assert all(float(base) > 0 and float(measured) > 0 and ratio.endswith("x") for _, base, measured, ratio, _ in rows)
    assert re.search(r"quantized params: -?\d+\.\d us; the same \d+ arrays as a list: -?\d+\.\d us", text)


def test_kernels_benchmark_splits_each_variant_into_its_int8_dots_and_the_rest(load_benchmark, tmp_path):
    kernels = load_benchmark("kernels")
    out = tmp_path / "kernels.md"
    assert kernels.main(["--quick", "--batches", "8", "--width", "256", "--out", str(out)]) == 0
    rows = {row[1]: row[2:] for row in table_rows(out.read_text(), "8")}
    assert list(rows) == ["floor", "hand W8A8", "int8ify+qparams", "int8ify static", "int8ify (weights/call)"]
    for name, (wall, dots, passes, _) in rows.items():
        assert float(wall) > 0 and float(dots) > 0 and float(passes) > 0, name  # the four int8 dots were found
    # quantizing 256K float weights every call costs more than the floor's bias and gelu on 8 rows
    assert float(rows["int8ify (weights/call)"][2]) > float(rows["floor"][2])


def test_deploy_benchmark_checkpoint_bytes_and_exported_programs(load_benchmark, tmp_path):
    """Every format's bytes against float32's (int8 about a quarter, int4 about an eighth, plus their scales), and
    the program exported for any batch compiling, at each batch, to as many kernels as the one traced there."""
    deploy = load_benchmark("deploy")
    params = deploy.mlp_params(2, 256)
    x = np.zeros((8, 256), np.float32)
    report = harness.Report()
    deploy.checkpoint_costs(report, params, x, tmp_path)
    deploy.exported_program_costs(report, deploy.quantize_params(deploy.mlp, params, x), 256, [1, 8])
    text = "\n".join(report.lines)
    for weights, most in (("float32", 1.05), ("int8", 0.3), ("int4 (W4A8)", 0.17)):
        for kind in ("Orbax", "SafeTensors"):
            [row] = [row for row in table_rows(text, weights) if row[1] == kind]
            assert float(row[3].rstrip("x")) <= most and float(row[4]) > 0, row
    for batch in (1, 8):
        [row] = table_rows(text, str(batch))
        any_batch, traced = row[1].split(" / ")
        assert any_batch == traced and int(traced) > 0, row


@pytest.mark.slow
def test_deploy_benchmark_prints_bytes_load_times_and_peak_memory(load_benchmark, tmp_path, capsys):
    """At a small size: every format's bytes and load time, quantize_params' peak memory within float params
    + quantized copy + one layer's temporaries (the exit code says so), and the exported program's kernels."""
    deploy = load_benchmark("deploy")
    assert deploy.main(["--layers", "6", "--width", "2048", "--out", str(tmp_path), "--batches", "1,8"]) == 0
    printed = capsys.readouterr().out
    for weights in ("float32", "int8", "int4 (W4A8)"):
        for kind in ("Orbax", "SafeTensors"):
            assert f"| {weights} | {kind} | " in printed
    # the program exported for any batch compiles, at each batch, to as many kernels as the one traced there
    for batch in (1, 8):
        kernels = re.search(rf"^\| {batch} \| (\d+) / (\d+) \| ", printed, re.M)
        assert kernels and kernels.group(1) == kernels.group(2), printed
    assert "MALLOC_MMAP_THRESHOLD_=1MiB: " in printed and ": within float + quantized + one layer" in printed


# -- peers.py -------------------------------------------------------------------------------------------------------
def test_peers_benchmark_runs_and_names_the_machine(tmp_path, peers):
    out = tmp_path / "peers.md"
    assert peers.main(["--quick", "--batches", "1", "--repeats", "2", "--pairs", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("device: ") and f"JAX {jax.__version__}" in text and "flax " in text
    for variant in ("float32", "hand W8A8", "int8ify+qparams", "int8ify static", "int8ify eager",
                    "int8ify closed over", "floor", "floor + NaN check", "floor, int8 input"):
        assert f"| 1 | {variant} |" in text, variant
    # at batch 1 only the targets for every batch are read: against the hand-written program (and the peers)
    assert "| weights quantized once: at most the hand-written program's time | 1 | " in text
    assert "the median of 2 such measurements" in text and " of 2 |" in text  # --repeats 2: a count per target
    assert "within 1.25x of the floor" not in text and "at least float32's speed" not in text
    pairs = text.split("timed in pairs")[1]  # --pairs 1: the same targets, each with its baselines one by one
    assert "| weights quantized once: at most the hand-written program's time | 1 | " in pairs
    assert "x hand W8A8 |" in pairs and "within 1.25x of the floor" not in pairs


def test_the_eager_variant_gets_a_new_input_array_each_call(peers):
    """An eager call keeps the codes of every array handed to it twice, the input's too: the benchmark hands its
    input as a new array on the same values each call, so only the weights' codes are reused, as in real use."""
    model, params = peers.flax_mlp(64)
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 64))
    again = peers.new_array(x)
    assert again is not x and again.dtype == x.dtype and np.array_equal(again, x)
    eager = int8ify(model.apply)
    for _ in range(3):
        eager(params, peers.new_array(x))
    assert len(eager._weights._entries) == 4  # the four weights (the inputs, dropped with their arrays, are not)
    eager(params, x)
    eager(params, x)
    assert len(eager._weights._entries) == 5  # the same input array twice: its codes are kept too


def test_the_floor_converts_the_float_input_and_owns_its_weights(peers):
    """The floor is the model's int8 dots with its bias and gelu, every dot's input a cast to int8 (the float input's
    too); the bare dots get copies of the codes, so neither finds the other's weights warm in the cache."""
    model, params = peers.flax_mlp(64)
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 64)) * 3
    (floor, (fx, codes, biases)), (bare, (bx, bare_codes)) = peers.floor_program(params, x)
    assert fx.dtype == np.float32 and bx.dtype == np.int8
    assert all(a is not b and np.array_equal(a, b) for a, b in zip(codes, bare_codes))

    def cast(v):  # XLA's float -> int8 conversion: toward zero, saturating
        return np.clip(np.trunc(v), -128, 127)

    h = cast(np.asarray(x, np.float64))
    for i, (w, b) in enumerate(zip(codes, biases)):
        h = h @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
        if i < peers.LAYERS - 1:
            h = cast(np.asarray(jax.nn.gelu(h.astype(np.float32)), np.float64))
    np.testing.assert_allclose(np.asarray(floor(fx, codes, biases)), h, rtol=1e-5, atol=1e-3)


def test_peers_speed_targets_compare_with_the_fastest_baseline_measured(peers):
    times = {256: [{"float32": 6.0, "Qwix PTQ": 4.2, "AQT SERVE": 4.0, "hand W8A8": 4.1, "int8ify+qparams": 4.4,
                    "int8ify static": 4.3, "int8ify (weights/call)": 5.0, "floor": 4.0}],
             1: [{"float32": 0.4, "hand W8A8": 0.7, "int8ify+qparams": 0.35, "floor": 0.7}]}
    rows = [line.split(" | ") for line in peers.target_lines(times)[2:]]
    table = {(row[0].lstrip("| "), int(row[1])): (row[2], row[3].rstrip(" |")) for row in rows}
    assert table[("weights quantized once: at most the best peer's time", 256)] == ("1.10 x AQT SERVE", "no")
    hand = "weights quantized once: at most the hand-written program's time"
    assert table[(hand, 256)] == ("1.07 x hand W8A8", "no")
    assert table[("weights quantized once: within 1.25x of the floor", 256)] == ("1.10 x floor", "yes")
    assert table[("static activation scales: within 1.1x of the floor", 256)] == ("1.07 x floor", "yes")
    assert table[("weights quantized on every call: at least float32's speed", 256)] == ("0.83 x float32", "yes")
    assert table[(hand, 1)] == ("0.50 x hand W8A8", "yes")
    # batch 1: no peer measured, below the floor targets' and the per-call target's batches
    assert {key for key in table if key[1] == 1} == {(hand, 1)}


def test_peers_speed_targets_over_repeated_measurements_give_range_median_and_count(peers):
    runs = [{"Qwix PTQ": 4.0, "AQT SERVE": 4.4, "hand W8A8": 4.1, "int8ify+qparams": 3.9, "floor": 3.0},
            {"Qwix PTQ": 4.4, "AQT SERVE": 4.0, "hand W8A8": 4.0, "int8ify+qparams": 4.2, "floor": 3.5},
            {"Qwix PTQ": 4.0, "AQT SERVE": 4.2, "hand W8A8": 4.0, "int8ify+qparams": 4.1, "floor": 3.4}]
    rows = [line.split(" | ") for line in peers.target_lines({256: runs})[2:]]
    table = {row[0].lstrip("| "): (row[2], row[3].rstrip(" |")) for row in rows}
    # 3.9 / 4.0, 4.2 / 4.0, 4.1 / 4.0: the fastest peer of each measurement, both named
    assert table["weights quantized once: at most the best peer's time"] == (
        "0.97-1.05 (median 1.02) x Qwix PTQ / AQT SERVE", "1 of 3")
    assert table["weights quantized once: within 1.25x of the floor"] == ("1.20-1.30 (median 1.21) x floor", "2 of 3")


def test_peers_pairs_time_the_variant_with_each_baseline_alone_orders_alternating(peers, monkeypatch):
    rounds = []

    def timed(fns, rounds_, reps):  # the variant 10% slower than either peer, whatever the order
        rounds.append(list(fns))
        return {name: 1.1 if name == "int8ify+qparams" else 1.0 for name in fns}

    monkeypatch.setattr(peers, "time_interleaved", timed)
    variants = dict.fromkeys(["Qwix PTQ", "AQT SERVE", "hand W8A8", "int8ify+qparams", "floor"], (None, ()))
    best_peer, _, floor = peers.TARGETS[:3]
    ratios = peers.pair_ratios(variants, best_peer, 256, 3, 25, 5)
    assert rounds == [["int8ify+qparams", "Qwix PTQ"], ["Qwix PTQ", "int8ify+qparams"], ["int8ify+qparams", "Qwix PTQ"],
                      ["int8ify+qparams", "AQT SERVE"], ["AQT SERVE", "int8ify+qparams"],
                      ["int8ify+qparams", "AQT SERVE"]]
    assert {name: [round(r, 6) for r in values] for name, values in ratios.items()} == {
        "Qwix PTQ": [1.1] * 3, "AQT SERVE": [1.1] * 3}
    assert peers.pair_ratios(variants, floor, 8, 3, 25, 5) == {}  # below the floor target's batches


def test_peers_pair_table_holds_where_every_baselines_median_is_within_the_factor(peers):
    best_peer, _, floor = peers.TARGETS[:3]
    readings = {(best_peer, 256): {"Qwix PTQ": [1.04, 0.98, 1.01], "AQT SERVE": [0.97, 0.99, 0.95]},
                (floor, 256): {"floor": [1.3, 1.2, 1.1]}, (floor, 8): {}}
    rows = [line.split(" | ") for line in peers.pair_lines(readings)[2:]]
    assert [row[2] for row in rows] == ["0.98-1.04 (median 1.01) x Qwix PTQ; 0.95-0.99 (median 0.97) x AQT SERVE",
                                        "1.10-1.30 (median 1.20) x floor"]
    assert [row[3].rstrip(" |") for row in rows] == ["no", "yes"]  # slower than Qwix's median; within 1.25x


def test_peers_bf16_targets_are_read_only_where_bf16_was_measured(peers):
    cpu = {"float32": 2.0, "int8ify+qparams": 1.0, "int8ify static": 0.9, "int8ify (weights/call)": 1.5, "floor": 0.8}
    accelerator = {**cpu, "bf16": 1.2}
    on_cpu = {line.split(" | ")[0].lstrip("| ") for line in peers.target_lines({64: [cpu]})[2:]}
    on_accelerator = [line.split(" | ") for line in peers.target_lines({64: [accelerator]})[2:]]
    assert not any("bf16" in text for text in on_cpu)
    against_bf16 = {row[0].lstrip("| "): (row[2], row[3].rstrip(" |")) for row in on_accelerator if "bf16" in row[0]}
    assert against_bf16 == {"weights quantized once: at most bf16's time": ("0.83 x bf16", "yes"),
                            "static activation scales: at most bf16's time": ("0.75 x bf16", "yes"),
                            "weights quantized on every call: at least bf16's speed": ("1.25 x bf16", "no")}


def test_accelerator_targets_read_off_kernel_counts_and_cycles(load_benchmark):
    accelerators = load_benchmark("accelerators")
    gpu = accelerators.gpu_target_lines({"MLP": {"bf16": 7, "hand W8A8": 13, "int8ify+qparams": 13,
                                                 "int8ify static": 9, "bare int8 dots": 4}}, {"MLP": 4})
    assert gpu[2:] == ["| MLP | int8ify+qparams | 13 | 11 | no |", "| MLP | int8ify static | 9 | 11 | yes |"]
    tpu = accelerators.tpu_target_lines({
        ("MLP", "v5e"): {"bf16": 100, "bf16, f32 input": 104, "hand W8A8": 160, "int8ify+qparams": 180,
                         "int8ify static": 101},
        ("MLP", "v6e"): {"bf16": 50, "hand W8A8": 100, "int8ify static": 70}})
    # v5e asks for bf16's cycles as well as the hand-written program's; v6e only for the latter. The bf16 program
    # handed float32 input is a column for comparison, not a target
    assert tpu[2:] == ["| MLP | v5e | int8ify+qparams | 1.12 | 1.80 | 1.73 | no |",
                       "| MLP | v5e | int8ify static | 0.63 | 1.01 | 0.97 | no |",
                       "| MLP | v6e | int8ify static | 0.70 | 1.40 | - | yes |"]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["gpu", "tpu"])
def test_accelerators_benchmark_dry_run_under_a_deviceless_compiler(which, tmp_path):
    python = os.environ.get(f"INT8IFY_{which.upper()}_COMPILE_PYTHON")
    if not python:
        pytest.skip(f"INT8IFY_{which.upper()}_COMPILE_PYTHON names no deviceless {which.upper()} compiler's Python")
    out = tmp_path / "accelerators.md"
    done = subprocess.run([python, str(ROOT / "benchmarks" / "accelerators.py"), f"--{which}", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("device: ") and f"deviceless {which.upper()} compile" in text
    models = ("MLP 4x128, batch 64", "transformer block d 64, batch 2x16")
    assert all(f"| {model} | " in text.split("Targets:")[1] for model in models)


# -- llm.py ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def llm_one_layer(load_benchmark, monkeypatch):
    """``benchmarks/llm.py`` with its dry run's toy decoder cut to one layer (half its compile time)."""
    llm = load_benchmark("llm")
    monkeypatch.setattr(llm, "DRY_RUN", llm.DRY_RUN._replace(config=dataclasses.replace(llm.TOY, n_layers=1)))
    return llm


@pytest.mark.filterwarnings("ignore:'VariableState' was removed:DeprecationWarning")  # qwix's own use of flax
def test_llm_benchmark_dry_run_has_every_variants_column_and_its_checks(llm_one_layer, tmp_path):
    """One toy decode workload: the summary has every variant's column (Qwix's saying so where qwix is missing);
    every int8 variant's first logits are near bf16's and not equal to them; the int8 cache is about half of
    bf16's; the int8 cache variants' steps make no float pass over the cache, where the one wrapped as written
    quantizes it on every call; int8ify's dots are all int8, traced and compiled."""
    llm = llm_one_layer
    out = tmp_path / "llm.md"
    assert llm.main(["--dry-run", "--workloads", "decode-b1-c128", "--rounds", "1", "--reps", "1",
                     "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("device: ")
    summary = text.split("### Summary")[1]
    assert "| workload | bf16 ms | " + " | ".join(llm.INT8_VARIANTS) + " |" in summary
    [cells] = table_rows(summary, "decode-b1-c128")
    assert float(cells[1]) > 0
    qwix = harness.package_version("qwix")
    for name, cell in zip(llm.INT8_VARIANTS, cells[2:]):
        assert cell == "qwix not installed" if name.startswith("Qwix") and not qwix else re.fullmatch(
            r"\d+\.\d\dx", cell), (name, cell)
    assert "holds for every variant measured" in summary

    rows = {}
    for name in llm.VARIANTS:
        [row] = table_rows(text.split("### decode")[1].split("### Summary")[0], name)
        rows[name] = dict(zip(["ms", "speed", "error", "cache", "compile", "dots", "passes", "warned"], row[1:]))
    assert float(rows["bf16"]["error"]) == 0 and rows["bf16"]["dots"] == "0/10 / 0/10"
    measured = [name for name in llm.INT8_VARIANTS if qwix or not name.startswith("Qwix")]
    for name in measured:  # int8 rounding: an error, and a small one
        assert 1e-3 < float(rows[name]["error"]) < 0.1, (name, rows[name])
    for name in (llm.WRAPPED, llm.QPARAMS, llm.STATIC):
        assert rows[name]["dots"] == "10/10 / 10/10", (name, rows[name])
    kib = {name: float(rows[name]["cache"].removesuffix(" KiB")) for name in measured + ["bf16"]}
    assert kib["bf16"] == 64  # 1 layer x (k, v) x 128 tokens x 2 heads x 64 x 2 bytes
    assert 0.5 < kib[llm.QPARAMS] / kib["bf16"] == kib[llm.STATIC] / kib["bf16"] < 0.6  # codes + per-token scales
    assert rows[llm.QPARAMS]["passes"] == rows[llm.STATIC]["passes"] == "0" and int(rows[llm.WRAPPED]["passes"]) > 0


def test_llm_benchmark_int8_cache_variant_reads_the_cache_as_int8_codes(llm_one_layer):
    """The program of ``int8ify + quantize_params + int8 cache`` at a toy decode: every array of the cache's shape
    in it is int8 (no float copy of the cache, so none quantized per call), and both attention dots read such an
    array; the variant wrapped as written makes float arrays of that shape."""
    llm = llm_one_layer
    sizes = llm.DRY_RUN
    params = llm.llama.random_params(sizes.config, 0, jnp.bfloat16)
    variants = llm.make_variants(sizes, params, names=[llm.WRAPPED, llm.QPARAMS])
    workload = llm.Workload("decode", 2, 64)
    cache = llm.initial_cache(sizes.config, workload, 0)
    shape = (2, 64, sizes.config.n_kv_heads, sizes.config.head_dim)
    tokens, position = llm.random_tokens(sizes.config, workload, 0), jnp.int32(60)

    def cache_shaped(name):
        variant = variants[name]
        jaxpr = jax.make_jaxpr(variant.step)(variant.params, tokens, variant.prepare_cache(cache), position)
        return jaxpr, [v for eqn in iter_eqns(jaxpr) for v in eqn.outvars if tuple(v.aval.shape) == shape]

    jaxpr, arrays = cache_shaped(llm.QPARAMS)
    assert arrays and all(v.aval.dtype == np.int8 for v in arrays)  # the codes' writes, nothing else
    attention = [eqn for eqn in dot_eqns(jaxpr) if any(tuple(v.aval.shape) == shape for v in eqn.invars)]
    assert len(attention) == 2 and all(v.aval.dtype == np.int8 for eqn in attention for v in eqn.invars)
    _, arrays = cache_shaped(llm.WRAPPED)
    assert any(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in arrays)


def test_llm_benchmark_counts_int8_dots_in_either_hlo_text_format(load_benchmark):
    """Compiled HLO names a dot's operands with their types beside them (as on TPU) or bare (XLA:CPU), their types
    on the lines that define them; a dot is int8 when both are s8, a convolution counts as a dot."""
    llm = load_benchmark("llm")
    typed = "\n".join([
        "%p0 = s8[4,256]{1,0:T(8,128)(4,1)} parameter(0)",
        "%conv = s32[4,256]{1,0:T(8,128)} convolution(s8[4,256]{1,0:T(8,128)(4,1)} %p0, "
        "s8[256,256]{1,0:T(8,128)(4,1)} %p1), dim_labels=bf_io->bf",
        "%mixed = f32[4,256]{1,0} dot(bf16[4,256]{1,0} %a, s8[256,256]{1,0} %b), lhs_contracting_dims={1}"])
    bare = "\n".join([
        "  %param_0.1 = s8[4,256]{1,0} parameter(0)", "  %param_1.1 = s8[256,256]{1,0} parameter(1)",
        "  %x = bf16[4,256]{1,0} parameter(2)",
        "  ROOT %dot.2 = s32[4,256]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}",
        "  %dot.3 = f32[4,256]{1,0} dot(%x, %param_1.1), lhs_contracting_dims={1}",
        "  %dot.4 = s32[4,256]{1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={1}"])
    assert llm.hlo_dots(typed) == (1, 2)
    assert llm.hlo_dots(bare) == (2, 3)
    compiled = jax.jit(int8ify(lambda w, x: x @ w)).lower(jnp.ones((256, 128)), jnp.ones((4, 256))).compile()
    assert llm.hlo_dots(compiled.as_text()) == (1, 1)
