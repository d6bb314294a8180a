"""``verify``: check a traced program against the int8 contract -- the dynamic twin of the lint plugin.

The linter reads source code; ``verify`` traces the function and inspects the jaxpr that would run, nested
jaxprs included, so it sees through helpers, libraries and ``int8ify``. Findings use the lint plugin's codes and
advice, from the one table in :mod:`jx_codes`:

======  ==============================================================================================
JX101   float ``dot_general`` / ``ragged_dot_general`` that sums over an index (a float matmul, einsum, or a
        matmul of scales; not an einsum that sums nothing, such as ``"...k,k->...k"``)
JX102   integer matmul without int32 accumulation (``preferred_element_type`` not int32)
JX103   a broadcast product of two operands expanded along different axes, fed to ``reduce_sum`` over a
        shared axis: a matmul emulated over all B x D_in x D_out products
JX104   convolution (``conv_general_dilated``)
JX105   a call that computes float matmuls out of the jaxpr's reach (cuDNN's fused attention, a
        ``jax.experimental.sparse`` product, ``Exported.call`` of a module holding float matmuls)
JX201   Python control flow on a traced value (tracing fails; reported at the user's line)
JX202   a traced value forced to a concrete value: ``bool()`` / ``int()`` / ``float()`` / ``.item()``, a numpy
        function given a traced array
JX301   host callback (``jax.pure_callback``, ``io_callback``)
JX302   ``jax.debug.print`` / ``jax.debug.breakpoint`` / ``jax.debug.callback``
======  ==============================================================================================
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend  # noqa: F401
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Var

from jx_codes import (
    BROADCAST_MULTIPLY_SUM,
    CONVOLUTION,
    DEBUG_CALLBACK,
    FLOAT_MATMUL,
    HIDDEN_MATMUL,
    HOST_CALLBACK,
    INT8_ACCUMULATOR,
    Code,
)

from .._core.errors import TracedValueError
from .._core.jaxprs import forward_jaxprs, hidden_matmuls, is_float_dot, is_matmul, matmul_dimension_numbers, open_jaxpr
from .._core.source import UNKNOWN, Location, eqn_location
from .._tracing.tracing import Int8ifiedBase, target_of, trace

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


def _finding(code: Code, eqn, what: str, where: Location = UNKNOWN) -> Finding:
    """The finding ``code`` for ``eqn``: ``what`` is wrong there, then the code's advice. ``where``: the enclosing
    equation's source, for an equation JAX recorded none for (one bound inside a library)."""
    location = eqn_location(eqn, where)
    return Finding(code.code, f"{what}: {code.instead}", location.file, location.line, eqn.primitive.name)


def _contracts(eqn) -> bool:
    """Whether a matmul equation sums over an index (has contracting dims, of any size): what a matmul is, for
    the lint rules too. A ``dot_general`` without one (``jnp.einsum("...k,k->...k")``, ``"i,j->ij"``) is an
    elementwise or outer product: no sum to quantize."""
    (lhs_contracting, _), _ = matmul_dimension_numbers(eqn)
    return len(lhs_contracting) > 0


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
def _check_jaxpr(jaxpr: Jaxpr, findings: list, seen: set, where: Location = UNKNOWN) -> None:
    """Check one jaxpr and, through :func:`~jaxpr_rewrite._core.jaxprs.forward_jaxprs`, the ones nested in it
    (``where``: the source of the equation that holds it)."""
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
        if is_matmul(eqn) and _contracts(eqn):
            if is_float_dot(eqn):
                findings.append(_finding(FLOAT_MATMUL, eqn, f"float {name} {_types(eqn)}"))
            elif np.dtype(eqn.outvars[0].aval.dtype) not in _INTEGER_ACCUMULATORS:
                findings.append(_finding(INT8_ACCUMULATOR, eqn, (
                    f"integer {name} {_types(eqn)} does not accumulate in int32 (sums of int8 products "
                    "overflow int8/int16)"
                )))
        elif name == "mul":
            what = _emulated_matmul(eqn, producers, consumers)
            if what is not None:
                findings.append(_finding(BROADCAST_MULTIPLY_SUM, eqn,
                                         f"broadcast multiply and sum emulates a matmul ({what})"))
        elif (hidden := hidden_matmuls(eqn)) is not None:  # asked once: an exported module is printed to read it
            findings.append(_finding(HIDDEN_MATMUL, eqn, f"{name} {hidden}", where))
        elif name == "conv_general_dilated":
            findings.append(_finding(CONVOLUTION, eqn, f"convolution {_types(eqn)} is outside the int8 contract"))
        elif name in _CALLBACKS:
            findings.append(_finding(HOST_CALLBACK, eqn, f"{_CALLBACKS[name]} calls back into Python on the host"))
        elif name in _DEBUG:
            findings.append(_finding(DEBUG_CALLBACK, eqn, f"{_DEBUG[name]} left in the traced program"))
        for sub in forward_jaxprs(eqn):
            _check_jaxpr(sub, findings, seen, eqn_location(eqn, where))


def verify_jaxpr(jaxpr) -> list[Finding]:
    """The findings of a traced program (a ``Jaxpr`` or ``ClosedJaxpr``), nested jaxprs included (not the ones
    that only define derivatives, such as a ``custom_linear_solve``'s ``matvec``)."""
    findings: list[Finding] = []
    _check_jaxpr(open_jaxpr(jaxpr), findings, set())
    return findings


# -- entry points ----------------------------------------------------------------------------------------
def trace_program(fn, *args, **kwargs) -> ClosedJaxpr:
    """The program ``fn(*args, **kwargs)`` would run, traced without running.

    An ``int8ify``-wrapped function gives its rewritten program. Array leaves (and ``jax.ShapeDtypeStruct``) are
    traced; every other leaf is a static Python value, as for ``int8ify``.
    """
    if isinstance(fn, Int8ifiedBase):
        return fn.rewritten_jaxpr(*args, **kwargs)
    function, _, signature_of = target_of(fn, "verify")
    return trace(function, *signature_of(args, kwargs)).jaxpr


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
    except TracedValueError as exc:
        message = f"{exc.advice} ({exc.detail}" + (f"; at `{exc.text}`)" if exc.text else ")")
        return [Finding(exc.code, message, exc.file, exc.line, exc.exception)]
    return verify_jaxpr(closed)


def assert_int8(fn, *args, **kwargs) -> None:
    """``assert`` that :func:`verify` finds nothing; the error lists every finding, one per line."""
    findings = verify(fn, *args, **kwargs)
    if findings:
        lines = "\n".join(f"  {f}" for f in findings)
        raise AssertionError(f"{len(findings)} int8 contract finding(s):\n{lines}")
