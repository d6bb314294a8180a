"""What a jaxpr holds: its equations, its matmuls, and where higher-order primitives keep their sub-jaxprs.

One table, :data:`SUBJAXPR_PARAMS`, says which param of which higher-order primitive holds a sub-jaxpr that runs
in the forward pass (filled by each primitive's rule, :func:`jaxpr_rewrite._interpret.rules.register`); the rewrite, the
report, the verifier, the command line, the examples and the tests all walk programs through
:func:`forward_jaxprs` / :func:`iter_eqns` / :func:`dot_eqns` instead of each knowing it.
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple

import jax
import jax.extend  # noqa: F401  (makes jax.extend.core importable)
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Var

from .._compat import scan_counts

__all__ = [
    "BRANCH_PARAMS",
    "CONVOLUTION_PRIMITIVES",
    "DERIVATIVE_ONLY_PARAMS",
    "HIDDEN_MATMULS",
    "MATMUL_PRIMITIVES",
    "PLATFORM_INDEX",
    "SUBJAXPR_PARAMS",
    "SiblingGroup",
    "VALUE_MOVING_PRIMITIVES",
    "default_device",
    "default_device_backend",
    "default_platform",
    "derivative_jaxprs",
    "dot_eqns",
    "forward_jaxprs",
    "hidden_matmuls",
    "is_float_convolution",
    "is_float_dot",
    "is_matmul",
    "iter_eqns",
    "jaxpr_and_consts",
    "matmul_dimension_numbers",
    "open_jaxpr",
    "scan_counts",
    "scan_operands",
    "sibling_groups",
    "sub_index",
    "sub_jaxprs",
    "while_operands",
]

# primitive name -> the params holding sub-jaxprs that run in the forward pass. Each value is a Jaxpr, a
# ClosedJaxpr, or a tuple / named tuple of them (``cond``'s branches, ``custom_linear_solve``'s jaxprs). Filled
# by the rules (``register(name, subjaxprs=...)`` in ``jaxpr_rewrite/rules/``).
SUBJAXPR_PARAMS: dict[str, tuple[str, ...]] = {}

# Fields of those params that hold sub-jaxprs only defining derivatives: their dots never run in the forward pass,
# so they stay float (like the tangent dots of a custom_jvp rule). Filled by the rules (``derivative_only=``).
DERIVATIVE_ONLY_PARAMS: dict[str, tuple[str, ...]] = {}

# primitive name -> the params holding its branches, of which its first operand picks the one that runs (cond's
# ``branches``). Filled by the rules (``register(name, branches=True)``).
BRANCH_PARAMS: dict[str, tuple[str, ...]] = {}

# primitive name -> ``hides(eqn) -> what it is, or None``, for a primitive that can compute float matmuls out of the
# jaxpr's reach (inside a library call). Filled by the rules (``register(name, hides_matmuls=...)``): an equation
# that hides some is an error for the rewrite and a JX105 finding for ``verify``.
HIDDEN_MATMULS: dict[str, Callable] = {}

# The primitive that picks a ``lax.platform_dependent`` branch: its result, read as a branch primitive's first
# operand, is the index of the branch of the platform the program is lowered for.
PLATFORM_INDEX = "platform_index"

# Matrix-multiplying primitives: each is either rewritten to int8 or reported.
MATMUL_PRIMITIVES = frozenset({"dot_general", "ragged_dot_general"})
CONVOLUTION_PRIMITIVES = frozenset({"conv_general_dilated"})  # float arithmetic the rewrite leaves as it is
# primitives whose outputs are some of their operand's values, moved or copied (a weight sliced, split, stacked,
# broadcast or cast is still that weight); arithmetic (a bias added to an activation) makes a new value
VALUE_MOVING_PRIMITIVES = frozenset({
    "broadcast_in_dim", "concatenate", "convert_element_type", "copy", "copy_p", "dynamic_slice", "gather", "pad",
    "reduce_precision", "reshape", "rev", "select_n", "slice", "split", "squeeze", "transpose",
})


def open_jaxpr(jaxpr) -> Jaxpr:
    """The ``Jaxpr`` of a ``Jaxpr`` or ``ClosedJaxpr``."""
    return jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr


def jaxpr_and_consts(jaxpr) -> tuple[Jaxpr, list]:
    """The ``Jaxpr`` of a ``Jaxpr`` or ``ClosedJaxpr`` and the values of its constants (none for an open one)."""
    return (jaxpr.jaxpr, jaxpr.consts) if isinstance(jaxpr, ClosedJaxpr) else (jaxpr, [])


def scan_operands(params, values) -> tuple[list, list, list]:
    """A ``scan`` equation's operand values split as its body reads them: ``(consts, init, xs)``."""
    n_consts, n_carry = scan_counts(params)
    return list(values[:n_consts]), list(values[n_consts:n_consts + n_carry]), list(values[n_consts + n_carry:])


