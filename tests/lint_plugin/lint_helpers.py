"""Shared helpers for the lint plugin tests (no jax import needed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List, Set, Tuple

from lint_plugin import lint_source

FIXTURES = Path(__file__).parent / "fixtures"
REPO_ROOT = Path(__file__).resolve().parents[2]

_EXPECT = re.compile(r"\b(JX\d{3}):(\d+)\b")


def lint(source: str, extra_decorators=()) -> List[Tuple[int, int, str]]:
    """``(line, col, code)`` of every report, raising on internal errors."""
    return [(v.line, v.col, v.code)
            for v in lint_source(textwrap.dedent(source), extra_decorators, raise_errors=True)]


def codes(source: str, extra_decorators=()) -> List[str]:
    return [c for _, _, c in lint(source, extra_decorators)]


def expected_from_comments(path: Path) -> Set[Tuple[int, int, str]]:
    """bugbear-style expectations: a comment ``# JX101:8`` on a line expects JX101 at (line, col 8)."""
    out = set()
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if "#" not in line:
            continue
        comment = line[line.index("#"):]
        for code, col in _EXPECT.findall(comment):
            out.add((lineno, int(col), code))
    return out


def run_flake8(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("FLAKE8_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "flake8", "-j", "1", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
