"""The examples run as documented (small sizes, so the suite stays fast)."""


def test_seed_problem_example(run_example):
    out = run_example("seed_problem.py")
    assert out.count("y matches the published output: True") == 3
    assert "contract check (verify): clean" in out


def test_mlp_example(run_example):
    out = run_example("mlp.py", ["--batch", "8", "--width", "64", "--layers", "2"])
    assert out.count("int8[8,64] x int8[64,64] -> int32[8,64]") == 2
    assert "relative error vs float32" in out and out.count("speed-up vs float32") == 3


def test_compare_backends_example(run_example):
    out = run_example("compare_backends.py", ["--width", "64", "--batch", "8"])
    rows = {cells[0]: [float(e) for e in cells[1:]] for line in out.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split("|")]] if cells[0] != "backend"}
    assert sorted(rows) == ["int8", "mxfp8", "nvfp4"]
    assert all(len(errors) == 4 and all(0 < e < 1 for e in errors) for errors in rows.values()), rows
    # 127 int8 levels per channel beat fp8's 3 mantissa bits, which beat fp4's 1, at every layer
    assert all(a < b < c for a, b, c in zip(rows["int8"], rows["mxfp8"], rows["nvfp4"])), rows
