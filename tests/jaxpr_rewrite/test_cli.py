"""The command line: show / show --diff / report / verify on a small module, in process through
``cli.main`` and once through ``python -m jaxpr_rewrite`` as CI would run it."""

import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpr_rewrite.cli import main, parse_args_spec, random_inputs

MODULE = textwrap.dedent(
    '''
    import jax
    import jax.numpy as jnp
    from jaxpr_rewrite import int8ify


    def mlp(x, w1, w2):
        with jax.named_scope("hidden"):
            h = jax.nn.gelu(x @ w1)
        with jax.named_scope("out"):
            return h @ w2


    def emulated(x, w):
        return jnp.sum(x[:, :, None] * w[None, :, :], axis=1)


    def int8_matmul(x, w):
        xs = jnp.max(jnp.abs(x), axis=1) / 127.0
        ws = jnp.max(jnp.abs(w), axis=0) / 127.0
        xs, ws = jnp.where(xs == 0, 1.0, xs), jnp.where(ws == 0, 1.0, ws)
        xq = jnp.clip(jnp.round(x / xs[:, None]), -127, 127).astype(jnp.int8)
        wq = jnp.clip(jnp.round(w / ws[None, :]), -127, 127).astype(jnp.int8)
        acc = jnp.matmul(xq, wq, preferred_element_type=jnp.int32)
        return acc.astype(jnp.float32) * (xs[:, None] * ws[None, :])


    @int8ify(skip=["out*"])
    def decorated(x, w1, w2):
        return mlp(x, w1, w2)
    '''
)
ARGS = "f32[8,64] f32[64,32] f32[32,16]"


@pytest.fixture
def module(tmp_path, monkeypatch):
    path = tmp_path / "tinymodel.py"
    path.write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tinymodel", raising=False)  # each test imports its own copy
    return path


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_parse_args_spec():
    specs = parse_args_spec("f32[8,64] bf16[4,128], i8[2,3] f16 i32[] float32[5]")
    assert [(s.shape, np.dtype(s.dtype).name) for s in specs] == [
        ((8, 64), "float32"), ((4, 128), "bfloat16"), ((2, 3), "int8"), ((), "float16"), ((), "int32"),
        ((5,), "float32"),
    ]
    arrays = random_inputs(specs, seed=0)
    assert [a.dtype for a in arrays] == [np.float32, jnp.bfloat16, np.int8, np.float16, np.int32, np.float32]
    assert np.abs(arrays[2]).max() <= 127
    np.testing.assert_array_equal(random_inputs(specs[:1], seed=0)[0], arrays[0])  # seeded


def test_show_prints_the_rewritten_jaxpr(module, capsys):
    code, out, _ = _run(capsys, "show", "tinymodel:mlp", "--args", ARGS)
    assert code == 0
    # each int8 dot once: the program is traced for this machine's platform alone
    assert out.count("preferred_element_type=int32") == 2 and "i8[8,64]" in out
    code, out, _ = _run(capsys, "show", "tinymodel:mlp", "--args", ARGS, "--skip", "out")
    assert out.count("preferred_element_type=int32") == 1


def test_show_diff_marks_rewritten_equations(module, capsys):
    code, out, _ = _run(capsys, "show", f"{module}:mlp", "--args", ARGS, "--diff")
    assert code == 0
    lines = out.splitlines()
    assert "float program" in lines[0] and "rewritten program" in lines[0]
    changed = [line for line in lines if line.startswith("- ")]
    assert len(changed) == 2 and all("dot_general" in line for line in changed)
    assert sum("custom_jvp_call[name=int8_dot_general]" in line for line in lines) == 2
    assert sum("preferred=int32" in line and "| +" in line for line in lines) == 2  # one per rewritten matmul
    assert any(line.startswith("  ") and "tanh" in line and "| " in line for line in lines)  # unchanged, side by side


