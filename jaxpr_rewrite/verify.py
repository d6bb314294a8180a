"""``verify``: check a traced program against the int8 contract -- the dynamic twin of the lint plugin.

The linter reads source code; ``verify`` traces the function and inspects the jaxpr that would run, nested
jaxprs included, so it sees through helpers, libraries and ``int8ify``. Findings use the lint plugin's codes:

======  ==============================================================================================
JX101   float ``dot_general`` (a float matmul, einsum, or a matmul of scales)
JX102   integer ``dot_general`` without int32 accumulation (``preferred_element_type`` not int32)
JX103   a broadcast product of two operands expanded along different axes, fed to ``reduce_sum`` over a
        shared axis: a matmul emulated over all B x D_in x D_out products
JX104   convolution (``conv_general_dilated``)
JX201   Python branch on a traced value (tracing fails; reported at the user's line)
JX202   ``bool()`` / ``int()`` / ``float()`` / ``.item()`` on a traced value
JX301   host callback (``jax.pure_callback``, ``io_callback``)
JX302   ``jax.debug.print`` / ``jax.debug.breakpoint`` / ``jax.debug.callback``
======  ==============================================================================================
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import re
import traceback

import jax
import jax.extend  # noqa: F401
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Var, jaxprs_in_params

from .api import Int8ified
from .report import _placeholder, source_location

__all__ = ["Finding", "assert_int8", "verify", "verify_jaxpr"]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One breach of the contract.

    Attributes:
        code: the rule (``"JX101"`` ...), as in the lint plugin.
        message: what is wrong and what to do instead.
        file, line: the user's source (``None`` when unknown).
        primitive: the offending primitive (``"dot_general"``, ``"pure_callback"``, ...); for JX201/JX202 the
            exception JAX raised while tracing.
    """

    code: str
    message: str
    file: str | None
    line: int | None
    primitive: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else (self.file or "<unknown>")
        return f"{where}: {self.code} {self.message}"


_CALLBACKS = {"pure_callback": "jax.pure_callback", "io_callback": "io_callback", "callback": "a host callback"}
_DEBUG = {"debug_callback": "jax.debug.callback/breakpoint", "debug_print": "jax.debug.print"}
_INTEGER_ACCUMULATORS = (np.dtype(np.int32), np.dtype(np.int64))


def _types(eqn) -> str:
    ins = " x ".join(v.aval.str_short(short_dtypes=True) for v in eqn.invars)
    return f"{ins} -> {eqn.outvars[0].aval.str_short(short_dtypes=True)}"


def _is_float(dtype) -> bool:
    return jax.numpy.issubdtype(dtype, jax.numpy.inexact)


def _finding(code: str, eqn, message: str) -> Finding:
    file, line, _ = source_location(eqn)
    return Finding(code, message, file, line, eqn.primitive.name)


# -- JX103: a matmul emulated by broadcasting --------------------------------------------------------------
_PASS_THROUGH = ("convert_element_type", "copy", "copy_p")


def _expanded_axes(var, out_shape, producers) -> frozenset[int]:
    """Axes of ``out_shape`` along which ``var`` is broadcast: size 1 in ``var`` itself (``mul`` broadcasts
    size-1 dims), or added / size 1 in the operand of the ``broadcast_in_dim`` that produced it."""
    axes = {a for a, n in enumerate(var.aval.shape) if n == 1 and out_shape[a] > 1}
    eqn = producers.get(var)
    while eqn is not None and eqn.primitive.name in _PASS_THROUGH:
        eqn = producers.get(eqn.invars[0]) if isinstance(eqn.invars[0], Var) else None
    if eqn is not None and eqn.primitive.name == "broadcast_in_dim":
        in_shape = eqn.invars[0].aval.shape
        source = {d: in_shape[i] for i, d in enumerate(eqn.params["broadcast_dimensions"])}
        axes |= {a for a, n in enumerate(eqn.outvars[0].aval.shape) if n > 1 and source.get(a, 1) == 1}
    return frozenset(axes)


