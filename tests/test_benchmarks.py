"""The public benchmarks under ``benchmarks/``: each runs at a small size, and what they read off their times."""

import re
import sys

import jax
import numpy as np
import pytest
from conftest import ROOT

from jaxpr_rewrite import int8ify


@pytest.fixture
def peers(monkeypatch):
    """``benchmarks/peers.py``, imported afresh from beside this checkout's benchmarks."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("peers", None)
    import peers

    return peers


def test_peers_benchmark_runs_and_names_the_machine(tmp_path, peers):
    out = tmp_path / "peers.md"
    assert peers.main(["--quick", "--batches", "1", "--repeats", "2", "--pairs", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("CPU: ") and f"JAX {jax.__version__}" in text
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


def test_kernels_benchmark_splits_each_variant_into_its_int8_dots_and_the_rest(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("kernels", None)
    import kernels

    out = tmp_path / "kernels.md"
    assert kernels.main(["--quick", "--batches", "8", "--out", str(out)]) == 0
    rows = {line.split(" | ")[1]: line.split(" | ")[2:] for line in out.read_text().splitlines()
            if line.startswith("| 8 | ")}
    assert list(rows) == ["floor", "hand W8A8", "int8ify+qparams", "int8ify static", "int8ify (weights/call)"]
    for name, (wall, dots, passes, _) in rows.items():
        assert float(wall) > 0 and float(dots) > 0 and float(passes) > 0, name  # the four int8 dots were found
    # quantizing 4M float weights every call costs more than the floor's bias and gelu on 8 rows
    assert float(rows["int8ify (weights/call)"][2]) > float(rows["floor"][2])


def test_deploy_benchmark_prints_bytes_load_times_and_peak_memory(tmp_path, monkeypatch, capsys):
    """At a small size: every format's bytes and load time, quantize_params' peak memory within float params
    + quantized copy + one layer's temporaries (the exit code says so), and the exported program's kernels."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("deploy", None)
    import deploy

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


def test_accelerator_targets_read_off_kernel_counts_and_cycles(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    sys.modules.pop("accelerators", None)
    import accelerators

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