def test_report_table_with_measured_errors(module, capsys):
    code, out, _ = _run(capsys, "report", "tinymodel:mlp", "--args", ARGS, "--granularity", "per-tensor")
    assert code == 0
    header, row0, row1, summary = out.strip().splitlines()
    assert "error" in header and "tinymodel.py:9 (mlp)" in row0 and "hidden" in row0
    assert "e-0" in row0 and "e-0" in row1  # measured on seeded random inputs
    assert summary.startswith("2 dot_general(s): 2 rewritten")
    code, out2, _ = _run(capsys, "report", "tinymodel:mlp", "--args", ARGS, "--granularity", "per-tensor")
    assert out2 == out  # same seed, same numbers
    code, out, _ = _run(capsys, "report", "tinymodel:decorated", "--args", ARGS, "--no-measure")
    assert "matches skip pattern 'out*'" in out and "e-0" not in out


def test_verify_exit_status_and_format(module, capsys):
    code, out, _ = _run(capsys, "verify", "tinymodel:emulated", "--args", "f32[8,64] f32[64,32]")
    assert code == 1
    assert out.startswith("tinymodel.py:15: JX103 ")
    code, out, _ = _run(capsys, "verify", "tinymodel:mlp", "--args", ARGS)
    assert code == 1 and [line.split()[1] for line in out.splitlines()] == ["JX101", "JX101"]
    code, out, _ = _run(capsys, "verify", "tinymodel:mlp", "--args", ARGS, "--int8ify")
    assert code == 0 and "no findings" in out
    code, out, _ = _run(capsys, "verify", "tinymodel:int8_matmul", "--args", "f32[4,16] f32[16,3]")
    assert code == 0
    code, out, _ = _run(capsys, "verify", "tinymodel:decorated", "--args", ARGS)  # its own options: one float dot
    assert code == 1 and out.count("JX101") == 1


def test_usage_errors_exit_2(module, capsys):
    assert _run(capsys, "verify", "tinymodel:nope", "--args", "f32[2]")[0] == 2
    assert _run(capsys, "verify", "no_such_module:f", "--args", "f32[2]")[0] == 2
    code, _, err = _run(capsys, "show", "tinymodel:mlp", "--args", "q8[2,2]")
    assert code == 2 and "unknown dtype 'q8'" in err
    code, _, err = _run(capsys, "show", "tinymodel:mlp", "--args", ARGS, "--block-size", "0")
    assert code == 2 and "block_size" in err


def test_python_dash_m(module):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpr_rewrite", "verify", "tinymodel.py:emulated", "--args", "f32[8,64] f32[64,32]"],
        capture_output=True, text=True, cwd=module.parent, timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith("tinymodel.py:15: JX103")


@pytest.mark.parametrize("argv, message", [
    (["show", "tinymodel:mlp", "--args", "f32[8,64] f32[64,32]"],
     r"tinymodel:mlp takes 3 positional argument\(s\) \(x, w1, w2\), but --args gives 2"),
    (["report", "tinymodel:mlp", "--args", "f32[8,64] f32[63,32] f32[32,16]"],
     r"tinymodel:mlp cannot run on --args .*dot_general requires contracting dimensions to have the same shape"),
    (["show", "tinymodel:mlp", "--args", "f32[8,-1] f32[64,32] f32[32,16]"],
     r"bad shape in 'f32\[8,-1\]': dims must be non-negative"),
    (["verify", "broken.py:f", "--args", "f32[2]"], r"cannot load broken.py: SyntaxError at line 2"),
    (["report", "tinymodel:mlp", "--args", ARGS, "--no-measure", "--plot", "x.png"], "cannot be combined"),
    (["report", "tinymodel:mlp", "--args", ARGS, "--seed", "-1"], r"--seed must be a non-negative integer, got -1"),
])
def test_bad_command_lines_get_one_sentence_and_exit_2(module, capsys, argv, message):
    (module.parent / "broken.py").write_text("def f(x):\n    return x @ (\n")
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert re.search(message, err), err


def test_float64_arguments_are_honoured(module, capsys):
    try:
        code, out, _ = _run(capsys, "show", "tinymodel:mlp", "--args", "f64[8,64] f64[64,32] f64[32,16]")
        assert code == 0 and "f64[8,64]" in out
    finally:
        jax.config.update("jax_enable_x64", False)


def test_report_plot(module, capsys):
    pytest.importorskip("matplotlib")
    code, out, _ = _run(capsys, "report", "tinymodel:mlp", "--args", ARGS, "--plot", "errors.png")
    assert code == 0 and out.strip().endswith("wrote errors.png")
    assert (module.parent / "errors.png").stat().st_size > 1000
