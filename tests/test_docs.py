"""The documentation runs as shown: README.md, docs/inspect.md and docs/deploy.md are executed and their pasted
outputs compared.

Conventions in those files (the markdown renders them as ordinary code blocks):

* A ```python block whose first line is ``# file: NAME`` is written to ``NAME`` in a scratch folder.
* Any other ```python block runs, in order, in one namespace per document, with the scratch folder as the working
  directory; a ```text block right after it is its expected standard output. ``# not run: REASON`` as the first
  line skips a block (installs, minutes-long jobs, hardware the tests do not have).
* In a ```console block, each ``$ command`` runs in the scratch folder (``python`` is this interpreter) and the
  lines up to the next ``$`` are its expected output; ``# not run`` at the end of a command skips it. A
  ``python -m jaxpr_rewrite`` command runs in this process, as ``-m`` runs the package's ``__main__`` (a fresh
  interpreter would spend most of the command's time importing JAX; tests/jaxpr_rewrite/test_cli.py starts one).

Outputs are compared line by line: text and integers exactly, other numbers within 10% (they are measured errors,
which move by an ulp across JAX versions); ``...`` on a line of its own stands for any number of lines.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", "docs/inspect.md", "docs/deploy.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def blocks(text: str) -> list[tuple[str, str, int]]:
    """``(language, body, position)`` of every fenced block, in order."""
    return [(m.group(1), m.group(2), m.start()) for m in FENCE.finditer(text)]


def same_output(got: str, want: str) -> bool:
    got_lines = [line.rstrip() for line in got.strip("\n").splitlines()]
    want_lines = [line.rstrip() for line in want.strip("\n").splitlines()]
    return _match(got_lines, want_lines)


def _match(got: list[str], want: list[str]) -> bool:
    if not want:
        return not got
    if want[0] == "...":
        return any(_match(got[i:], want[1:]) for i in range(len(got) + 1))
    return bool(got) and _same_line(got[0], want[0]) and _match(got[1:], want[1:])


def _same_line(got: str, want: str) -> bool:
    if NUMBER.sub("#", got) != NUMBER.sub("#", want):
        return False
    for a, b in zip(NUMBER.findall(got), NUMBER.findall(want)):
        if a.lstrip("-").isdigit() and b.lstrip("-").isdigit():  # counts, shapes and line numbers: exact
            if a != b:
                return False
            continue
        x, y = float(a), float(b)
        if abs(x - y) > 0.1 * max(abs(x), abs(y)) and abs(x - y) > 1e-6:
            return False
    return True


def test_the_comparison_can_fail():
    assert same_output("error 8.32e-03\n", "error 8.5e-03")
    assert not same_output("error 8.32e-03\n", "error 9.9e-03")
    assert not same_output("2 dot_general(s)", "3 dot_general(s)")
    assert same_output("a\nb\nc\nd", "a\n...\nd") and not same_output("a\nb", "a\n...\nc")
    assert not same_output("README.md:40 (mlp)", "README.md:43 (mlp)")  # integers exactly


def _examples(document: str):
    text = (ROOT / document).read_text(encoding="utf-8")
    found = blocks(text)
    steps = []
    for i, (language, body, position) in enumerate(found):
        line = text.count("\n", 0, position) + 1
        first = body.splitlines()[0] if body.strip() else ""
        if language == "python" and first.startswith("# file: "):
            steps.append(("file", first.removeprefix("# file: ").strip(), body, None, line))
        elif language == "python" and not first.startswith("# not run"):
            following = found[i + 1] if i + 1 < len(found) else None
            gap = text[position + len(body):following[2]] if following else ""
            expected = following[1] if following and following[0] == "text" and gap.count("\n") <= 3 else None
            steps.append(("python", None, body, expected, line))
        elif language == "console":
            for command, expected in _commands(body):
                steps.append(("console", None, command, expected, line))
    return steps


def _commands(body: str):
    command, output = None, []
    for line in body.splitlines():
        if line.startswith("$ "):
            if command is not None:
                yield command, "\n".join(output)
            command, output = line[2:], []
        else:
            output.append(line)
    if command is not None:
        yield command, "\n".join(output)


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``python -m jaxpr_rewrite ARGV`` in this process: its exit status, standard output and standard error."""
    from jaxpr_rewrite.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            returncode = main(argv)
        except SystemExit as e:  # argparse's usage errors
            returncode = e.code
    return returncode, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("document", DOCUMENTS)
def test_document_runs_as_shown(document, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    for kind, name, body, expected, line in _examples(document):
        where = f"{document}:{line}"
        if kind == "file":
            (tmp_path / name).write_text(body)
            sys.modules.pop(Path(name).stem, None)
        elif kind == "python":
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                # padded so tracebacks and source locations name the document's own lines
                exec(compile("\n" * line + body, document, "exec"), namespace)  # noqa: S102
            if expected is not None:
                assert same_output(out.getvalue(), expected), f"{where} printed:\n{out.getvalue()}"
            ran += 1
        elif not body.rstrip().endswith("# not run"):
            argv = shlex.split(body)
            if argv[:3] == ["python", "-m", "jaxpr_rewrite"]:
                returncode, stdout, stderr = _run_cli(argv[3:])
            else:
                if argv and argv[0] == "python":
                    argv[0] = sys.executable
                result = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
                returncode, stdout, stderr = result.returncode, result.stdout, result.stderr
            got = stdout + (f"[exit {returncode}]\n" if returncode else "") + (stderr if returncode == 2 else "")
            assert same_output(got, expected), f"{where}: `{body}` printed:\n{got}"
            ran += 1
    assert ran > 0
