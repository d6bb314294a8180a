"""Through real flake8: plugin registration, ``# noqa`` (multi-line too), config files, parse errors."""

from __future__ import annotations

import textwrap

import pytest

from lint_helpers import run_flake8
from lint_plugin import PARSE_ERROR_CODE, Int8Checker

NOQA_SOURCE = textwrap.dedent('''\
    import jax
    import jax.numpy as jnp


    @jax.jit
    def f(x, w):
        if jnp.all(x == 0):  # noqa: JX201
            x = x + 1
        if x.sum() > 0:
            x = x - 1
        y = jnp.matmul(
            x,
            w,
        )  # noqa: JX101
        z = jnp.dot(
            x,
            w,
        )
        return y, z
''')


def _reported(stdout):
    out = []
    for line in stdout.splitlines():
        _, lineno, col, rest = line.split(":", 3)
        out.append((int(lineno), int(col), rest.split()[0]))
    return sorted(out)


def test_plugin_is_registered():
    result = run_flake8("--version", cwd=".")
    assert "int8ify:" in result.stdout  # flake8 lists plugins by distribution name


def test_noqa_suppression_including_multiline_statements(tmp_path):
    (tmp_path / "mod.py").write_text(NOQA_SOURCE)
    result = run_flake8("--select=JX", "mod.py", cwd=tmp_path)
    # flake8 prints 1-based columns; suppressed: line 7 (JX201) and the multi-line call on line 11
    assert _reported(result.stdout) == [(9, 5, "JX201"), (15, 9, "JX101")], result.stdout + result.stderr


def test_noqa_on_the_reported_line_of_a_multiline_statement(tmp_path):
    source = NOQA_SOURCE.replace("        )  # noqa: JX101\n", "        )\n").replace(
        "    y = jnp.matmul(\n", "    y = jnp.matmul(  # noqa: JX101\n")
    (tmp_path / "mod.py").write_text(source)
    result = run_flake8("--select=JX", "mod.py", cwd=tmp_path)
    assert _reported(result.stdout) == [(9, 5, "JX201"), (15, 9, "JX101")], result.stdout


def test_noqa_in_a_multiline_if_condition(tmp_path):
    source = textwrap.dedent('''\
        import jax


        @jax.jit
        def f(x):
            if (
                x.sum() > 0
                and x.max() > 1  # noqa: JX201
            ):
                return x
            return -x
    ''')
    (tmp_path / "mod.py").write_text(source)
    assert run_flake8("--select=JX", "mod.py", cwd=tmp_path).stdout == ""
    disabled = run_flake8("--select=JX", "--disable-noqa", "mod.py", cwd=tmp_path)
    assert _reported(disabled.stdout) == [(6, 5, "JX201")]


def test_noqa_for_another_code_does_not_suppress(tmp_path):
    (tmp_path / "mod.py").write_text(NOQA_SOURCE.replace("# noqa: JX201", "# noqa: JX101"))
    result = run_flake8("--select=JX", "mod.py", cwd=tmp_path)
    assert (7, 5, "JX201") in _reported(result.stdout)


CUSTOM_DECORATOR_SOURCE = textwrap.dedent('''\
    import mylib


    @mylib.traced
    def f(x, w):
        return x @ w


    @my_jit
    def g(x):
        if x.sum() > 0:
            return x
        return -x
''')


@pytest.mark.parametrize("config_name, section", [
    ("setup.cfg", "flake8"), ("tox.ini", "flake8"), (".flake8", "flake8"),
])
def test_traced_decorators_option_from_config_file(tmp_path, config_name, section):
    (tmp_path / "mod.py").write_text(CUSTOM_DECORATOR_SOURCE)
    before = run_flake8("--select=JX", "mod.py", cwd=tmp_path)
    assert before.stdout == "", before.stdout + before.stderr
    (tmp_path / config_name).write_text(
        f"[{section}]\njx-traced-decorators =\n    mylib.traced,\n    my_jit\n")
    after = run_flake8("--select=JX", "mod.py", cwd=tmp_path)
    assert _reported(after.stdout) == [(6, 12, "JX101"), (11, 5, "JX201")], after.stdout + after.stderr


def test_traced_decorators_option_on_command_line(tmp_path):
    (tmp_path / "mod.py").write_text(CUSTOM_DECORATOR_SOURCE)
    result = run_flake8("--select=JX", "--jx-traced-decorators=my_jit", "mod.py", cwd=tmp_path)
    assert _reported(result.stdout) == [(11, 5, "JX201")]


def test_unparseable_file_gives_one_clear_result_not_a_traceback():
    lines = ["import jax\n", "@jax.jit\n", "def f(x:\n", "    return x\n"]
    results = list(Int8Checker(None, lines).run())
    assert len(results) == 1
    line, col, message, checker = results[0]
    assert message.startswith(f"{PARSE_ERROR_CODE} could not parse this file with libcst")
    assert checker is Int8Checker and line >= 1 and col >= 0


def test_checker_yields_flake8_tuples():
    lines = ["import jax\n", "@jax.jit\n", "def f(x):\n", "    return x @ x\n"]
    (result,) = Int8Checker(None, lines).run()
    assert result[:3] == (4, 11, result[2]) and result[2].startswith("JX101 ")


CONTINUATION_SOURCE = textwrap.dedent('''\
    import jax
    import jax.numpy as jnp


    @jax.jit
    def f(x, w):
        y = jnp.matmul(
            x,  {comment}
            w,
        )
        return y
''')


@pytest.mark.parametrize("comment, expected", [
    ("# noqa: JX201", [(7, 9, "JX101")]),       # another code: reported
    ("# noqa:JX201,JX202", [(7, 9, "JX101")]),
    ("# noqa: JX101", []),
    ("# noqa: JX1", []),                         # a prefix of the code, as flake8 matches
    ("# noqa", []),                              # blanket
])
def test_noqa_codes_on_a_continuation_line(tmp_path, comment, expected):
    (tmp_path / "mod.py").write_text(CONTINUATION_SOURCE.format(comment=comment))
    result = run_flake8("--select=JX", "mod.py", cwd=tmp_path)
    assert _reported(result.stdout) == expected, result.stdout + result.stderr
