"""Command line: ``python -m jaxpr_rewrite {show,report,verify} TARGET --args "f32[8,64] f32[64,32]"``.

``TARGET`` is ``package.module:function`` or ``path/to/file.py:function`` (a dotted attribute path after the
colon is followed, e.g. ``model:Block.apply``). ``--args`` lists one array per positional argument in jaxpr
notation: ``f32[8,64]``, ``bf16[4,128]``, ``i8[16,16]``, scalars ``f32[]`` or just ``f32``.

* ``show`` prints the rewritten jaxpr; ``--diff`` prints the float program and the rewritten one side by
  side, the rewritten equations marked ``-`` (left) / ``+`` (right).
* ``report`` prints the table of every dot (see :func:`jaxpr_rewrite._inspect.report.report`), with errors measured
  on seeded random normal inputs (``--seed``; ``--no-measure`` to trace only).
* ``verify`` checks the function as written against the int8 contract (``--int8ify``: the rewritten
  program instead); it prints ``file:line: CODE message`` per finding and exits 1 when there are any.

Exit status: 0 success / no findings, 1 findings, 2 a usage error (bad target, shapes or options).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import inspect
import itertools
import os
import re
import sys
from typing import Sequence

import jax
import jax.extend  # noqa: F401
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from ._api import Int8ified, int8ify
from ._core.errors import Int8ifyError
from ._core.jaxprs import sub_jaxprs
from ._inspect.report import report
from ._interpret.rules import rule_for
from ._core.source import short_path
from ._inspect.verify import verify

__all__ = ["main", "parse_args_spec", "resolve_target", "side_by_side"]

_DTYPES = {
    "bf16": jnp.bfloat16, "f16": np.float16, "f32": np.float32, "f64": np.float64,
    "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
    "u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64,
    "bool": np.bool_, "pred": np.bool_, "c64": np.complex64, "c128": np.complex128,
}
_SPEC = re.compile(r"([A-Za-z][A-Za-z0-9_]*)(?:\[([^\]]*)\])?")


class UsageError(Exception):
    """A bad command line (target, shapes, options): exit status 2."""


def parse_args_spec(text: str) -> list[jax.ShapeDtypeStruct]:
    """``"f32[8,64] bf16[4,128] i32"`` -> ``ShapeDtypeStruct``s (whitespace- or comma-separated)."""
    specs, pos = [], 0
    text = text.strip()
    while pos < len(text):
        if text[pos] in " ,\t\n":
            pos += 1
            continue
        match = _SPEC.match(text, pos)
        if match is None:
            raise UsageError(f"cannot parse array spec at {text[pos:]!r}; expected e.g. f32[8,64]")
        name, dims = match.group(1), match.group(2)
        dtype = _DTYPES.get(name)
        if dtype is None:
            try:
                dtype = jnp.dtype(name)
            except TypeError:
                raise UsageError(f"unknown dtype {name!r} in {match.group(0)!r}; known: {', '.join(_DTYPES)}") from None
        try:
            # every comma separates two dims: f32[4,,8] or f32[4,] lacks one (f32[] is a scalar)
            shape = tuple(int(d) for d in dims.split(",")) if dims and dims.strip() else ()
        except ValueError:
            raise UsageError(f"bad shape in {match.group(0)!r}: dims must be integers, one between each two "
                             "commas") from None
        if any(d < 0 for d in shape):
            raise UsageError(f"bad shape in {match.group(0)!r}: dims must be non-negative")
        if np.dtype(dtype).itemsize == 8 and not jax.config.jax_enable_x64:
            # a 64-bit array needs x64 mode, or JAX silently makes it 32-bit
            jax.config.update("jax_enable_x64", True)
        specs.append(jax.ShapeDtypeStruct(shape, dtype))
        pos = match.end()
    return specs


def random_inputs(specs: Sequence[jax.ShapeDtypeStruct], seed: int = 0) -> list[np.ndarray]:
    """Seeded random arrays: standard normal floats, integers in [-127, 127] (clipped to the dtype), bools."""
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in specs:
        dtype = np.dtype(spec.dtype)
        if jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating):
            arrays.append(rng.standard_normal(spec.shape).astype(dtype))
        elif dtype == np.bool_:
            arrays.append(rng.random(spec.shape) < 0.5)
        else:
            info = np.iinfo(dtype)
            arrays.append(rng.integers(max(info.min, -127), min(info.max, 127) + 1, spec.shape).astype(dtype))
    return arrays


def resolve_target(target: str):
    """``module:attr`` or ``path/to/file.py:attr`` -> the object."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"target must be module:function or path/to/file.py:function, got {target!r}")
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise UsageError(f"no such file: {module_name}")
        directory = os.path.dirname(path)
        if directory not in sys.path:
            sys.path.insert(0, directory)
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(name, module)
        try:
            spec.loader.exec_module(module)
        except SyntaxError as e:
            raise UsageError(f"cannot load {module_name}: {type(e).__name__} at line {e.lineno}: {e.msg}") from None
        except ImportError as e:
            raise UsageError(f"cannot load {module_name}: {e}") from None
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except SyntaxError as e:
            raise UsageError(f"cannot load {module_name!r}: SyntaxError in {e.filename} at line {e.lineno}: "
                             f"{e.msg}") from None
        except ImportError as e:
            raise UsageError(f"cannot import {module_name!r}: {e}") from None
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise UsageError(f"{target!r} is not callable")
    return obj


