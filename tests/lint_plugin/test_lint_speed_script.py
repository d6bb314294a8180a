"""``benchmarks/lint_speed.py``: a relative corpus path is linted (not silently skipped), and a
directory without Python files is an error, not a bogus ratio."""

from __future__ import annotations

import subprocess
import sys

from lint_helpers import REPO_ROOT, flake8_env

SCRIPT = REPO_ROOT / "benchmarks" / "lint_speed.py"


def _run(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=flake8_env(),
                          capture_output=True, text=True, timeout=300)


def test_directory_without_python_files_exits_2_with_one_sentence(tmp_path):
    (tmp_path / "empty").mkdir()
    result = _run("empty", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().count("\n") == 0 and "no .py files under" in result.stderr
    assert str(tmp_path / "empty") in result.stderr  # the resolved path, not the relative one


def test_relative_corpus_path_is_linted(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "mod.py").write_text("import jax\n\n\n@jax.jit\ndef f(x, w):\n    return x @ w\n")
    result = _run("corpus", "--repeats", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "corpus: 1 files, 6 lines" in result.stdout
    assert "flake8 --select=JX: 1 flags" in result.stdout and "JX101  1" in result.stdout
