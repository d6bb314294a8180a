"""Shared helpers for the lint plugin tests (no jax import needed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Set, Tuple

from lint_plugin import Violation, lint_source
from lint_plugin.rules import example_source

FIXTURES = Path(__file__).parent / "fixtures"
REPO_ROOT = Path(__file__).resolve().parents[2]

_EXPECT = re.compile(r"\b(JX\d{3}):(\d+)\b")


def violations(source: str, extra_decorators=()) -> List[Violation]:
    """Every report on a snippet (dedented; line 1 is its first line of code), raising on internal errors."""
    return lint_source(example_source(source), extra_decorators, raise_errors=True)


def lint(source: str, extra_decorators=()) -> List[Tuple[int, int, str]]:
    """``(line, col, code)`` of every report on a snippet, as :func:`violations` numbers lines."""
    return [(v.line, v.col, v.code) for v in violations(source, extra_decorators)]


def codes(source: str, extra_decorators=()) -> List[str]:
    return [c for _, _, c in lint(source, extra_decorators)]


def expected_in(text: str) -> Set[Tuple[int, int, str]]:
    """bugbear-style expectations: a comment ``# JX101:8`` on a line expects JX101 at (line, col 8)."""
    out = set()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if "#" not in line:
            continue
        comment = line[line.index("#"):]
        for code, col in _EXPECT.findall(comment):
            out.add((lineno, int(col), code))
    return out


def expected_from_comments(path: Path) -> Set[Tuple[int, int, str]]:
    return expected_in(path.read_text())


def check_annotated(snippet: str, extra_decorators=()) -> None:
    """The reports on ``snippet`` are exactly its ``# JXnnn:col`` comments (none for a snippet without)."""
    expected = expected_in(example_source(snippet))
    actual = set(lint(snippet, extra_decorators))
    assert actual == expected, f"missing={sorted(expected - actual)} unexpected={sorted(actual - expected)}"


def flake8_env() -> dict:
    """The environment for a flake8 subprocess: the entry point ``lint_plugin.plugin:Int8Checker``
    resolves to the first ``lint_plugin`` on the path, so put this checkout's first."""
    env = dict(os.environ)
    env.pop("FLAKE8_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_flake8(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flake8", "-j", "1", *args], cwd=cwd, env=flake8_env(),
                          capture_output=True, text=True, timeout=120)