def while_operands(params, values) -> tuple[list, list, list]:
    """A ``while`` equation's operand values split as its jaxprs read them: ``(cond_consts, body_consts, init)``."""
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    return list(values[:n_cond]), list(values[n_cond:n_cond + n_body]), list(values[n_cond + n_body:])


def _sub_values(value) -> Iterator:
    if isinstance(value, (Jaxpr, ClosedJaxpr)):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_values(item)


def sub_jaxprs(eqn) -> list[Jaxpr]:
    """Every jaxpr held in ``eqn``'s params (derivative-only ones included), in param order."""
    return [open_jaxpr(sub) for value in eqn.params.values() for sub in _sub_values(value)]


def sub_index(eqn, sub) -> int:
    """The position of ``sub`` among :func:`sub_jaxprs` of ``eqn`` (the report's path of a nested matmul)."""
    sub = open_jaxpr(sub)
    return next(j for j, s in enumerate(sub_jaxprs(eqn)) if s is sub)


def derivative_jaxprs(eqn) -> list[Jaxpr]:
    """The sub-jaxprs of ``eqn`` that only define derivatives (see :data:`DERIVATIVE_ONLY_PARAMS`)."""
    fields = DERIVATIVE_ONLY_PARAMS.get(eqn.primitive.name, ())
    found = []
    for param in SUBJAXPR_PARAMS.get(eqn.primitive.name, ()):
        value = eqn.params[param]
        found += [open_jaxpr(sub) for f in fields for sub in _sub_values(getattr(value, f, None))]
    return found


def forward_jaxprs(eqn) -> list[Jaxpr]:
    """The sub-jaxprs of ``eqn`` that run in its forward pass: all of them but the derivative-only ones."""
    derivative = {id(j) for j in derivative_jaxprs(eqn)}
    return [sub for sub in sub_jaxprs(eqn) if id(sub) not in derivative]


def iter_eqns(jaxpr, *, forward_only: bool = False, platform: str | None = None) -> Iterator:
    """Every equation of ``jaxpr`` and of the jaxprs nested in it, depth first, in program order.

    Arguments:
        jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
        forward_only: leave out sub-jaxprs that only define derivatives (see :data:`DERIVATIVE_ONLY_PARAMS`).
        platform: ``None`` for every branch of every ``lax.platform_dependent`` choice (a ``cond`` on a
            ``platform_index``), or a lowering platform (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``;
            :func:`default_platform`) for the one branch it compiles: the program as that platform runs it. The
            rewritten program chooses per platform how it quantizes and scales (one int8 dot in each branch).
    """
    stack = [iter(open_jaxpr(jaxpr).eqns)]
    chosen = {}  # id of a platform_index result -> the branch ``platform`` takes
    while stack:
        eqn = next(stack[-1], None)
        if eqn is None:
            stack.pop()
            continue
        if platform is not None and eqn.primitive.name == PLATFORM_INDEX:
            chosen.update({id(v): _branch_of(eqn.params["platforms"], platform) for v in eqn.outvars})
        yield eqn
        if eqn.primitive.name in BRANCH_PARAMS and eqn.invars and id(eqn.invars[0]) in chosen:
            index = chosen[id(eqn.invars[0])]
            subs = [list(_sub_values(eqn.params[param]))[index] for param in BRANCH_PARAMS[eqn.primitive.name]]
        else:
            subs = forward_jaxprs(eqn) if forward_only else sub_jaxprs(eqn)
        for sub in reversed(list(subs)):
            stack.append(iter(open_jaxpr(sub).eqns))


def _branch_of(platforms, platform: str) -> int:
    """The branch of a ``platform_index`` choice (its ``platforms`` param: per branch a tuple of platform names,
    ``None`` for the default) that ``platform`` takes."""
    named = (i for i, names in enumerate(platforms) if names is not None and platform in names)
    return next(named, platforms.index(None) if None in platforms else 0)


def default_device():
    """The device a program traced now runs on unless its arguments sit elsewhere: the one ``jax.default_device``
    sets (a TPU or GPU host's work put on its CPU), else the default backend's first."""
    return _configured_default_device() or jax.devices()[0]


def default_platform() -> str:
    """The lowering platform (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``) of :func:`default_device`: the platform a
    program traced now is for, unless told otherwise (:func:`jaxpr_rewrite._core.platforms.target`)."""
    backend = default_device_backend()
    if backend != "gpu":
        return backend
    device = default_device()
    return "rocm" if "rocm" in str(getattr(device.client, "platform_version", "")).lower() else "cuda"


def default_device_backend() -> str:
    """The backend (``"cpu"``, ``"gpu"``, ``"tpu"``) of :func:`default_device`: ``jax.default_device``'s, else JAX's
    default backend."""
    device = _configured_default_device()
    return jax.default_backend() if device is None else device.platform


