"""examples/minilm/run.py as a command: usage errors up front, progress, truncation warnings, outputs that are
never lost, and the report's figure. The full runs use two or three sentences so they stay fast. And
examples/minilm/deploy.py: the encoder saved with quantized weights, then loaded and run from the file alone.

Needs the model package and its readers, as tests/examples/test_minilm.py.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from minilm_packages import require_minilm_packages

require_minilm_packages()


@pytest.fixture(scope="module")
def run(load_example):
    return load_example("minilm/run.py")


@pytest.fixture
def no_model_work(run, monkeypatch):
    """Makes loading the model fail loudly, so a test sees that an error was found before any model work."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(run.minilm, "load_params", refuse)


def _write(path, content: bytes):
    path.write_bytes(content)
    return path


# -- usage errors: one sentence on stderr, exit status 2, before the model is loaded ---------------------------

BAD_SENTENCE_FILES = {
    "empty": (b"", "is empty"),
    "blank": (b"  \n", "is empty"),
    "invalid JSON": (b'["a", ', "is not valid JSON"),
    "not UTF-8": ('["caf\u00e9"]'.encode("latin-1"), "is not UTF-8 text"),
    "an object": (b'{"text": "a"}', "holds a JSON dict, not a list of strings"),
    "a non-string item": (b'["a", 3]', "item 1 is a JSON int, not a string"),
    "an empty list": (b"[]", "holds an empty list: nothing to embed"),
}


@pytest.mark.parametrize("case", list(BAD_SENTENCE_FILES))
def test_bad_sentences_file_is_a_usage_error(run, no_model_work, tmp_path, capsys, case):
    content, expected = BAD_SENTENCE_FILES[case]
    path = _write(tmp_path / "s.json", content)
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--sentences", str(path), "--out", str(tmp_path / "e.npz")])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "error: " in captured.err and expected in captured.err, captured.err
    assert captured.out == "" and "wrote" not in captured.err
    assert not (tmp_path / "e.npz").exists()


@pytest.mark.parametrize("args, expected", [
    (["--sentences", "{tmp}/missing.json"], "does not exist"),
    (["--out", "{tmp}/no/such/dir/e.npz"], "directory {tmp}/no/such/dir does not exist"),
    (["--out", "{tmp}/folder.npz"], "is a directory"),
    (["--batch-size", "0"], "--batch-size must be positive, got 0"),
    (["--repeats", "-1"], "--repeats must be positive, got -1"),
    (["--bench-batches", "32", "0"], "--bench-batches must be positive"),
    (["--smooth-alpha", "1.5"], "--smooth-alpha must be at most 1"),
    (["--plot", "{tmp}/figure.jpg"], "must end in .png, .svg, .pdf"),
])
def test_bad_arguments_are_usage_errors(run, no_model_work, tmp_path, capsys, args, expected):
    (tmp_path / "folder.npz").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        run.main([arg.format(tmp=tmp_path) for arg in args])
    assert exit_info.value.code == 2
    assert expected.format(tmp=tmp_path) in capsys.readouterr().err


