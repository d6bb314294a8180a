"""The JX code table (``jx_codes``) is the lint rules' source for code, name and advice; the rules' docstrings
start with the table's titles; and the table imports neither jax nor libcst, so both packages can read it."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import jx_codes
from lint_helpers import REPO_ROOT
from lint_plugin import RULES


@pytest.mark.parametrize("code", list(jx_codes.CODES))
def test_each_code_is_one_rule_reading_its_row_of_the_table(code):
    entry, rule = jx_codes.CODES[code], RULES[code]
    assert rule.entry is entry
    assert (rule.code, rule.name, rule.instead) == (entry.code, entry.name, entry.instead)
    summary = inspect.cleandoc(rule.__doc__).split("\n\n", 1)[0].replace("\n", " ")
    assert summary.replace("``", "") == entry.title


def test_every_rule_has_a_row():
    assert list(RULES) == list(jx_codes.CODES)


def test_the_table_imports_neither_jax_nor_libcst():
    probe = "import sys, jx_codes; print(sorted(m for m in ('jax', 'libcst') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60, env={"PYTHONPATH": str(REPO_ROOT), "PATH": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
