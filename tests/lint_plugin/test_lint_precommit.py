"""The repository's ``.pre-commit-hooks.yaml``: the ``jx`` hook, and that its entry runs the plugin."""

from __future__ import annotations

import shlex
import subprocess
import sys
import textwrap
from typing import Dict, List

from lint_helpers import REPO_ROOT, flake8_env

HOOKS_FILE = REPO_ROOT / ".pre-commit-hooks.yaml"


def _hooks() -> List[Dict[str, str]]:
    """The hooks as ``key -> raw value`` per ``- id:`` item: enough YAML for this flat file, with no
    YAML library needed."""
    hooks: List[Dict[str, str]] = []
    for line in HOOKS_FILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("- "):
            hooks.append({})
            stripped = stripped[2:]
        key, _, value = stripped.partition(":")
        hooks[-1][key.strip()] = value.strip()
    return hooks


def test_hook_definition():
    (hook,) = _hooks()
    assert hook["id"] == "jx"
    assert hook["entry"] == "flake8 --select=JX,E9"
    assert hook["language"] == "python"
    assert hook["types"] == "[python]"
    assert hook["name"]


def _run_entry(entry: str, path, cwd) -> subprocess.CompletedProcess:
    # pre-commit runs the entry with the staged file names appended, in an environment where this
    # package (and so flake8 and the plugin) is installed; ``python -m`` stands in for the console script
    command = shlex.split(entry)
    assert command[0] == "flake8"
    return subprocess.run([sys.executable, "-m", *command, str(path)], cwd=cwd, env=flake8_env(),
                          capture_output=True, text=True, timeout=120)


def test_hook_entry_runs_the_plugin(tmp_path):
    (hook,) = _hooks()
    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent('''\
        import jax


        @jax.jit
        def f(x, w):
            return x @ w
    '''))
    good = tmp_path / "good.py"
    good.write_text("import jax\n\n\n@jax.jit\ndef f(x):\n    return x * 2\n")
    broken = tmp_path / "broken.py"
    broken.write_text("def f(x:\n")
    result = _run_entry(hook["entry"], bad, tmp_path)
    assert result.returncode == 1 and "bad.py:6:12: JX101 " in result.stdout, result.stdout + result.stderr
    assert _run_entry(hook["entry"], good, tmp_path).returncode == 0
    failed = _run_entry(hook["entry"], broken, tmp_path)
    assert failed.returncode == 1 and "E999" in failed.stdout
