"""Deeply nested (valid) code is analysed like any other file and never aborts a flake8 run; an
internal error is one JX000 result; ``--select=JX,E9`` keeps flake8's own E999 for files that do
not parse."""

from __future__ import annotations

import sys
import textwrap

import pytest

from lint_helpers import run_flake8
from lint_plugin import engine, lint_source
from lint_plugin.deep_stack import call_with_deep_stack

NORMAL = textwrap.dedent('''\
    import jax


    @jax.jit
    def f(x, w):
        return x @ w
''')


def _and_chain(terms: int) -> str:
    chain = " and ".join("(x > 0)" for _ in range(terms))
    return f"import jax\n\n\n@jax.jit\ndef f(x):\n    return {chain}\n"


def _nested_calls(depth: int) -> str:
    expr = "x @ x"
    for _ in range(depth):
        expr = f"g({expr})"
    return f"import jax\n\n\ndef g(v):\n    return v\n\n\n@jax.jit\ndef f(x):\n    return {expr}\n"


def _in_traced_function(body: str) -> str:
    return "import jax\n\n\n@jax.jit\ndef f(x, w):\n" + "".join(f"    {line}\n" for line in body.splitlines())


def _and_chain_in_if(terms: int) -> str:
    # libcst's position provider hits the recursion limit here and re-raises it as a KeyError
    # holding a node whose repr recurses again
    chain = " and ".join("(x > 0)" for _ in range(terms))
    return _in_traced_function(f"if {chain}:\n    return x\nreturn -x")


def _elif_chain(branches: int) -> str:
    arms = "".join(f"elif x.ndim == {i}:\n    y = x * {i}\n" for i in range(1, branches))
    return _in_traced_function(f"if x.ndim == 0:\n    y = x\n{arms}else:\n    y = x @ w\nreturn y")


def _nested_ifs(depth: int) -> str:
    lines = [f"{'    ' * i}if x.shape[0] > {i}:" for i in range(depth)]
    return _in_traced_function("\n".join(lines) + f"\n{'    ' * depth}return x @ w\nreturn x")


def _long_file(functions: int) -> str:
    block = "@jax.jit\ndef f{}(x, w):\n    if x.sum() > 0:\n        return x @ w\n    return x\n\n\n"
    return "import jax\n\n\n" + "".join(block.format(i) for i in range(functions))


def _long_file_reports(functions: int):
    # block i starts on line 4 + 7 i: the ``if`` two lines below it, the matmul three
    return [r for i in range(functions) for r in ((6 + 7 * i, 5, "JX201"), (7 + 7 * i, 16, "JX101"))]


def _reports(stdout, path):
    out = []
    for line in stdout.splitlines():
        name, lineno, col, rest = line.split(":", 3)
        if name == path:
            out.append((int(lineno), int(col), rest.split()[0]))
    return out


@pytest.mark.parametrize("source, expected", [
    (_and_chain(500), [(6, 12, "JX201")]),        # ``and`` on traced values
    (_and_chain_in_if(600), [(6, 5, "JX201")]),
    (_nested_calls(200), [(10, 412, "JX101")]),   # the matmul inside 200 calls
    (_elif_chain(300), [(607, 13, "JX101")]),     # libcst nests each ``elif`` in the one before
                                                  # (pyflakes itself gives up at 400)
    (_nested_ifs(90), [(96, 372, "JX101")]),      # static conditions, a matmul 90 blocks deep
    (_long_file(400), _long_file_reports(400)),
], ids=["500-term-and-chain", "600-term-and-chain-in-if", "200-deep-calls", "300-arm-elif-chain",
        "90-nested-ifs", "2800-line-file"])
def test_deep_expressions_are_analysed_and_other_files_still_reported(tmp_path, source, expected):
    (tmp_path / "deep.py").write_text(source)
    (tmp_path / "normal.py").write_text(NORMAL)
    result = run_flake8("--select=JX,E9", "deep.py", "normal.py", cwd=tmp_path)
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert _reports(result.stdout, "deep.py") == expected, result.stdout
    assert _reports(result.stdout, "normal.py") == [(6, 12, "JX101")], result.stdout
    assert result.returncode == 1