def _reduce_consumers(var, consumers) -> list:
    found, frontier = [], [var]
    while frontier:
        v = frontier.pop()
        for eqn in consumers.get(v, ()):
            if eqn.primitive.name == "reduce_sum":
                found.append(eqn)
            elif eqn.primitive.name in _PASS_THROUGH:
                frontier.extend(eqn.outvars)
    return found


def _emulated_matmul(eqn, producers, consumers) -> str | None:
    """A description of the emulated matmul when ``eqn`` (a ``mul``) is the JX103 pattern, else ``None``."""
    out = eqn.outvars[0].aval
    if len(out.shape) < 3 or not all(isinstance(v, Var) for v in eqn.invars):
        return None
    lhs, rhs = (_expanded_axes(v, out.shape, producers) for v in eqn.invars)
    # outer-product structure: each operand spans an axis the other is broadcast along
    if not (rhs - lhs) or not (lhs - rhs):
        return None
    for reduction in _reduce_consumers(eqn.outvars[0], consumers):
        contracted = [a for a in reduction.params["axes"] if a not in lhs | rhs and out.shape[a] > 1]
        if contracted:
            dims = "x".join(str(n) for n in out.shape)
            return f"{dims} product summed over axis {contracted[0]}"
    return None


# -- the walk --------------------------------------------------------------------------------------------
def _check_jaxpr(jaxpr: Jaxpr, findings: list, seen: set) -> None:
    if id(jaxpr) in seen:
        return
    seen.add(id(jaxpr))
    producers, consumers = {}, {}
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            producers[v] = eqn
        for v in eqn.invars:
            if isinstance(v, Var):
                consumers.setdefault(v, []).append(eqn)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if eqn.primitive is lax.dot_general_p:
            dtypes = [v.aval.dtype for v in eqn.invars]
            out_dtype = eqn.outvars[0].aval.dtype
            if any(_is_float(d) for d in dtypes):
                findings.append(_finding("JX101", eqn, (
                    f"float dot_general {_types(eqn)}: quantize both operands to int8 (absmax/127 scales per "
                    "row/column) and multiply the codes with preferred_element_type=jnp.int32, or wrap the "
                    "function in int8ify"
                )))
            elif np.dtype(out_dtype) not in _INTEGER_ACCUMULATORS:
                findings.append(_finding("JX102", eqn, (
                    f"integer dot_general {_types(eqn)} does not accumulate in int32 (sums of int8 products "
                    "overflow int8/int16): pass preferred_element_type=jnp.int32"
                )))
        elif name == "mul":
            what = _emulated_matmul(eqn, producers, consumers)
            if what is not None:
                findings.append(_finding("JX103", eqn, (
                    f"broadcast multiply and sum emulates a matmul ({what}): multiply the int8 codes with "
                    "jnp.matmul(..., preferred_element_type=jnp.int32) instead"
                )))
        elif name == "conv_general_dilated":
            findings.append(_finding("JX104", eqn, (
                f"convolution {_types(eqn)} is outside the int8 contract: express it as an int8 matmul of "
                "patches (int32 accumulation) or keep it out of the verified function"
            )))
        elif name in _CALLBACKS:
            findings.append(_finding("JX301", eqn, (
                f"{_CALLBACKS[name]} calls back into Python on the host: compute it with jax.numpy / lax "
                "operations inside the program"
            )))
        elif name in _DEBUG:
            findings.append(_finding("JX302", eqn, (
                f"{_DEBUG[name]} left in the traced program: remove it (or guard it out) from the verified path"
            )))
        for sub in jaxprs_in_params(eqn.params):
            _check_jaxpr(sub, findings, seen)


def verify_jaxpr(jaxpr) -> list[Finding]:
    """The findings of a traced program (a ``Jaxpr`` or ``ClosedJaxpr``), nested jaxprs included."""
    findings: list[Finding] = []
    _check_jaxpr(jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr, findings, set())
    return findings


