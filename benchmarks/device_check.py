"""One prepared check of int8ify on an accelerator: environment, GPU tests, speed, and what the dots compile to.

Usage::

    python benchmarks/device_check.py                 # on the GPU or TPU machine: a few minutes
    python benchmarks/device_check.py --dry-run       # anywhere: the same steps at toy sizes, in seconds

Steps, each bounded in time and each recorded even when an earlier one failed:

1. the device, JAX/jaxlib versions and the CUDA libraries found;
2. the accelerator-relevant tests (dot_general dimension numbers, NaN/Inf/overflow/tiny/tie edge cases, the chunked
   contraction, straight-through gradients, ragged dots, scaled_matmul, static activation scales, bfloat16 and
   float16 widened from their bits) run on the device;
3. speed, in one process and interleaved (medians): the MLP of ``benchmarks/speed.py`` and the all-MiniLM-L6-v2
   encoder (random weights: speed does not depend on them) at batch 128, as bf16 and float32 (the baselines)
   against ``int8ify``, ``int8ify`` + ``quantize_params`` (also with late inlining, on JAX 0.11+), with static
   activation scales (and, for MiniLM, the attention einsums' activations static too), ``backend="int8-fused"``
   (one Pallas kernel per dot of a quantized weight, dynamic and static), the hand-written W8A8 program and the
   bare int8 dots;
4. what exactness costs there (``benchmarks/numerics_cost.py``): the contract as int8ify computes it against the
   plain formulas, on the MLP at d 4096 and MiniLM, then one quantization pass alone (``benchmarks/quantize_pass.py``:
   int8ify's codes, the TPU's two exact forms, the plain division, the memory floor). On a TPU v5e XLA's cost
   model puts int8ify's exact codes at 2% of their pass, while the chip ran the dynamic MLP at 1.3x the
   hand-written program's time;
5. where the device time goes (``benchmarks/kernel_profile.py``): the MLP at d 4096 and batch 4096 in bf16, written
   by hand in W8A8, and int8ify'd with dynamic and static scales, each kernel's time from a profile of 20 calls;
   the MiniLM encoder at batch 128 likewise, its kernels summed by kind; then (step ``ladder``) static scales
   step by step (``benchmarks/static_ladder.py``): the static MLP at d 4096 written by hand, each
   program one step more of what int8ify's computes, beside int8ify's own (batch 4096 and 1024); then (step
   ``candidates``) candidate changes against int8ify's program (``benchmarks/candidate_ab.py``: the program without
   the TPU layout rule, the epilogue without its powers of two, weights and static scales stored without them; the
   transformer block at 197 and 128 tokens; the
   layout rule on wider blocks, d 768 and d 512 with heads of 128, at 197 tokens);
6. the optimized HLO of each rewritten model: every GEMM listed with its operand types, so an int8 GEMM (cuBLASLt
   IMMA, a Triton s8 fusion) is told apart from an upcast float GEMM;
7. the fused kernel (``backend="int8-fused"``) against the int8 backend's XLA program on the device, bit for bit
   (one dot; sibling dots of one activation, one of them a ``DenseGeneral`` kernel);
8. the block-scaled backends on a GPU older than Blackwell (``mxfp8``/``nvfp4`` must run, ``auto`` must pick int8);
9. XLA's int8 GEMM under each autotuning setting, each in a fresh process: its sums against numpy's (XLA's default
   Triton tiling on a Hopper GPU doubles them, read in the PTX of its deviceless compile), and whether int8ify
   refuses the settings that would give it wrong sums (``jaxpr_rewrite/gpu_gemm_flags.py``);
10. quantized weights written to a SafeTensors file and read back onto the device (8-bit and 4-bit, per channel and
    in blocks): whether the arrays on the device are the written ones, byte for byte, and the program's outputs
    the computed weights' bit for bit, also with each tensor read handed to the device as a copy of its own (4-bit
    block weights read back gave other outputs on a TPU v5e chip; ``benchmarks/results/tpu-v5-lite.md``).

On a TPU, steps 7 and 9 are left out (the fused kernel and the autotuner are XLA:GPU's; ``int8-fused`` is the
``int8`` backend there), and the tests run first, in one process, before this one opens the chip: a TPU chip is
held by one process at a time.

Writes ``benchmarks/results/<device>.md`` (``--out`` to change), rewritten after every step.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks", ROOT / "examples", ROOT / "examples" / "minilm"):
    sys.path.insert(0, str(path))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpr_rewrite import calibrate_activation_dots, int8ify, quantize_params  # noqa: E402

ACCELERATOR_TESTS = [
    "tests/jaxpr_rewrite/test_dot_general.py",
    "tests/jaxpr_rewrite/test_edge_cases.py",
    "tests/jaxpr_rewrite/test_numerics.py",
    "tests/jaxpr_rewrite/test_matmul_seed.py",
    "tests/jaxpr_rewrite/test_ragged.py",
    "tests/jaxpr_rewrite/test_scaled_matmul.py",
    "tests/jaxpr_rewrite/test_api.py::test_grad_is_straight_through",
    "tests/jaxpr_rewrite/test_api.py::test_grad_of_jit_of_int8ify_and_jvp",
    "tests/jaxpr_rewrite/test_params.py",
    "tests/jaxpr_rewrite/test_exact_division.py",  # the divisions a GPU does not round correctly
    "tests/jaxpr_rewrite/test_float64_scales.py",  # the scale inside the reduction: float64 on the device
    "tests/jaxpr_rewrite/test_fused_gpu_dot.py",
    "tests/jaxpr_rewrite/test_static_scales.py",  # a GPU's static factors: Inf for a row holding NaN or Inf
    "tests/jaxpr_rewrite/test_activation_dots.py",  # attention's static scales
    "tests/jaxpr_rewrite/test_float_formats.py",  # bfloat16/float16 widened from their bits under excess precision
]
# run where the deploy extra is installed: a device's host copies of its arrays (a TPU's are column-major for a
# short last axis) written to SafeTensors and Orbax and read back
STORAGE_TESTS = ["tests/jaxpr_rewrite/test_stored_fuzz.py"]


class Report:
    """The results file, rewritten after every step so a time-out loses nothing that finished."""

    def __init__(self, path: Path):
        self.path = path
        self.sections: list[tuple[str, str]] = []

    def add(self, title: str, body: str) -> None:
        self.sections.append((title, body.rstrip()))
        self.echo_last()
        self._write()

    def echo_last(self) -> None:
        """The last section, printed."""
        title, body = self.sections[-1]
        print(f"\n## {title}\n{body}", flush=True)

    def replace_last(self, title: str, body: str) -> None:
        """The last section replaced, and the file rewritten (a step's partial results, kept should the process
        die in its next part: XLA:TPU's compiler once did, of a stack overflow)."""
        self.sections[-1] = (title, body.rstrip())
        self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = "# int8ify device check\n\n" + "\n\n".join(f"## {t}\n\n{b}" for t, b in self.sections) + "\n"
        self.path.write_text(text)


def timed(title: str, fn, *args) -> tuple[str, str]:
    """``fn(*args)`` as a section: its title with the seconds it took, and its body (the traceback if it raised)."""
    start = time.perf_counter()
    try:
        body = fn(*args)
    except Exception:  # a failed step is a finding, and the next steps still run
        body = "FAILED:\n\n```\n" + traceback.format_exc()[-3000:] + "```"
    return f"{title} ({time.perf_counter() - start:.0f} s)", body


def step(report: Report, title: str, fn, *args) -> None:
    report.add(*timed(title, fn, *args))


def growing_step(report: Report, title: str, fn, *args) -> None:
    """A step whose table grows as it runs: ``fn(*args, progress)`` hands ``progress`` each partial table, and the
    file is rewritten with it, so a process that dies part-way (XLA:TPU's compiler once did) keeps what finished."""
    report.add(f"{title} (running)", "(no model finished yet)")
    report.replace_last(*timed(title, fn, *args, lambda table: report.replace_last(f"{title} (models so far)", table)))
    report.echo_last()


def tpu_host() -> bool:
    """Whether this machine runs JAX on a TPU (libtpu installed), read without opening the device."""
    return importlib.util.find_spec("libtpu") is not None


# -- 1. environment ----------------------------------------------------------------------------------------------
def environment() -> str:
    device = jax.devices()[0]
    lines = [
        f"- device: {device.device_kind} ({device.platform}), {jax.device_count()} device(s)",
        f"- compute capability: {getattr(device, 'compute_capability', 'n/a')}",
        f"- jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}, Python {platform.python_version()}",
    ]
    libraries = sorted(
        f"{d.metadata['Name']} {d.version}" for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith(("nvidia-", "jax-cuda", "jax_cuda"))
    )
    lines.append(f"- CUDA libraries: {', '.join(libraries) if libraries else 'none found (not a CUDA install)'}")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if smi.returncode == 0:
            lines.append(f"- nvidia-smi: {smi.stdout.strip()}")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "\n".join(lines)


# -- 2. tests on the device -----------------------------------------------------------------------------------------
def run_tests(timeout: float, dry_run: bool, tests: list[str] | None, traceback_style: str,
              log: Path | None) -> str:
    """The tests named (the accelerator-relevant ones by default) in a fresh process; ``log`` receives pytest's
    whole output (with ``traceback_style="short"``, each failure's assertion and values)."""
    smoke = ["tests/jaxpr_rewrite/test_matmul_seed.py::test_published_examples"]
    storage = [] if None in map(importlib.util.find_spec, ("safetensors", "orbax")) else STORAGE_TESTS
    tests = tests or (smoke if dry_run else ACCELERATOR_TESTS + storage)
    # -v prints each test's name and outcome as it finishes, so a time-out still says which ones failed
    # --tb=line: one "file:line: message" per failure, so the results say where and why each one failed
    # each failure's reason printed as it happens (pytest_instant_failures.py): a run stopped at its time limit
    # still says why each failed test failed
    command = [sys.executable, "-m", "pytest", "-v", f"--tb={traceback_style}", "-p", "no:cacheprovider",
               "-p", "pytest_instant_failures", "-o", "addopts=", *tests]
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", ""),  # the suite's 8 host devices are not needed
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")])))
    if not dry_run and not tpu_host() and importlib.util.find_spec("xdist") is not None:
        # compiling is most of the tests' time and the GPU machine has many cores: one worker per few cores, each
        # taking GPU memory as it needs it (this process already holds most of it); a TPU chip takes one process
        command[3:3] = ["-n", str(max(1, min(8, (os.cpu_count() or 2) // 2)))]
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        output = result.stdout + result.stderr
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        output += f"\n(stopped after {timeout:.0f} s)"
    if log is not None:
        log.write_text(output)
    outcomes = _outcomes(output)
    failed = [name for name, outcome in outcomes if outcome in ("FAILED", "ERROR")]
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|errors?)\b", line)]
    counts = f"{sum(o == 'PASSED' for _, o in outcomes)} passed, {len(failed)} failed of {len(outcomes)} run"
    body = f"`{' '.join(tests)}`\n\n{counts}" + (f" ({summary[-1].strip('= ')})" if summary else "")
    if "stopped after" in output:
        body += f" -- stopped after {timeout:.0f} s"
    if "errors during collection" in output:  # pytest ran nothing: say which modules it could not import
        body += "\n\n" + "\n".join(f"- {line}" for line in output.splitlines() if line.startswith("ERROR "))
    if failed:
        body += "\n\n" + "\n".join(f"- FAILED {name}" for name in failed)
        reasons = _failure_lines(output)
        if reasons:
            body += "\n\nWhere they failed:\n\n```\n" + "\n".join(reasons) + "\n```"
    return body


def _outcomes(output: str) -> list[tuple[str, str]]:
    """``(test, outcome)`` for each test ``pytest -v`` reported: ``test PASSED`` alone, ``[gw0] [ 5%] PASSED test``
    under pytest-xdist. A parametrized test's id may hold spaces (``test_entry_points[jnp.einsum attention]``)."""
    serial = re.findall(r"^(tests/.+?) (PASSED|FAILED|ERROR|SKIPPED)(?= |$)", output, flags=re.MULTILINE)
    parallel = re.findall(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED) (tests/.+?)\s*$", output,
                          flags=re.MULTILINE)
    return serial + [(name, outcome) for outcome, name in parallel]


def _failure_lines(output: str, limit: int = 60, width: int = 400) -> list[str]:
    """The ``file:line: message`` lines that ``pytest --tb=line`` and ``pytest_instant_failures`` print, one per
    failure."""
    found = re.findall(r"^(\S+\.py:\d+: .*)$", output, flags=re.MULTILINE)
    # a --tb=short traceback's frames ("file:line: in function") are not reasons; each reason once (the plugin
    # prints it as the test fails and --tb=line again at the end)
    reasons = [line.removeprefix(f"{ROOT}/") for line in found
               if not re.search(r":\d+: in [\w<>.]+$", line) and "site-packages" not in line]
    return [line[:width] for line in dict.fromkeys(reasons)][:limit]


# -- 3. speed -------------------------------------------------------------------------------------------------------
SPEED_CASES = "mlp4096:1024,mlp4096:4096,minilm:128,mlp1024:16,mlp1024:1024,mlp1024:128"


def speed(dry_run: bool, deadline: float, cases: str, progress=None) -> str:
    """The models by what they tell, most first, each started only while ``deadline`` (``time.perf_counter()``)
    has not passed: the MLP at d 4096 and batch >= 1024 (where int8 GEMMs can beat bf16 on an H200), MiniLM at
    batch 128, then d 1024 (batch 16, where launches dominate, is where one kernel per dot should show most).
    ``progress(table)``, if given, receives the table after each model."""
    import model as minilm
    from mlp import init_mlp, mlp
    from speed import hand_mlp, hand_mlp_weights, model_cases

    rounds, reps = (2, 1) if dry_run else (9, 10)
    rows, skipped = [], []
    mlps = {}  # width -> (weights, the hand-written program's weights): the latest width's only, to bound memory
    length = 16 if dry_run else 128
    for width, batch in model_cases("mlp64:8,minilm:2" if dry_run else cases):  # width None: MiniLM
        name = f"MiniLM {batch}x{length}" if width is None else f"MLP 4x{width}"
        if time.perf_counter() > deadline:
            skipped.append(f"{name} at batch {batch}")
            continue
        if width is None:
            ids = jax.random.randint(jax.random.PRNGKey(1), (batch, length), 1000, 20000, jnp.int32)
            rest = (ids, jnp.ones((batch, length), jnp.int32))
            rows += _bench(name, minilm.encode, _minilm_params(minilm, dry_run), rest, None, rounds,
                           max(1, reps // 5))
        else:
            if width not in mlps:  # one set of weights per width, for every batch of it
                mlp_params = init_mlp(jax.random.PRNGKey(0), width, 4)
                mlps.clear()
                mlps[width] = mlp_params, hand_mlp_weights(mlp_params)
            mlp_params, hand = mlps[width]
            x = jax.random.normal(jax.random.PRNGKey(batch), (batch, width))
            rows += _bench(name, mlp, mlp_params, (x,), (hand_mlp, hand), rounds, reps)
        if progress is not None:
            progress("\n".join(SPEED_HEADER + rows))
    notes = [f"\n(not run, the step's time was up: {', '.join(skipped)})"] if skipped else []
    return "\n".join(SPEED_HEADER + rows + notes)


SPEED_HEADER = ["| model | batch | variant | ms | vs float32 | vs bf16 | vs bare int8 dots | rel. error vs float32 |",
                "|---|---|---|---|---|---|---|---|"]


def _minilm_params(minilm, dry_run: bool) -> dict:
    """MiniLM's random weights: its six encoder layers, or one for a dry run (the same program, a sixth of the
    compile)."""
    params = minilm.init_params()
    return {**params, "layers": params["layers"][:1]} if dry_run else params


def _bench(name, model, params, rest, hand, rounds, reps) -> list[str]:
    from speed import bare_dots, cast_floats, rel_error, time_interleaved

    qparams = quantize_params(model, params, *rest)
    static = quantize_params(model, params, *rest, activations="static")
    f32, dyn = jax.jit(model), jax.jit(int8ify(model))
    bf16_params, bf16_rest = cast_floats(params, jnp.bfloat16), cast_floats(rest, jnp.bfloat16)
    bare, bare_args = bare_dots(model, params, *rest)
    variants = {
        "float32": (f32, (params, *rest)),
        "bf16": (f32, (bf16_params, *bf16_rest)),
        "int8ify": (dyn, (params, *rest)),
        "int8ify+qparams": (dyn, (qparams, *rest)),
        "int8ify static": (dyn, (static, *rest)),
        "bare int8 dots": (bare, (bare_args,)),
    }
    if jax.default_backend() != "tpu":  # int8-fused is the int8 backend there
        fused = jax.jit(int8ify(model, backend="int8-fused"))  # one Pallas kernel per dot of a quantized weight
        variants["int8ify fused"] = (fused, (qparams, *rest))
        variants["int8ify fused static"] = (fused, (static, *rest))
    if hand is not None:
        variants["hand W8A8"] = (jax.jit(hand[0]), (hand[1], *rest))
    attention = calibrate_activation_dots(model, params, *rest)
    if attention.dots:  # the attention einsums' activations static too
        variants["int8ify static+attn"] = (jax.jit(int8ify(model, activation_scales=attention)), (static, *rest))
    if hasattr(jax, "Inline"):  # whether late inlining, int8ify's choice on CPU, pays on this device too
        variants["int8ify+qparams, late inlining"] = (jax.jit(int8ify(model, late_inlining=True)), (qparams, *rest))
    failed = _drop_failing(variants)
    times = time_interleaved(variants, rounds, reps)
    reference = f32(params, *rest)
    batch = rest[0].shape[0]
    rows = []
    for variant, ms in times.items():
        fn, args = variants[variant]
        error = float("nan") if variant == "bare int8 dots" else rel_error(fn(*args).astype(jnp.float32), reference)
        rows.append(f"| {name} | {batch} | {variant} | {ms:.3f} | {times['float32'] / ms:.2f}x | "
                    f"{times['bf16'] / ms:.2f}x | {times['bare int8 dots'] / ms:.2f}x | {error:.2e} |")
    return rows + [f"| {name} | {batch} | {variant} | failed: {error} | | | | |" for variant, error in failed.items()]


def _drop_failing(variants: dict) -> dict:
    """Remove each variant whose first call raises (one failing variant must not cost the others' timings), and
    return ``variant -> the error's last line``."""
    failed = {}
    for variant, (fn, args) in list(variants.items()):
        try:
            jax.block_until_ready(fn(*args))
        except Exception as e:  # a variant that does not run on this device is a finding, reported in the table
            lines = str(e).strip().splitlines()
            failed[variant] = f"{type(e).__name__}: {lines[-1][:200] if lines else ''}"
            del variants[variant]
    return failed


# -- 4. what exactness costs --------------------------------------------------------------------------------------
EXACTNESS_CASES = "mlp4096:4096,minilm:128"


def exactness(dry_run: bool, cases: str, progress) -> str:
    """``benchmarks/numerics_cost.py``'s table: int8ify's program against the same program with the plain formulas
    (``absmax / 127``, ``x / s`` as XLA compiles them, ``(acc * s_x) * s_w``), weights quantized per call and once;
    then ``benchmarks/quantize_pass.py``'s, one quantization pass alone. ``progress(tables)`` receives the tables
    after each row."""
    import quantize_pass
    from numerics_cost import TABLE_HEADER, exactness_rows

    models, passes = [], []

    def tables() -> str:
        parts = ["\n".join(TABLE_HEADER + models)]
        if passes:
            parts.append("One quantization pass:\n\n" + "\n".join(quantize_pass.TABLE_HEADER + passes))
        return "\n\n".join(parts)

    for row in exactness_rows("mlp64:8" if dry_run else cases, 2 if dry_run else 9):
        models.append(row)
        progress(tables())
    shapes = quantize_pass.QUICK_SHAPES if dry_run else quantize_pass.SHAPES
    for row in quantize_pass.pass_rows(shapes, *((2, 1) if dry_run else (9, 10))):
        passes.append(row)
        progress(tables())
    return tables()


# -- 5. where the device time goes ----------------------------------------------------------------------------------
def kernel_profile(dry_run: bool, progress) -> str:
    """``benchmarks/kernel_profile.py``'s tables: the MLP at d 4096 and batch 4096 (bf16, hand W8A8, int8ify with
    dynamic scales by the contract's formulas and the plain ones, and with static scales), each kernel's device
    time from a profile of 20 calls; then the MiniLM encoder at batch 128 (bf16, int8ify's three modes, its bare
    int8 dots), its kernels summed by kind over 10 calls. ``progress(tables)`` receives the tables after each
    row."""
    import kernel_profile as profiler

    width, batch, calls = (64, 8, 2) if dry_run else (4096, 4096, 20)
    minilm_batch, minilm_layers, minilm_calls = (8, 1, 2) if dry_run else (128, None, 10)
    rows = [f"MLP 4x{width}, batch {batch}, {calls} calls profiled", "", *profiler.TABLE_HEADER]
    for row in profiler.profile_rows(profiler.mlp_variants(width, batch), calls):
        rows.append(row)
        progress("\n".join(rows))
    rows += ["", f"MiniLM encoder, batch {minilm_batch} x 128, {minilm_calls} calls profiled, kernels by kind", "",
             *profiler.TABLE_HEADER]
    for row in profiler.profile_rows(profiler.minilm_variants(minilm_batch, minilm_layers), minilm_calls, top=10,
                                     kinds=True):
        rows.append(row)
        progress("\n".join(rows))
    return "\n".join(rows)


def static_steps(dry_run: bool, progress) -> str:
    """``benchmarks/static_ladder.py``'s table: the static MLP from the floor to int8ify's program, step by step
    (the eighteenth TPU run found 9% of the call in one of them). ``progress(table)`` receives it after each row."""
    import static_ladder

    width, batches, rounds, reps = (64, [8], 2, 1) if dry_run else (4096, [4096, 1024], 25, 5)
    rows = [f"Flax MLP 4 x Dense({width}) + gelu, static activation scales; ms, medians of {rounds} interleaved rounds",
            "", *static_ladder.TABLE_HEADER]
    for row in static_ladder.ladder_rows(width, batches, rounds, reps):
        rows.append(row)
        progress("\n".join(rows))
    return "\n".join(rows)


def candidate_steps(dry_run: bool, progress) -> str:
    """``benchmarks/candidate_ab.py``'s table: each candidate change to the rewrite against int8ify's program, both
    compiled ahead of time, on the block at d 384; then the TPU layout rule against the program without it on wider
    blocks (d 768, and d 512 with heads of 128), where its best form differed from d 384's on a v5e chip; then the
    candidates that change only an MLP's program, on the MLP at d 4096. ``progress(table)`` receives it after each
    row."""
    import candidate_ab

    batch, tokens, pairs, rounds, reps = (2, [20], 1, 1, 1) if dry_run else (128, [197, 128], 4, 10, 5)
    wider = [(128, 128)] if dry_run else [(768, 64), (512, 128)]  # (d, head_dim); the dry run's stands in for both
    rows = [f"Transformer block, batch {batch} (the MLP's in its rows); ms, medians of {rounds} interleaved rounds, "
            f"{pairs} pairs", "",
            *candidate_ab.TABLE_HEADER]
    mlp_width, mlp_batch = (64, 8) if dry_run else (4096, 4096)
    runs = [(sorted(set(candidate_ab.CANDIDATES) - candidate_ab.MLP_ONLY), tokens, batch, 384, 64, "block"),
            *((["xla-layouts"], tokens[:1], batch, d, head_dim, "block") for d, head_dim in wider),
            (sorted(candidate_ab.MLP_ONLY), [], mlp_batch, mlp_width, 64, "mlp")]
    for candidates, run_tokens, run_batch, d, head_dim, model in runs:
        for row in candidate_ab.candidate_rows(candidates, run_tokens, run_batch, pairs, rounds, reps, d, head_dim,
                                               model):
            rows.append(row)
            progress("\n".join(rows))
    return "\n".join(rows)


# -- 6. what the dots compile to ------------------------------------------------------------------------------------
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = \(?([a-z0-9]+)\[")
_CALL_OPERANDS = re.compile(r"(?:dot|convolution|custom-call)\(([^)]*)\)")


def gemms(hlo: str) -> list[tuple[str, str, str]]:
    """Every GEMM of an optimized HLO module as ``(kind, lhs dtype, rhs dtype)``: each ``dot`` instruction (those
    inside fusions, Triton GEMM fusions included, as well), each ``convolution`` (XLA:TPU's form of a dot) and each
    cuBLAS/cuBLASLt custom call."""
    types = {}
    for line in hlo.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            types[match.group(1)] = match.group(2)
    found = []
    for line in hlo.splitlines():
        if " dot(" in line:
            kind = "dot"
        elif " convolution(" in line:
            kind = "convolution"
        elif 'custom_call_target="__cublas' in line:
            kind = re.search(r'custom_call_target="([^"]+)"', line).group(1)
        else:
            continue
        operands = _CALL_OPERANDS.search(line)
        names = re.findall(r"%([\w.\-]+)", operands.group(1)) if operands else []  # with or without their types
        dtypes = [types.get(n, "?") for n in names[:2]] + ["?", "?"]
        found.append((kind, dtypes[0], dtypes[1]))
    return found


def hlo_check(dry_run: bool) -> str:
    import model as minilm
    from mlp import init_mlp, mlp

    width = 64 if dry_run else 1024
    params = init_mlp(jax.random.PRNGKey(0), width, 4)
    x = jnp.ones((128, width))
    cases = [("MLP", mlp, params, (x,))]
    mparams = _minilm_params(minilm, dry_run)
    ids = jnp.ones((8, 32), jnp.int32)
    cases.append(("MiniLM", minilm.encode, mparams, (ids, jnp.ones_like(ids))))
    lines = []
    for name, model, p, rest in cases:
        q = quantize_params(model, p, *rest)
        hlo = jax.jit(int8ify(model)).lower(q, *rest).compile().as_text()
        found = gemms(hlo)
        int8 = [g for g in found if g[1] == "s8" and g[2] == "s8"]
        other = [g for g in found if g not in int8]
        kinds = sorted({g[0] for g in int8})
        lines.append(f"- {name} (int8ify + quantize_params): {len(found)} GEMM(s), {len(int8)} with s8 x s8 operands "
                     f"({', '.join(kinds) or 'none'}); any other: {other[:8] or 'none'}")
    return "\n".join(lines)


# -- 7. the fused kernel against XLA's program, on the device -------------------------------------------------------
def fused_kernel(dry_run: bool, deadline: float) -> str:
    """``backend="int8-fused"`` (the Pallas kernel) against ``"int8"`` (XLA's kernels), both on this device, bit
    for bit: realistic shapes, both weight layouts, dynamic and static scales, rows of ties, zeros, NaN/Inf, tiny
    and huge values (no subnormal inputs: XLA reads them as zero, the kernel as they are)."""
    rng = np.random.default_rng(0)
    # blocks that overhang the arrays: one row (a row block of 16), 3 and 70 rows, widths that 128 does not divide
    shapes = [(8, 64, 128), (3, 64, 200)] if dry_run else [
        (1, 1024, 1024), (3, 256, 200), (70, 384, 136), (100, 384, 1152), (1024, 4096, 4096), (4096, 1536, 384)]
    lines = []
    for rows, k, n in shapes:
        if time.perf_counter() > deadline:
            lines.append(f"- {rows}x{k} @ ({k}, {n}): not run, the step's time was up")
            continue
        x = rng.normal(size=(rows, k)).astype(np.float32)
        x[: rows // 4] = rng.integers(-300, 300, size=(rows // 4, k)) / 4  # ties
        x[rows // 2:] *= np.exp2(rng.integers(-100, 100, size=(rows - rows // 2, 1))).astype(np.float32)
        if rows > 1:  # a row of zeros (not the only row: its outputs would all be zero, whatever the kernel did)
            x[0] = 0
        if rows > 2:
            x[1, 3], x[2, 5] = np.nan, np.inf
        calibration = jnp.asarray(x[3:] if rows > 3 else np.where(np.isfinite(x), x, 0))  # no NaN or Inf
        for transposed in (False, True):
            w = jnp.asarray(rng.normal(size=(n, k) if transposed else (k, n)), jnp.float32)
            fn = (lambda p, v: v @ p["w"].T) if transposed else (lambda p, v: v @ p["w"])
            for mode in ("dynamic", "static"):
                params = quantize_params(fn, {"w": w}, calibration, activations=mode)
                want = np.asarray(jax.jit(int8ify(fn))(params, x))
                got = np.asarray(jax.jit(int8ify(fn, backend="int8-fused"))(params, x))
                same = np.array_equal(got, want, equal_nan=True)
                differ = int(np.sum(~((got == want) | (np.isnan(got) & np.isnan(want)))))
                lines.append(f"- {rows}x{k} @ {'w.T' if transposed else 'w'} ({n}), {mode}: "
                             f"{'bit for bit' if same else f'{differ} of {got.size} outputs differ'}")
        # sibling dots of one activation in one kernel, one of them a DenseGeneral kernel (k, heads, n / heads)
        weights = {"a": jnp.asarray(rng.normal(size=(k, n)), jnp.float32),
                   "b": jnp.asarray(rng.normal(size=(n, k)), jnp.float32),
                   "c": jnp.asarray(rng.normal(size=(k, 4, n // 4)), jnp.float32)}
        for mode in ("dynamic", "static"):
            params = quantize_params(_siblings, weights, calibration, activations=mode)
            wants = jax.jit(int8ify(_siblings))(params, x)
            gots = jax.jit(int8ify(_siblings, backend="int8-fused"))(params, x)
            differ = sum(int(np.sum(~((np.asarray(g) == np.asarray(w)) | (np.isnan(g) & np.isnan(w)))))
                         for g, w in zip(gots, wants))
            lines.append(f"- {rows}x{k}, siblings x @ a, x @ b.T, DenseGeneral x . c, {mode}: "
                         f"{'bit for bit' if not differ else f'{differ} outputs differ'}")
    return "\n".join(lines)


def _siblings(params, x):
    return (x @ params["a"], x @ params["b"].T, jax.lax.dot_general(x, params["c"], (((1,), (0,)), ((), ()))))


# -- 8. block-scaled backends on this device ------------------------------------------------------------------------
def block_scaled() -> str:
    from jaxpr_rewrite._interpret.config import RewriteConfig

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 256)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(256, 128)), jnp.float32)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    lines = [f"- `auto` resolves to `{RewriteConfig(backend='auto').resolved_backend}` on "
             f"{jax.devices()[0].device_kind}"]
    for backend in ("mxfp8", "nvfp4"):
        out = np.asarray(jax.jit(int8ify(lambda a, b: a @ b, backend=backend))(x, w), np.float64)
        error = np.linalg.norm(out - exact) / np.linalg.norm(exact)
        lines.append(f"- `{backend}`: ran, relative error {error:.2e}")
    return "\n".join(lines)


# -- 9. XLA's int8 GEMM under each autotuning setting ---------------------------------------------------------------
AUTOTUNE_SETTINGS = ("", "--xla_gpu_autotune_level=0", "--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false")
_GEMM_SUMS = """
import jax, jax.numpy as jnp, numpy as np
from jaxpr_rewrite import Int8ifyError, int8ify
rng = np.random.default_rng(0)
for m, k, n in [(4, 3, 2), (64, 48, 128), (64, 256, 128), (512, 512, 512)]:
    a, b = (rng.integers(-127, 128, size=s).astype(np.int8) for s in ((m, k), (k, n)))
    got = np.asarray(jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.int32))(a, b), np.int64)
    want = a.astype(np.int64) @ b.astype(np.int64)
    ratio = np.median(got[want != 0] / want[want != 0])
    print(f"  - {m}x{k} @ {k}x{n}: " + ("exact" if (got == want).all() else f"wrong, median ratio {ratio:.2f}"))
try:
    int8ify(lambda x, w: x @ w)(jnp.ones((8, 64)), jnp.ones((64, 32)))
    print("  - int8ify: runs")
except Int8ifyError as error:
    print(f"  - int8ify refuses: {str(error)[:160]}...")
"""


def gemm_sums_per_autotune_setting() -> str:
    lines = []
    for flags in AUTOTUNE_SETTINGS:
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
        result = subprocess.run([sys.executable, "-c", _GEMM_SUMS], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=300)
        body = result.stdout.rstrip() or f"  - failed: {result.stderr.strip()[-600:]}"
        lines.append(f"- `XLA_FLAGS={flags}`" if flags else "- XLA's default flags")
        lines.append(body)
    return "\n".join(lines)


# -- 10. quantized weights through a SafeTensors file ------------------------------------------------------------------
def stored_round_trip(dry_run: bool) -> str:
    """Weights quantized on the device, written with ``save_safetensors`` and read back with ``load_safetensors``:
    the arrays on the device against the computed ones, byte for byte, and the outputs; then read back again with
    every tensor handed to ``jax.device_put`` as a copy of its own (an owned array, where SafeTensors' numpy arrays
    own no data and may sit off a 64-byte boundary)."""
    if importlib.util.find_spec("safetensors") is None:
        return "- skipped: safetensors is not installed (`pip install safetensors`)"
    import tempfile
    from unittest import mock

    from jaxpr_rewrite import safetensors_io

    rng = np.random.default_rng(0)
    k, n, block = (64, 32, 32) if dry_run else (256, 128, 64)
    w, x = rng.normal(size=(k, n)).astype(np.float32), rng.normal(size=(16, k)).astype(np.float32)
    real_device_put = jax.device_put

    def owned_copies(value, *args, **kwargs):
        return real_device_put(np.array(value, copy=True), *args, **kwargs)

    lines = ["| weights | arrays read back as written | outputs as the computed weights' | read back as owned copies "
             "| largest distance to float64 `x @ w`: computed, read back, computed through the host |",
             "|---|---|---|---|---|"]
    exact = x.astype(np.float64) @ w.astype(np.float64)
    cases = (("8-bit", {}, 8), ("4-bit", {}, 4), (f"8-bit, blocks of {block}", {"block_size": block}, 8),
             (f"4-bit, blocks of {block}", {"block_size": block}, 4))
    for name, options, bits in cases:
        program = int8ify(lambda p, v: v @ p["w"], **options)
        computed = quantize_params(program, {"w": w}, x, bits=bits)
        want = np.asarray(jax.jit(program)(computed, x))
        cells = []
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "w.safetensors")
            safetensors_io.save_safetensors(path, computed)
            for copies in (False, True):
                with mock.patch.object(safetensors_io.jax, "device_put", owned_copies if copies else real_device_put):
                    loaded = safetensors_io.load_safetensors(path)
                pairs = list(zip(jax.tree_util.tree_leaves(computed), jax.tree_util.tree_leaves(loaded)))
                differing = [i for i, (a, b) in enumerate(pairs) if not np.array_equal(np.asarray(a), np.asarray(b))]
                got = np.asarray(jax.jit(program)(loaded, x))
                outputs = ("the same bits" if np.array_equal(got, want) else
                           f"{np.mean(got != want):.0%} differ, up to {np.max(np.abs(got - want)):.3g}")
                if not copies:
                    cells.append("yes" if not differing else f"no: leaves {differing} of {len(pairs)}")
                    read_back = got
                cells.append(outputs)
        # which side is wrong when they differ: each against the float weight, and the computed weights handed to
        # the device again from host copies (no file)
        through_host = np.asarray(jax.jit(program)(jax.tree_util.tree_map(owned_copies, computed), x))
        cells.append(", ".join(f"{np.max(np.abs(out - exact)):.3g}" for out in (want, read_back, through_host)))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


STEPS = ("tests", "speed", "exactness", "profile", "ladder", "candidates", "fused", "hlo", "blocks", "autotune",
         "stored")
GPU_ONLY_STEPS = ("fused", "autotune")  # XLA:GPU's fused kernel and autotuner


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes and one test: checks the script itself")
    parser.add_argument("--out", help="results file (default: benchmarks/results/<device>.md)")
    parser.add_argument("--steps", help=f"which steps to run after the environment, comma-separated (default: all of "
                        f"{STEPS}, less {GPU_ONLY_STEPS} on a TPU)")
    parser.add_argument("--tests", nargs="*",
                        help="pytest node ids for the test step (default: the accelerator-relevant ones)")
    parser.add_argument("--tb", default="line", choices=["line", "short", "long"],
                        help="pytest's traceback style for the test step")
    parser.add_argument("--test-log", help="file for pytest's whole output")
    parser.add_argument("--test-timeout", type=float, default=150.0, help="seconds for the test step")
    parser.add_argument("--models", default=SPEED_CASES, help="the speed step's models, as mlpWIDTH:BATCH and "
                        "minilm:BATCH, comma-separated, most telling first")
    parser.add_argument("--exactness-models", default=EXACTNESS_CASES,
                        help="the exactness step's models, as --models takes them")
    parser.add_argument("--speed-time", type=float, default=200.0,
                        help="seconds after which the speed step starts no further model")
    parser.add_argument("--fused-time", type=float, default=90.0,
                        help="seconds after which the fused-kernel step starts no further shape")
    ns = parser.parse_args(argv)
    default_steps = [s for s in STEPS if not (tpu_host() and s in GPU_ONLY_STEPS)]
    steps = set(ns.steps.split(",")) if ns.steps else set(default_steps)
    if not steps <= set(STEPS):
        parser.error(f"--steps: unknown {sorted(steps - set(STEPS))}; the steps are {STEPS}")
    # the tests' process opens the device before this one does: a TPU chip is held by one process at a time
    tests = timed("Tests on the device", run_tests, ns.test_timeout, ns.dry_run, ns.tests, ns.tb,
                  Path(ns.test_log) if ns.test_log else None) if "tests" in steps else None
    device = jax.devices()[0].device_kind
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "device"
    out = Path(ns.out) if ns.out else ROOT / "benchmarks" / "results" / f"{slug}.md"
    report = Report(out)
    step(report, "Environment", environment)
    if tests is not None:
        report.add(*tests)
    if "speed" in steps:
        growing_step(report, "Speed (ms, medians of interleaved runs)", speed, ns.dry_run,
                     time.perf_counter() + ns.speed_time, ns.models)
    if "exactness" in steps:
        growing_step(report, "What exactness costs (ms, medians of interleaved runs)", exactness, ns.dry_run,
                     ns.exactness_models)
    if "profile" in steps:
        growing_step(report, "Where the device time goes (profiled kernels)", kernel_profile, ns.dry_run)
    if "ladder" in steps:
        growing_step(report, "Static scales, step by step (ms, medians of interleaved runs)", static_steps, ns.dry_run)
    if "candidates" in steps:
        growing_step(report, "Candidate changes against int8ify's program (ms, in pairs)", candidate_steps,
                     ns.dry_run)
    if "fused" in steps:
        step(report, "The fused kernel against XLA's program", fused_kernel, ns.dry_run,
             time.perf_counter() + ns.fused_time)
    if "hlo" in steps:
        step(report, "What the dots compile to (optimized HLO)", hlo_check, ns.dry_run)
    if "blocks" in steps:
        step(report, "Block-scaled backends", block_scaled)
    if "autotune" in steps:
        step(report, "XLA's int8 GEMM under each autotuning setting", gemm_sums_per_autotune_setting)
    if "stored" in steps:
        step(report, "Quantized weights through a SafeTensors file", stored_round_trip, ns.dry_run)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