@pytest.mark.parametrize("source, expected", [
    (_and_chain_in_if(600), [(6, 4, "JX201")]),
    (_elif_chain(600), [(1207, 12, "JX101")]),
    (_in_traced_function(f"if {'not ' * 600}x:\n    return x\nreturn -x"), [(6, 4, "JX201")]),
], ids=["600-term-and-chain-in-if", "600-arm-elif-chain", "600-nots"])
def test_engine_analyses_what_used_to_overflow_the_stack(source, expected):
    assert [(v.line, v.col, v.code) for v in lint_source(source, raise_errors=True)] == expected


def test_select_jx_e9_reports_syntax_errors(tmp_path):
    (tmp_path / "broken.py").write_text("import jax\n\n\n@jax.jit\ndef f(x:\n    return x\n")
    (tmp_path / "normal.py").write_text(NORMAL)
    result = run_flake8("--select=JX,E9", "broken.py", "normal.py", cwd=tmp_path)
    assert [r[2] for r in _reports(result.stdout, "broken.py")] == ["E999"], result.stdout
    assert _reports(result.stdout, "normal.py") == [(6, 12, "JX101")]
    assert result.returncode != 0
    # without E9 the broken file passes silently: why every recipe selects JX,E9
    jx_only = run_flake8("--select=JX", "broken.py", cwd=tmp_path)
    assert jx_only.stdout == "" and jx_only.returncode == 0


def _recurse(n: int) -> int:
    return 0 if n == 0 else 1 + _recurse(n - 1)


def test_deep_stack_runs_what_the_default_limit_cannot():
    depth = sys.getrecursionlimit() * 5
    with pytest.raises(RecursionError):
        _recurse(depth)
    assert call_with_deep_stack(lambda: _recurse(depth)) == depth
    with pytest.raises(ValueError):
        call_with_deep_stack(lambda: int("not a number"))


def test_internal_errors_become_one_jx000_result(monkeypatch):
    source = "import jax\n\n\n@jax.jit\ndef f(x, w):\n    return x @ w\n"

    def broken(*args):
        raise ValueError("boom")

    monkeypatch.setattr(engine, "analyze", broken)
    (v,) = lint_source(source)
    assert (v.line, v.col, v.code) == (1, 0, "JX000") and "internal error ValueError: boom" in v.message
    with pytest.raises(ValueError):
        lint_source(source, raise_errors=True)


class _NodeWithRecursiveRepr:
    def __repr__(self):
        return repr(self)


def test_an_internal_error_holding_an_unprintable_node_is_one_jx000_result(monkeypatch):
    def broken(*args):
        raise KeyError(_NodeWithRecursiveRepr())

    monkeypatch.setattr(engine, "analyze", broken)
    (v,) = lint_source(NORMAL)
    assert (v.line, v.col, v.code) == (1, 0, "JX000") and "internal error KeyError)" in v.message


def test_an_error_raised_while_unwinding_a_recursion_error_is_retried_with_a_deep_stack(monkeypatch):
    real_analyze = engine.analyze
    calls = []

    def overflows_on_the_normal_stack(*args):
        calls.append(len(calls))
        if len(calls) == 1:
            try:
                raise RecursionError
            except RecursionError:
                raise KeyError(_NodeWithRecursiveRepr())
        return real_analyze(*args)

    monkeypatch.setattr(engine, "analyze", overflows_on_the_normal_stack)
    assert [(v.line, v.col, v.code) for v in lint_source(NORMAL)] == [(6, 11, "JX101")]
    assert len(calls) == 2


def test_too_deep_even_with_a_larger_stack_is_one_jx000_result(monkeypatch):
    def always_too_deep(*args):
        raise RecursionError

    monkeypatch.setattr(engine, "_lint", always_too_deep)
    (v,) = lint_source("import jax\n")
    assert v.code == "JX000" and "nesting too deep" in v.message