# -- JX201 / JX202: tracing failed on a concrete-value conversion -----------------------------------------
_TRACING_ERRORS = (
    jax.errors.TracerBoolConversionError,
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (jax, np, __import__("jaxlib"), __import__("jaxpr_rewrite"))
)
_BRANCH = re.compile(r"^\s*(if|elif|while|assert)\b|\bif\b.*\belse\b")
_CONVERSION = re.compile(r"\b(bool|int|float|complex|operator\.index)\(|\.item\(|\.tolist\(")


def _user_frame(exc: BaseException):
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_LIBRARY_DIRS) and not frame.filename.startswith("<frozen"):
            return frame
    return frames[-1] if frames else None


def _tracing_finding(exc: BaseException) -> Finding:
    frame = _user_frame(exc)
    file, line = (frame.filename, frame.lineno) if frame is not None else (None, None)
    text = (linecache.getline(file, line) if file else "") or (frame.line if frame is not None else "") or ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if _BRANCH.search(text) or not _CONVERSION.search(text):
        code, advice = "JX201", (
            "Python control flow on a traced value: use jnp.where / lax.select for values, lax.cond / "
            "lax.switch / lax.while_loop for control flow"
        )
    else:
        code, advice = "JX202", (
            "converting a traced value to a Python scalar (bool()/int()/float()/.item()): keep it an array "
            "and use jnp.where / lax operations"
        )
    message = f"{advice} ({type(exc).__name__}: {first}"
    message += f"; at `{text.strip()}`)" if text.strip() else ")"
    return Finding(code, message, file, line, type(exc).__name__)


# -- entry points ----------------------------------------------------------------------------------------
def _is_dynamic_leaf(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex, jax.ShapeDtypeStruct))


def trace_program(fn, *args, **kwargs) -> ClosedJaxpr:
    """The program ``fn(*args, **kwargs)`` would run, traced without running.

    An :class:`Int8ified` gives its rewritten program. For a plain function, array leaves (and
    ``jax.ShapeDtypeStruct``, and Python numbers) are traced and every other leaf is passed as a static
    Python value; use ``functools.partial`` for static numbers.
    """
    args, kwargs = jax.tree_util.tree_map(_placeholder, (args, kwargs))
    if isinstance(fn, Int8ified):
        return fn.rewritten_jaxpr(*args, **kwargs)
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    is_dynamic = [_is_dynamic_leaf(x) for x in leaves]
    dynamic = [x for x, d in zip(leaves, is_dynamic) if d]

    def flat_fn(*flat):
        it = iter(flat)
        full = [next(it) if d else x for x, d in zip(leaves, is_dynamic)]
        a, k = jax.tree_util.tree_unflatten(tree, full)
        return jax.tree_util.tree_leaves(fn(*a, **k))

    return jax.make_jaxpr(flat_fn)(*dynamic)


def verify(fn, *args, **kwargs) -> list[Finding]:
    """Trace ``fn(*args, **kwargs)`` and check the program against the int8 contract.

    Arguments:
        fn: a function, an ``int8ify``-wrapped function (its rewritten program is checked), or an already
            traced ``Jaxpr`` / ``ClosedJaxpr`` (then no arguments).
        *args, **kwargs: arguments of a call: arrays or ``jax.ShapeDtypeStruct`` (nothing runs).

    Returns:
        The findings, in program order (empty when the program keeps the contract). A Python branch on a
        traced value, which makes tracing fail, is returned as a JX201 (or JX202) finding at the user's line.
    """
    if isinstance(fn, (Jaxpr, ClosedJaxpr)):
        return verify_jaxpr(fn)
    try:
        closed = trace_program(fn, *args, **kwargs)
    except _TRACING_ERRORS as exc:
        return [_tracing_finding(exc)]
    return verify_jaxpr(closed)


def assert_int8(fn, *args, **kwargs) -> None:
    """``assert`` that :func:`verify` finds nothing; the error lists every finding, one per line."""
    findings = verify(fn, *args, **kwargs)
    if findings:
        lines = "\n".join(f"  {f}" for f in findings)
        raise AssertionError(f"{len(findings)} int8 contract finding(s):\n{lines}")
