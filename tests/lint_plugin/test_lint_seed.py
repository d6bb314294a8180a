"""The seed problem's contract: its reference solution lints clean, each rejection is flagged."""

from __future__ import annotations

import libcst as cst
import pytest

from lint_helpers import FIXTURES
from lint_plugin import lint_source


def _reports_by_function(path):
    source = path.read_text()
    module = cst.parse_module(source)
    spans = {}
    lines = source.splitlines()
    for stmt in module.body:
        if isinstance(stmt, cst.FunctionDef):
            start = next(i for i, line in enumerate(lines, 1) if line.startswith(f"def {stmt.name.value}("))
            spans[stmt.name.value] = start
    ordered = sorted(spans.items(), key=lambda kv: kv[1])
    out = {name: set() for name in spans}
    for v in lint_source(source, raise_errors=True):
        owner = [name for name, start in ordered if start <= v.line][-1]
        out[owner].add(v.code)
    return out


def test_reference_solution_lints_clean():
    assert lint_source((FIXTURES / "seed_reference.py").read_text(), raise_errors=True) == []


@pytest.mark.parametrize("function, code", [
    ("dequantized_float_matmul", "JX101"),
    ("matmul_of_scales", "JX101"),
    ("broadcast_multiply_sum", "JX103"),
    ("host_callback", "JX301"),
    ("python_if_on_all_zero", "JX201"),
    ("int8_accumulator", "JX102"),
])
def test_each_grader_rejection_is_flagged(function, code):
    assert _reports_by_function(FIXTURES / "seed_rejected.py")[function] == {code}