def _options(ns) -> dict:
    options = {}
    if ns.skip:
        options["skip"] = tuple(ns.skip)
    if ns.min_contracting_size is not None:
        options["min_contracting_size"] = ns.min_contracting_size
    if ns.granularity is not None:
        options["granularity"] = ns.granularity
    if ns.block_size is not None:
        options["block_size"] = ns.block_size
    return options


def _wrapped(fn, options: dict) -> Int8ified:
    """``fn`` under the command line's options; an ``@int8ify`` target keeps its own unless overridden."""
    if isinstance(fn, Int8ified):
        return fn.with_options(**options) if options else fn
    return int8ify(fn, **options)


# -- side-by-side diff -----------------------------------------------------------------------------------
def _names():
    letters = "abcdefghijklmnopqrstuvwxyz"
    for n in itertools.count(1):
        for combo in itertools.product(letters, repeat=n):
            yield "".join(combo)


def _short(aval) -> str:
    return aval.str_short(short_dtypes=True) if hasattr(aval, "str_short") else str(aval)


def _params(eqn) -> str:
    """The params the diff shows for ``eqn``: its primitive's ``label`` rule, else its ``axes`` or ``name``."""
    p = eqn.params
    label = rule_for(eqn.primitive.name).label
    if label is not None:
        parts = label(p)
    elif "axes" in p:
        parts = [f"axes={tuple(p['axes'])}"]
    elif "name" in p and isinstance(p["name"], str):
        parts = [f"name={p['name']}"]
    else:
        parts = []
    return f"[{' '.join(parts)}]" if parts else ""


def jaxpr_lines(jaxpr) -> list[tuple[tuple, str]]:
    """One ``(signature, text)`` per equation (nested jaxprs indented), for aligning two programs."""
    names = _names()
    table: dict = {}

    def name(atom):
        if isinstance(atom, Literal):
            return repr(atom.val.item()) if np.ndim(atom.val) == 0 and hasattr(atom.val, "item") else str(atom.val)
        if atom not in table:
            table[atom] = next(names)
        return table[atom]

    def typed(v):
        return f"{name(v)}:{_short(v.aval)}"

    lines: list[tuple[tuple, str]] = []

    def walk(j: Jaxpr, depth: int):
        pad = "  " * depth
        for eqn in j.eqns:
            outs = " ".join(typed(v) for v in eqn.outvars) or "_"
            ins = " ".join(name(v) for v in eqn.invars)
            sig = (depth, eqn.primitive.name, tuple(_short(v.aval) for v in eqn.outvars))
            lines.append((sig, f"{pad}{outs} = {eqn.primitive.name}{_params(eqn)} {ins}".rstrip()))
            for sub in sub_jaxprs(eqn):
                ins = " ".join(typed(v) for v in [*sub.constvars, *sub.invars])
                lines.append(((depth + 1, "{"), f"{pad}  {{ lambda {ins} ."))
                walk(sub, depth + 2)
                lines.append(((depth + 1, "}"), f"{pad}  }} -> ({' '.join(name(v) for v in sub.outvars)})"))

    top = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    lines.append(((0, "in"), "in " + " ".join(typed(v) for v in top.invars)))
    walk(top, 1)
    lines.append(((0, "out"), "out " + " ".join(name(v) for v in top.outvars)))
    return lines


def side_by_side(before, after, width: int = 72) -> str:
    """Two programs in two columns, aligned on equal equations; changed ones marked ``-`` / ``+``."""
    left, right = jaxpr_lines(before), jaxpr_lines(after)
    matcher = difflib.SequenceMatcher(None, [s for s, _ in left], [s for s, _ in right], autojunk=False)
    width = min(width, max(len(t) for _, t in left))

    def cell(text: str) -> str:
        return text if len(text) <= width else text[: width - 3] + "..."

    out = [f"  {'float program'.ljust(width)}  |   rewritten program"]
    out.append(f"  {'-' * width}  |   {'-' * min(width, 40)}")
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        n = max(i2 - i1, j2 - j1)
        for k in range(n):
            lt = left[i1 + k][1] if i1 + k < i2 else ""
            rt = right[j1 + k][1] if j1 + k < j2 else ""
            lm = ("-" if tag != "equal" else " ") if lt else " "
            rm = ("+" if tag != "equal" else " ") if rt else " "
            out.append(f"{lm} {cell(lt).ljust(width)}  | {rm} {rt}".rstrip())
    return "\n".join(out)