def _configured_default_device():
    """The device ``jax.default_device`` sets (given as a device or a platform name), or ``None``."""
    device = jax.config.jax_default_device
    return jax.devices(device)[0] if isinstance(device, str) else device


def cuda_capability_major(device) -> int | None:
    """The major CUDA compute capability of ``device`` (9 for an H100 or H200), or ``None``: not a GPU, or one that
    reports no number (ROCm reports a gfx name)."""
    if device.platform != "gpu":
        return None
    try:
        return int(str(getattr(device, "compute_capability", "") or "").split(".")[0])
    except ValueError:
        return None


def is_matmul(eqn) -> bool:
    return eqn.primitive.name in MATMUL_PRIMITIVES


def matmul_dimension_numbers(eqn):
    """The ``dot_general`` dimension numbers of a matmul equation (a ragged dot's underlying ones)."""
    dims = eqn.params.get("dimension_numbers")
    return dims if dims is not None else eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers


def dot_eqns(jaxpr, *, forward_only: bool = False, platform: str | None = None) -> list:
    """The matmul equations (``dot_general``, ``ragged_dot_general``) of ``jaxpr``, nested ones included (for
    ``forward_only`` and ``platform``, see :func:`iter_eqns`)."""
    return [e for e in iter_eqns(jaxpr, forward_only=forward_only, platform=platform) if is_matmul(e)]


def is_float_convolution(eqn) -> bool:
    """Whether ``eqn`` is a convolution with a floating operand: float arithmetic the rewrite leaves as it is."""
    return eqn.primitive.name in CONVOLUTION_PRIMITIVES and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.inexact)


def hidden_matmuls(eqn) -> str | None:
    """What ``eqn`` is, when it computes float matmuls where no rewrite reaches them (JX105); ``None`` when it
    computes none."""
    hides = HIDDEN_MATMULS.get(eqn.primitive.name)
    return None if hides is None else hides(eqn)


def is_float_dot(eqn) -> bool:
    """Whether ``eqn`` is a matmul with a floating (or complex) operand: one the rewrite replaces, or rejects
    when it cannot (complex)."""
    # jnp.issubdtype knows the ml_dtypes floats (bfloat16, float8_*); np.issubdtype does not.
    return is_matmul(eqn) and any(jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.invars[:2])


class SiblingGroup(NamedTuple):
    """Dots of one activation that one program computes at the first of them (see :func:`sibling_groups`).

    Attributes:
        dots: the dot equations, in program order.
        early: the equations computing the later dots' other operands that come after the first dot (a weight's
            transpose or cast), in program order: they read only values computed before it, so they can run there.
    """

    dots: tuple
    early: tuple


def sibling_groups(jaxpr: Jaxpr, joins: Callable[[object], bool]) -> dict[int, SiblingGroup]:
    """Equations of ``jaxpr`` that read one value as their first operand and whose other operands can all be
    computed when the first of them runs (attention's query, key and value projections of one activation, their
    weights perhaps transposed or cast on the way), so one program can compute them all there.

    Arguments:
        jaxpr: the program.
        joins: which equations may be grouped.

    Returns:
        ``id(first equation) -> its group``, for every group of two or more.
    """
    producer = {}  # a variable -> (index, equation) computing it (inputs: none)
    readers: dict = {}  # a first operand -> [(index, equation), ...] of the equations that may join
    for index, eqn in enumerate(jaxpr.eqns):
        if isinstance(eqn.invars[0], Var) and joins(eqn):
            readers.setdefault(eqn.invars[0], []).append((index, eqn))
        producer.update((v, (index, eqn)) for v in eqn.outvars)

    def early_equations(var, before: int, found: dict) -> bool:
        """Whether ``var`` can be computed before equation ``before``: by then, or by pure equations of such values
        (no effects, no sub-jaxprs, no matmul), which are added to ``found`` (index -> equation)."""
        if not isinstance(var, Var) or var not in producer or producer[var][0] < before:
            return True
        index, eqn = producer[var]
        if index in found:
            return True
        if (eqn.effects or sub_jaxprs(eqn) or is_matmul(eqn)
                or not all(early_equations(v, before, found) for v in eqn.invars)):
            return False
        found[index] = eqn
        return True

    groups = {}
    for members in readers.values():
        while len(members) > 1:
            (first_index, first), rest = members[0], members[1:]
            ready, early = [], {}
            for member in rest:
                found = dict(early)
                if all(early_equations(v, first_index, found) for v in member[1].invars[1:]):
                    ready.append(member)
                    early = found
            if ready:
                groups[id(first)] = SiblingGroup((first, *(e for _, e in ready)),
                                                 tuple(early[i] for i in sorted(early)))
            members = [m for m in rest if m not in ready]
    return groups