def test_usage_error_exits_2_when_run_as_a_script(run_example, no_model_work, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_example("minilm/run.py", ["--sentences", str(tmp_path / "missing.json")])
    assert exit_info.value.code == 2
    assert "missing.json does not exist" in capsys.readouterr().err


def test_read_sentences_accepts_a_byte_order_mark(run, tmp_path):
    path = _write(tmp_path / "s.json", "\ufeff".encode() + json.dumps(["caf\u00e9", ""]).encode())
    assert run.read_sentences(path) == ["caf\u00e9", ""]


def test_out_path_is_the_file_numpy_writes(run, tmp_path):
    assert run.npz_path(tmp_path / "emb") == tmp_path / "emb.npz"
    assert run.npz_path(tmp_path / "emb.npy") == tmp_path / "emb.npy.npz"
    assert run.npz_path(tmp_path / "emb.npz") == tmp_path / "emb.npz"
    np.savez(tmp_path / "emb", x=np.zeros(1))
    assert (tmp_path / "emb.npz").is_file()


def test_fallback_save_never_overwrites(run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "e.npz").write_bytes(b"earlier work")
    f32 = np.ones((1, 384), np.float32)
    written = run.save_with_fallback(tmp_path / "missing" / "e.npz", f32, f32, ["a"])
    assert written == tmp_path / "e-1.npz" and np.load(written)["sentences"].tolist() == ["a"]
    assert (tmp_path / "e.npz").read_bytes() == b"earlier work"
    assert f"saved the embeddings to {written} instead" in capsys.readouterr().err


def test_figure_that_cannot_be_written_is_reported(run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "a_file").write_text("")
    layers = [run.LayerError("layer_0", 0.01, 8, "ffn/output", 0.02)]
    assert not run.write_figure(tmp_path / "a_file" / "report.png", np.array([0.99, 1.0]), layers, "t")
    assert "could not write the figure" in capsys.readouterr().err


# -- report pieces ----------------------------------------------------------------------------------------------


def test_similarity_metrics_need_three_sentences(run):
    rng = np.random.default_rng(0)
    f32 = rng.normal(size=(3, 8))
    i8 = f32 + 1e-3 * rng.normal(size=(3, 8))
    two = "\n".join(run.accuracy_lines(["a", "b"], f32[:2], i8[:2]))
    assert two.count("n/a (needs at least 3 sentences)") == 2 and "nan" not in two
    three = "\n".join(run.accuracy_lines(["a", "b", "c"], f32, i8))
    assert "n/a" not in three and "3 pairs): " in three and "(3/3)" in three


def test_layer_errors_are_the_rms_of_each_layers_int8_dots(run):
    def row(scope, error, rewritten=True):
        return SimpleNamespace(scope=scope, error=error, rewritten=rewritten)

    rows = [
        row("layer_10/ffn/output", 0.5),
        row("layer_2/attention/query", 0.03),
        row("layer_2/attention/key", 0.04),
        row("layer_2/attention/value", 9.0, rewritten=False),  # kept in float: costs nothing
        row("layer_2/ffn/output", None),  # not measured
        row("pooling", 7.0),  # outside the encoder layers
    ]
    layers = run.layer_errors(rows)
    assert [entry.layer for entry in layers] == ["layer_2", "layer_10"]  # numeric order
    assert layers[0].rms == pytest.approx(np.sqrt((0.03 ** 2 + 0.04 ** 2) / 2))
    assert (layers[0].dots, layers[0].worst_scope, layers[0].worst_error) == (2, "attention/key", 0.04)
    assert layers[1].rms == pytest.approx(0.5)
    table = run.layer_error_lines(layers, 8)
    assert len(table) == 4 and table[2].split()[:3] == ["layer_2", "3.54e-02", "2"]


def test_report_figure_holds_the_histogram_and_the_layer_bars(run):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    cosines = np.array([0.991, 0.995, 0.998, 0.998, 0.999, 0.9995, 0.9996, 0.9998, 0.9999, 0.99995])
    layers = [run.LayerError(f"layer_{i}", 0.01 * (i + 1), 8, "ffn/output", 0.02) for i in range(3)]
    fig = run.plot_report(cosines, layers, "test")
    try:
        hist_ax, layer_ax = fig.axes
        heights = [patch.get_height() for patch in hist_ax.patches]
        assert len(heights) == run.histogram_bins(len(cosines)) == 10
        assert heights == np.histogram(cosines, bins=10)[0].tolist() and sum(heights) == len(cosines)
        marked = sorted(line.get_xdata()[0] for line in hist_ax.get_lines())
        assert marked == pytest.approx([cosines.min(), cosines.mean()])
        assert [patch.get_height() for patch in layer_ax.patches] == pytest.approx([0.01, 0.02, 0.03])
        assert [label.get_text() for label in layer_ax.get_xticklabels()] == ["layer_0", "layer_1", "layer_2"]
    finally:
        plt.close(fig)


# -- full runs on a few sentences -------------------------------------------------------------------------------


def test_run_reports_progress_warns_on_truncation_and_writes_its_outputs(run, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    long_sentence = "word " * 300
    sentences = _write(tmp_path / "s.json", json.dumps(
        ["A man is playing a guitar.", long_sentence, "A musician plays the guitar."]).encode())
    code = run.main(["--sentences", str(sentences), "--batch-size", "2", "--out", "emb",
                     "--plot", str(tmp_path / "figures" / "report.png"),
                     "--bench", "--bench-batches", "1", "--repeats", "1"])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, captured.err

    # one warning, on stderr, naming the index and token count of the one sentence that is cut
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: sentences[1] has 302 tokens, more than the model's limit of 256: only its "
                        "first 256 are embedded"]

    # stage lines carry the elapsed time, and the report comes before the speed part
    stages = ["] loading weights", "] quantizing weights", "] embedding 3 sentences in float32",
              "] embedding 3 sentences in int8", "] wrote emb.npz:", "cosine(int8, float32)",
              "nearest-neighbour agreement: ", "] measuring the int8 error of every dot on 3 sentences",
              "int8 error per encoder layer", f"] wrote {tmp_path / 'figures' / 'report.png'}",
              "fixed sequence of 128 tokens", "] timing batch 1", "] done"]
    positions = [out.find(stage) for stage in stages]
    assert -1 not in positions and positions == sorted(positions), dict(zip(stages, positions))
    assert "(longest 302 tokens, cut at 256;" in out

    # --out without .npz: written to, and reported as, name.npz
    data = np.load(tmp_path / "emb.npz")
    assert data["float32"].shape == data["int8"].shape == (3, 384)
    assert [str(s) for s in data["sentences"]][0] == "A man is playing a guitar."
    assert not (tmp_path / "emb").exists()
    assert (tmp_path / "figures" / "report.png").stat().st_size > 0
    assert not (tmp_path / run.DEFAULT_PLOT).exists()

    layer_rows = [line for line in out.splitlines() if line.strip().startswith("layer_")]
    assert len(layer_rows) == 6


def test_run_keeps_finished_work_when_the_out_directory_disappears(run, tmp_path, monkeypatch, capsys):
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    target = tmp_path / "gone"
    target.mkdir()
    real_embed = run.minilm.embed
    calls = []

    def embed_then_remove_the_folder(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # while the int8 pass runs, the folder goes away
            shutil.rmtree(target)
        return real_embed(*args, **kwargs)

    monkeypatch.setattr(run.minilm, "embed", embed_then_remove_the_folder)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    sentences = _write(tmp_path / "s.json", json.dumps(["Hello!", "Thanks a lot."]).encode())
    code = run.main(["--sentences", str(sentences), "--out", str(target / "e.npz")])
    captured = capsys.readouterr()

    assert code == 1
    assert f"could not write {target / 'e.npz'}" in captured.err
    assert f"saved the embeddings to {workdir / 'e.npz'} instead" in captured.err
    assert np.load(workdir / "e.npz")["int8"].shape == (2, 384)
    # without matplotlib: one line saying how to get it, and the run goes on without a figure
    assert captured.err.count("pip install -e '.[plot]'") == 1
    assert not (workdir / run.DEFAULT_PLOT).exists()
    assert captured.out.count("n/a (needs at least 3 sentences)") == 2 and "nan" not in captured.out
    assert "speed (" not in captured.out  # --sentences runs skip the speed part by default


def test_static_scales_are_reported_beside_the_dynamic_ones(run, tmp_path, capsys):
    sentences = _write(tmp_path / "s.json", json.dumps(
        ["A man is playing a guitar.", "A musician plays the guitar.", "The stock market fell today."]).encode())
    code = run.main(["--sentences", str(sentences), "--no-plot", "--static-scales",
                     "--bench", "--bench-batches", "1", "--repeats", "1"])
    out = capsys.readouterr().out
    assert code == 0
    # the speed part times the static programs beside the dynamic one
    lines = out[out.index("speed ("):].splitlines()
    assert lines[1] == ("  batch  float32 ms    int8 ms  float32/int8  static ms  float32/static  static+attn ms  "
                        "float32/static+attn")
    (row,) = [line for line in lines[2:] if line.split()[:1] == ["1"]]
    times = [float(v.rstrip("x")) for v in row.split("(")[0].split()[1:]]
    assert len(times) == 7 and all(t > 0 for t in times)
    assert np.isclose(times[0] / times[3], times[4], rtol=0.03)  # from the printed, rounded times
    assert np.isclose(times[0] / times[5], times[6], rtol=0.03)
    assert "(first call: float32 " in row and ", int8 " in row and ", static " in row and ", static+attn " in row
    block = out[out.index("activation scales (cosine"):].splitlines()[1:6]
    means = {line.split("  mean")[0].strip(): float(line.split("mean ")[1].split()[0]) for line in block}
    percentile = f"static {run.STATIC_PERCENTILE}th percentile"
    assert list(means) == ["dynamic", "static absmax", "static absmax, attention too", percentile,
                           f"{percentile}, attention too"]
    assert means["dynamic"] > 0.99 and all(0.9 < m < 1 for m in means.values())
    assert len(set(means.values())) == 5  # five different programs
    assert all("nearest neighbours" in line for line in block)


# -- deploy.py: save the quantized encoder, run it from the file alone -----------------------------------------

@pytest.fixture(scope="module")
def deploy(load_example):
    return load_example("minilm/deploy.py")


@pytest.mark.parametrize("name", ["minilm-int8.safetensors", "minilm-int8.orbax"])
def test_save_then_run_from_the_file_alone(deploy, tmp_path, capsys, monkeypatch, name):
    path = tmp_path / name
    assert deploy.main(["save", str(path)]) == 0
    saved = capsys.readouterr().out
    assert re.search(rf"wrote {re.escape(str(path))} \(int8 weights\): \d+\.\d MiB", saved), saved

    def no_float_weights(*args, **kwargs):
        raise AssertionError("run loaded the float weights")

    monkeypatch.setattr(deploy.minilm, "load_params", no_float_weights)
    assert deploy.main(["run", str(path)]) == 0
    printed = capsys.readouterr().out
    found = re.search(r"\(([\d.]+) MiB, int8 weights, int8ify\) .* cosine mean ([\d.]+), min ([\d.]+)", printed)
    assert found, printed
    size, mean, low = map(float, found.groups())
    assert size < 60  # the float32 model is 86 MiB, most of it the float word embeddings
    assert mean > 0.997 and low > 0.99


def test_4_bit_block_weights_run_with_their_block_size(deploy, tmp_path, capsys):
    path = tmp_path / "minilm-b32.safetensors"
    assert deploy.main(["save", str(path), "--bits", "4", "--block-size", "32"]) == 0
    assert deploy.main(["run", str(path)]) == 0
    printed = capsys.readouterr().out
    found = re.search(r"int4 weights, scales per block of 32, int8ify\) .* cosine mean ([\d.]+)", printed)
    assert found, printed
    assert float(found.group(1)) > 0.96  # per channel, 4-bit weights reach about 0.91


def test_run_names_a_missing_file(deploy, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        deploy.main(["run", str(tmp_path / "none.safetensors")])
    assert exit_info.value.code == 2
    assert "does not exist (write it with: deploy.py save" in capsys.readouterr().err