# -- commands --------------------------------------------------------------------------------------------
def _cmd_show(ns, fn, specs) -> int:
    wrapped = _wrapped(fn, _options(ns))
    rewritten = wrapped.rewritten_jaxpr(*specs)
    if ns.diff:
        print(side_by_side(wrapped.float_jaxpr(*specs), rewritten, width=ns.width))
    else:
        print(rewritten)
    return 0


def _cmd_report(ns, fn, specs) -> int:
    wrapped = _wrapped(fn, _options(ns))
    if ns.plot and ns.no_measure:
        raise UsageError("--plot draws the measured errors; it cannot be combined with --no-measure")
    if ns.seed < 0:  # numpy's error would be reported as one of --args
        raise UsageError(f"--seed must be a non-negative integer, got {ns.seed}")
    inputs = specs if ns.no_measure else random_inputs(specs, ns.seed)
    rows = report(wrapped, *inputs)
    print(rows)
    if ns.plot:
        rows.plot(ns.plot)
        print(f"wrote {ns.plot}")
    return 0


def _cmd_verify(ns, fn, specs) -> int:
    if ns.int8ify:
        target = _wrapped(fn, _options(ns))
    else:
        target = fn.fn if isinstance(fn, Int8ified) and ns.as_written else fn
    findings = verify(target, *specs)
    for f in findings:
        print(f"{short_path(f.file) if f.file else '<unknown>'}:{f.line}: {f.code} {f.message}")
    if not findings:
        print(f"{ns.target}: no findings")
    return 1 if findings else 0


def _parser() -> argparse.ArgumentParser:
    command = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    parser = argparse.ArgumentParser(
        prog=command if command and not command.startswith("__main__") else "python -m jaxpr_rewrite",
        description="Inspect and verify the int8 rewrite of a JAX function.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("target", help="module:function or path/to/file.py:function")
        p.add_argument("--args", required=True,
                       help='one array per positional argument, e.g. "f32[8,64] f32[64,32]"')
        p.add_argument("--skip", action="append", metavar="PATTERN",
                       help="name-scope pattern to keep in float (repeatable)")
        p.add_argument("--min-contracting-size", type=int, help="keep dots summing fewer products in float")
        p.add_argument("--granularity", choices=("per-channel", "per-tensor"))
        p.add_argument("--block-size", type=int, help="one scale per block of this many contraction elements")

    show = sub.add_parser("show", help="print the rewritten jaxpr")
    common(show)
    show.add_argument("--diff", action="store_true", help="float and rewritten programs side by side")
    show.add_argument("--width", type=int, default=72, help="column width of --diff (default 72)")
    rep = sub.add_parser("report", help="print the table of every dot_general")
    common(rep)
    rep.add_argument("--seed", type=int, default=0, help="seed of the random normal inputs (default 0)")
    rep.add_argument("--no-measure", action="store_true", help="trace only: no measured errors")
    rep.add_argument("--plot", metavar="PATH", help="also draw the per-dot errors as a bar chart (PNG/SVG/PDF)")
    ver = sub.add_parser("verify", help="check the function against the int8 contract; exit 1 on findings")
    common(ver)
    ver.add_argument("--int8ify", action="store_true",
                     help="verify the rewritten program instead of the function as written")
    ver.add_argument("--as-written", action="store_true",
                     help="for an @int8ify target: verify the undecorated function")
    return parser


def _check_arity(target: str, fn, specs) -> None:
    """The function must take as many positional arguments as ``--args`` lists."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if not len(required) <= len(specs) <= len(positional):
        wanted = len(required) if len(required) == len(positional) else f"{len(required)} to {len(positional)}"
        raise UsageError(f"{target} takes {wanted} positional argument(s) "
                         f"({', '.join(p.name for p in positional)}), but --args gives {len(specs)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    ns = parser.parse_args(argv)
    try:
        specs = parse_args_spec(ns.args)
        fn = resolve_target(ns.target)
        _check_arity(ns.target, fn.fn if isinstance(fn, Int8ified) else fn, specs)
        command = {"show": _cmd_show, "report": _cmd_report, "verify": _cmd_verify}[ns.command]
        try:
            return command(ns, fn, specs)
        except (TypeError, ValueError) as e:  # JAX rejected the arrays: shapes or dtypes that do not fit
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"{ns.target} cannot run on --args {ns.args!r}: {first}") from None
    except (UsageError, Int8ifyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
