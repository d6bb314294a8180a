"""Every rule's declared VALID/INVALID examples, and the registry itself."""

from __future__ import annotations

import textwrap

import pytest

from lint_plugin import RULES, Rule, get_rule, lint_source
from lint_plugin.rules import callbacks, control_flow, example_source, matmul

DOCUMENTED_CODES = ["JX101", "JX102", "JX103", "JX104", "JX105", "JX201", "JX202", "JX301", "JX302"]


def _examples(kind):
    for code, rule in RULES.items():
        for i, snippet in enumerate(getattr(rule, kind)):
            yield pytest.param(code, snippet, id=f"{code}-{kind.lower()}-{i}")


def _reports(snippet, code):
    return [(v.line, v.col) for v in lint_source(example_source(snippet), raise_errors=True) if v.code == code]


def test_registry_has_exactly_the_documented_codes():
    assert list(RULES) == DOCUMENTED_CODES


@pytest.mark.parametrize("code", DOCUMENTED_CODES)
def test_rule_declares_code_message_and_examples(code):
    rule = get_rule(code)
    assert issubclass(rule, Rule) and rule.code == code and rule.name
    assert rule.VALID and rule.INVALID
    assert rule.__doc__ and rule.__doc__ != Rule.__doc__, "the docstring is the rule's documentation"
    # messages say what to do instead
    assert rule.instead and ("{instead}" in rule.message or "{fix}" in rule.message)


def test_one_module_per_family():
    assert {r.__module__ for r in RULES.values()} == {matmul.__name__, control_flow.__name__, callbacks.__name__}
    assert all(r.code.startswith("JX10") for r in RULES.values() if r.__module__ == matmul.__name__)
    assert all(r.code.startswith("JX20") for r in RULES.values() if r.__module__ == control_flow.__name__)
    assert all(r.code.startswith("JX30") for r in RULES.values() if r.__module__ == callbacks.__name__)


@pytest.mark.parametrize("code, snippet", list(_examples("VALID")))
def test_valid_example_is_not_flagged(code, snippet):
    assert _reports(snippet, code) == []


@pytest.mark.parametrize("code, example", list(_examples("INVALID")))
def test_invalid_example_is_flagged_once_at_its_line_and_column(code, example):
    assert _reports(example.code, code) == [(example.line, example.col)]


def test_message_format_starts_with_code_and_names_the_fix():
    (v,) = lint_source(textwrap.dedent("""
        import jax, jax.numpy as jnp

        @jax.jit
        def f(x):
            if jnp.all(x == 0):
                return x
            return -x
    """), raise_errors=True)
    assert v.message.startswith("JX201 Python `if` on a traced value")
    assert v.message.endswith("use jnp.where or lax.cond")
