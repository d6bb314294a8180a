"""Static scales for the matmuls between two activations (attention's ``q . k`` and ``p . v``).

:func:`~jaxpr_rewrite.quantize_params` with ``activations="static"`` gives the dots that take a weight a calibrated
scale for their activation; a dot of two activations has no weight to store one with. Its scales are calibrated by
:func:`~jaxpr_rewrite.calibrate_activation_dots` into an :class:`ActivationScales` (one per-tensor scale per
operand of each such dot, keyed by the dot's position among the program's top-level matmuls) and used with
``int8ify(fn, activation_scales=scales)``: each operand then reaches the int8 dot as a :class:`ScaledActivation`,
quantized there with one multiply, a round and a clip, as a weight's static scale quantizes its activation.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Mapping

import jax
import numpy as np
from jax import lax

from .._core.errors import Int8ifyError
from .._core.jaxprs import is_float_dot
from .._core.source import describe_source
from .._numerics.quantize import compute_dtype
from .._numerics.static_scales import StaticScale, smallest_static_absmax

__all__ = ["ActivationScales", "CalibratedDot", "ScaledActivation", "describe_dot", "top_level_dots"]


@jax.tree_util.register_pytree_node_class
class ScaledActivation:
    """A float activation on its way into an int8 dot, with the static scale it is quantized with.

    Attributes:
        value: the float array. activation_scale: the calibrated scale as
        :meth:`~jaxpr_rewrite._numerics.static_scales.StaticScale.stored` lays it out.
    """

    def __init__(self, value, activation_scale):
        self.value = value
        self.activation_scale = activation_scale

    def tree_flatten(self):
        return (self.value, self.activation_scale), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    @property
    def static_scale(self) -> StaticScale:
        return StaticScale.stored_in(self.activation_scale)


def top_level_dots(jaxpr) -> list:
    """The float ``dot_general`` equations of ``jaxpr`` itself (not of its sub-jaxprs), in program order: the
    positions :class:`ActivationScales` keys its dots by."""
    return [eqn for eqn in jaxpr.eqns if eqn.primitive is lax.dot_general_p and is_float_dot(eqn)]


def describe_dot(eqn) -> tuple:
    """``(dimension numbers, operand ranks, name scope, source)`` of a dot equation: what a
    :class:`CalibratedDot` records of it."""
    return (eqn.params["dimension_numbers"], tuple(v.aval.ndim for v in eqn.invars[:2]),
            str(eqn.source_info.name_stack), describe_source(eqn))


@functools.lru_cache(maxsize=None)
def _stored_scale(absmax: float, dtype: str) -> tuple:
    """The stored static scale of a calibrated ``absmax`` in the compute ``dtype`` (float32 or float64)."""
    with jax.ensure_compile_time_eval():
        return tuple(float(v) for v in np.asarray(StaticScale.of(np.asarray(absmax, dtype)).stored()))


@dataclasses.dataclass(frozen=True)
class CalibratedDot:
    """One calibrated matmul of two activations.

    Attributes:
        position: its index in :func:`top_level_dots` of the calibrated program.
        dimension_numbers: its ``dot_general`` dimension numbers.
        ranks: the ranks of its two operands.
        scope: its name scope (a Flax module path, a ``jax.named_scope``), checked with the rest.
        source: where it is in the user's code, for messages.
        absmax: the calibrated ``max|x|`` (or percentile) of its lhs and of its rhs.
    """

    position: int
    dimension_numbers: tuple
    ranks: tuple[int, int]
    scope: str
    source: str
    absmax: tuple[float, float]

    def __post_init__(self):
        if not (isinstance(self.absmax, tuple) and len(self.absmax) == 2
                and all(isinstance(a, numbers.Real) and not isinstance(a, (bool, np.bool_)) for a in self.absmax)):
            raise Int8ifyError(f"the calibrated absmax of the dot at {self.source} must be two numbers (its lhs' and "
                               f"its rhs'), got {self.absmax!r}")
        if not all(np.isfinite(a) and a >= 0 for a in self.absmax):
            raise Int8ifyError(f"a calibrated absmax must be finite and non-negative, got {self.absmax} for the dot "
                               f"at {self.source}")

    def scales(self, dtypes) -> tuple[np.ndarray, np.ndarray]:
        """The stored static scale of each operand (vectors in the compute dtype of its operand's ``dtypes``,
        constants of the program).

        Raises:
            Int8ifyError: a nonzero absmax below the smallest a static scale of its operand's dtype takes
                (:func:`~jaxpr_rewrite._numerics.static_scales.smallest_static_absmax`), whose reciprocal is not finite.
        """
        stored = []
        for side, (absmax, dtype) in enumerate(zip(self.absmax, dtypes)):
            dtype = compute_dtype(dtype)
            smallest = smallest_static_absmax(dtype)
            if 0 < absmax < smallest:
                raise Int8ifyError(
                    f"the calibrated absmax of the {('lhs', 'rhs')[side]} of the dot at {self.source} is {absmax:.3g}, "
                    f"below {smallest:.3g}, the smallest a static scale of {dtype.name} values takes: calibrate on "
                    f"representative inputs, or keep this dot's activations dynamic")
            stored.append(np.asarray(_stored_scale(float(absmax), dtype.name), dtype))
        return tuple(stored)


@dataclasses.dataclass(frozen=True)
class ActivationScales:
    """Calibrated static scales for a program's matmuls between two activations (hashable: an ``int8ify`` option).

    Attributes:
        dots: the calibrated dots.
        n_dots: how many top-level float ``dot_general`` the calibrated program has (a program with another
            number is another program).
    """

    dots: tuple[CalibratedDot, ...]
    n_dots: int

    def __post_init__(self):
        positions = [dot.position for dot in self.dots]
        if len(set(positions)) != len(positions) or not all(0 <= p < self.n_dots for p in positions):
            raise Int8ifyError(f"ActivationScales: the dots' positions {positions} must be distinct and below the "
                               f"program's {self.n_dots} top-level dot_general(s)")

    def assign(self, jaxpr) -> dict:
        """``id(dot equation) -> its CalibratedDot`` for the calibrated dots of ``jaxpr``, the program ``int8ify``
        runs.

        Raises:
            Int8ifyError: ``jaxpr`` is not the program the scales were calibrated on (another number of top-level
                matmuls, or a calibrated dot with other dimension numbers, operand ranks or name scope).
        """
        eqns = top_level_dots(jaxpr)
        if len(eqns) != self.n_dots:
            raise Int8ifyError(
                f"activation_scales were calibrated on a program with {self.n_dots} top-level float dot_general(s); "
                f"this one has {len(eqns)}: calibrate them on this function (calibrate_activation_dots)")
        assigned = {}
        for dot in self.dots:
            eqn = eqns[dot.position]
            if describe_dot(eqn)[:3] != (dot.dimension_numbers, dot.ranks, dot.scope):
                raise Int8ifyError(
                    f"activation_scales do not fit the dot_general at {describe_source(eqn)}: they were calibrated "
                    f"for the one at {dot.source} (dimension numbers {dot.dimension_numbers}, operand ranks "
                    f"{dot.ranks}, name scope {dot.scope!r}); calibrate them on this function "
                    f"(calibrate_activation_dots)")
            assigned[id(eqn)] = dot
        return assigned

    def as_dict(self) -> dict:
        """The scales as plain Python values (JSON-serializable); :meth:`from_dict` reads them back."""
        return {"n_dots": self.n_dots, "dots": [dataclasses.asdict(dot) for dot in self.dots]}

    @classmethod
    def from_dict(cls, data: Mapping) -> "ActivationScales":
        """The scales :meth:`as_dict` wrote.

        Raises:
            Int8ifyError: ``data`` is not such a dict: a field missing, or of another type or length, named with its
                dot (a malformed absmax would otherwise fail at trace time, or a string of digits read as numbers).
        """
        if not isinstance(data, Mapping) or not isinstance(data.get("dots"), (list, tuple)):
            raise Int8ifyError(f"not the dict ActivationScales.as_dict writes: it needs a list 'dots' and their "
                               f"program's count 'n_dots', got {data!r:.120}")
        if not _is_int(data.get("n_dots")):
            raise Int8ifyError(f"not the dict ActivationScales.as_dict writes: 'n_dots' is {data.get('n_dots')!r}, "
                               "not an int")
        return cls(tuple(_read_dot(dot, f"dots[{i}]") for i, dot in enumerate(data["dots"])), data["n_dots"])

    def __repr__(self):
        return f"ActivationScales({len(self.dots)} dot(s) of {self.n_dots})"


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _ints(value, length: int | None = None) -> bool:
    """Whether ``value`` is a list or tuple of ints (of ``length`` of them)."""
    return (isinstance(value, (list, tuple)) and all(_is_int(v) for v in value)
            and (length is None or len(value) == length))


# what as_dict writes for each field of a dot: (the check, what it must be)
_DOT_FIELDS = {
    "position": (_is_int, "an int"),
    "dimension_numbers": (lambda v: isinstance(v, (list, tuple)) and len(v) == 2
                          and all(isinstance(p, (list, tuple)) and len(p) == 2 and all(_ints(a) for a in p) for p in v),
                          "((lhs contracting, rhs contracting), (lhs batch, rhs batch)), lists of ints"),
    "ranks": (lambda v: _ints(v, 2), "two ints"),
    "scope": (lambda v: isinstance(v, str), "a string"),
    "source": (lambda v: isinstance(v, str), "a string"),
    "absmax": (lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(
        isinstance(a, numbers.Real) and not isinstance(a, (bool, np.bool_)) for a in v), "two numbers"),
}


def _read_dot(data, where: str) -> CalibratedDot:
    """One :class:`CalibratedDot` from what :meth:`ActivationScales.as_dict` wrote of it, every field checked."""
    if not isinstance(data, Mapping):
        raise Int8ifyError(f"not the dict ActivationScales.as_dict writes: {where} is {data!r:.80}, not a dict")
    for field, (fits, expected) in _DOT_FIELDS.items():
        if field not in data:
            raise Int8ifyError(f"not the dict ActivationScales.as_dict writes: {where} has no '{field}'")
        if not fits(data[field]):
            raise Int8ifyError(f"not the dict ActivationScales.as_dict writes: {where}.{field} is "
                               f"{data[field]!r:.80}, not {expected}")

    def frozen(value):
        return tuple(frozen(v) for v in value) if isinstance(value, (list, tuple)) else int(value)

    return CalibratedDot(int(data["position"]), frozen(data["dimension_numbers"]), frozen(data["ranks"]),
                         data["scope"], data["source"], tuple(float(a) for a in data["absmax"]))
