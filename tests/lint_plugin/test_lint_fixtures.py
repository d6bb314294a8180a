"""bugbear-style fixture files: the reported (line, col, code) set equals the annotated set."""

from __future__ import annotations

import pytest

from lint_helpers import FIXTURES, expected_from_comments
from lint_plugin import lint_source

FIXTURE_FILES = sorted(FIXTURES.glob("*.py"))


def test_fixture_files_exist():
    names = {p.stem for p in FIXTURE_FILES}
    for code in ("jx101", "jx102", "jx103", "jx104", "jx201", "jx202", "jx301", "jx302"):
        assert code in names
    assert {"aliases", "seed_reference", "seed_rejected"} <= names


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name)
def test_fixture_reports_exactly_the_annotated_set(path):
    expected = expected_from_comments(path)
    actual = {(v.line, v.col, v.code) for v in lint_source(path.read_text(), raise_errors=True)}
    missing = sorted(expected - actual)
    unexpected = sorted(actual - expected)
    assert not missing and not unexpected, f"missing={missing} unexpected={unexpected}"


def test_every_rule_fixture_has_expectations_and_valid_code():
    for path in FIXTURE_FILES:
        if path.stem.startswith("jx"):
            code = path.stem.upper()
            assert any(c == code for _, _, c in expected_from_comments(path)), path.name
