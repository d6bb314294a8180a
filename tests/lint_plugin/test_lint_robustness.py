"""Deeply nested (valid) code is analysed like any other file and never aborts a flake8 run; where no
thread with a larger stack can run (or even it overflows), the deepest code is skipped, said by one JX000,
and the rest of the file checked; an internal error is one JX000 result; ``--select=JX,E9`` keeps flake8's
own E999 for files that do not parse."""

from __future__ import annotations

import ast
import sys
import textwrap
import threading

import pytest

from lint_helpers import run_flake8
from lint_plugin import deep_stack, engine, lint_source
from lint_plugin.deep_stack import DeepStackUnavailable, call_with_deep_stack
from lint_plugin.masking import mask_deep_code

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


def test_too_deep_even_with_a_larger_stack_and_skipped_code_is_one_jx000_result(monkeypatch):
    def always_too_deep(*args, **kwargs):
        raise RecursionError

    monkeypatch.setattr(engine, "_lint", always_too_deep)
    (v,) = lint_source("import jax\n")
    assert v.code == "JX000" and "nesting too deep" in v.message


def _chain_then_matmul(terms: int) -> str:
    """A deep ``and`` chain in an ``if``, then a float matmul in the same function."""
    chain = " and ".join("(x > 0)" for _ in range(terms))
    return _in_traced_function(f"if {chain}:\n    x = -x\nreturn x @ w")


_CHAIN_THEN_MATMUL_REPORTS = [(6, 4, "JX201"), (8, 11, "JX101")]


@pytest.fixture
def default_recursion_limit():
    """CPython's default recursion limit for the test (another test's library may have raised it in this process),
    so that the 600-term chain is too deep for the main thread, as in a fresh flake8 process."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(old)


def _refuse_threads(monkeypatch):
    def refuse(thread):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)


@pytest.mark.usefixtures("default_recursion_limit")
def test_without_a_thread_the_deepest_code_is_skipped_and_the_rest_checked(monkeypatch):
    source = _chain_then_matmul(600)
    assert [(v.line, v.col, v.code) for v in lint_source(source, raise_errors=True)] == _CHAIN_THEN_MATMUL_REPORTS
    _refuse_threads(monkeypatch)
    for raise_errors in (True, False):
        reports = lint_source(source, raise_errors=raise_errors)
        # the same findings at the same places, and one JX000 at the first term skipped
        assert [(v.line, v.col, v.code) for v in reports] == [(6, 4, "JX201"), (6, 8, "JX000"), (8, 11, "JX101")]
        note, matmul = reports[1], reports[2]
        assert note.message == (
            "JX000 code nested too deep to analyse here (no thread with a large stack could start: RuntimeError: "
            "can't start new thread): the parts nested deepest, from here on, were skipped and the rest of this "
            "file was checked")
        assert matmul.message.startswith("JX101 float matmul `@` in traced code")


@pytest.mark.usefixtures("default_recursion_limit")
def test_too_deep_even_for_the_larger_stack_skips_the_deepest_code(monkeypatch):
    monkeypatch.setattr(deep_stack, "_RECURSION_LIMIT", 400)  # the thread's stack overflows too
    reports = lint_source(_chain_then_matmul(600), raise_errors=True)
    assert [(v.line, v.col, v.code) for v in reports] == [(6, 4, "JX201"), (6, 8, "JX000"), (8, 11, "JX101")]
    assert "(too deep even for a larger stack)" in reports[1].message


def test_the_skipped_code_fits_a_lower_recursion_limit(monkeypatch):
    _refuse_threads(monkeypatch)
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(600)
    try:
        reports = lint_source(_chain_then_matmul(300), raise_errors=True)
    finally:
        sys.setrecursionlimit(old)
    assert [(v.line, v.code) for v in reports] == [(6, "JX201"), (6, "JX000"), (8, "JX101")]


@pytest.mark.parametrize("failure", ["stack_size", "start"])
def test_a_thread_that_cannot_run_is_deep_stack_unavailable(monkeypatch, failure):
    def refuse(*args):
        raise ValueError("size not valid") if failure == "stack_size" else RuntimeError("can't start new thread")

    monkeypatch.setattr(threading if failure == "stack_size" else threading.Thread, failure, refuse)
    old_limit = sys.getrecursionlimit()
    with pytest.raises(DeepStackUnavailable) as info:
        call_with_deep_stack(lambda: 1)
    assert isinstance(info.value.__cause__, (ValueError, RuntimeError))
    assert sys.getrecursionlimit() == old_limit


MASKED = textwrap.dedent('''\
    import jax


    @jax.jit
    def f(x, w):
        y = (x.ndim > 0 and
             x.ndim > 1 and x.ndim > 2 and
             x.ndim > 3); z = x @ w  # noqa: E702
        return g(g(g(y))) @ w
''')


def _elif_chain_then_matmul(arms: int) -> str:
    body = "".join(f"elif x.ndim == {i}:\n    y = x * {i}\n" for i in range(1, arms))
    return _in_traced_function(f"if x.ndim == 0:\n    y = x\n{body}else:\n    y = -x\nreturn y @ w")


def test_masked_code_keeps_every_other_position():
    """What is masked is replaced by a placeholder of the same extent: the lines, and the columns after it on
    its last line, stay where they were."""
    masked = mask_deep_code(MASKED, ast.parse(MASKED), 9)
    assert masked.first == (6, 9)  # the first two terms of the chain, on lines 6 and 7
    original, new = MASKED.splitlines(), masked.source.splitlines()
    assert new[:5] == original[:5] and len(new) == len(original)
    assert new[5:7] == ["    y = ((_", "                  ) and (____) > 2 and"]
    assert new[7].index("); z = x @ w  # noqa: E702") == original[7].index("); z = x @ w  # noqa: E702")
    assert new[8] == "    return g((_____)) @ w"
    ast.parse(masked.source)
    matmuls = [(v.line, v.col, v.code) for v in lint_source(MASKED, raise_errors=True)]
    assert [(v.line, v.col, v.code) for v in lint_source(masked.source, raise_errors=True)] == matmuls


def test_the_rest_of_a_deep_elif_chain_is_masked_as_one_else():
    source = _elif_chain_then_matmul(40)
    masked = mask_deep_code(source, ast.parse(source), 30)
    lines, original = masked.source.splitlines(), source.splitlines()
    start = lines.index("    else: pass")  # from the first ``elif`` too deep to the end of the chain
    assert original[start].startswith("    elif x.ndim == ")
    assert lines[start + 1:-1] == [""] * (len(lines) - start - 2)
    assert len(lines) == len(original) and lines[-1] == original[-1] == "    return y @ w"
    reports = lint_source(masked.source, raise_errors=True)
    assert [(v.line, v.col, v.code) for v in reports] == [(len(lines), 11, "JX101")]
