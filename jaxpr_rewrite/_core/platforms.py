"""What differs per platform, as a registry: one :class:`Platform` per compiler, asked by the contract's code.

The contract's numbers are the same on every platform, but each compiler needs them written its own way to get them
exactly, or fast: XLA:CPU keeps IEEE divisions, a GPU's and a TPU's float division is approximate; XLA:CPU's
reduction drops NaN and cannot fuse a select into it; a GPU's Triton GEMM needs int8 buffers and a contraction that
is a multiple of 4; XLA:TPU relayouts int8 codes dearly. Each of those choices is a method of :class:`Platform`,
implemented once per platform (``jaxpr_rewrite/_platforms/``: ``cpu.py``, ``gpu.py``, ``tpu.py``) and registered
here with :func:`register_platform`, as JAX registers a lowering per platform with ``mlir.register_lowering``. The
generic contract code asks :func:`current` and never names a platform.

A program is traced for the platform it will run on: the default device's (``jax.default_device`` included), or
the platforms named by :func:`target` (int8ify's ``platforms`` option sets it). For one platform, :func:`current`
is that platform and its program alone is traced: a rewritten matmul is one int8 dot in the jaxpr. For several
(a program ``jax.export`` serializes for more than one platform), :func:`current` is a :class:`PlatformChoice`,
whose every method is a ``lax.platform_dependent`` choice between the platforms' programs.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Sequence

from jax import lax

from .errors import Int8ifyError
from .jaxprs import default_platform

__all__ = ["PLATFORMS", "Platform", "PlatformChoice", "check_gemms", "checked_platforms", "current", "lowering_names",
           "per_platform", "register_platform", "target", "targeted"]


class Platform:
    """One platform's program for the parts of the contract its compiler computes its own way.

    A subclass implements every method and is registered with :func:`register_platform`. Arrays are passed
    positionally and everything static (axes, limits, flags, functions) by keyword, so that a
    :class:`PlatformChoice` can choose between platforms' methods inside one program.

    Attributes:
        lowerings: the lowering platform names it serves (``("cpu",)``, ``("cuda",)``, ``("tpu",)``), as
            ``lax.platform_dependent`` and ``jax.export`` name them.
        sibling_kernel: whether :meth:`sibling_dots` computes several dots of one activation in one kernel (then
            the rewrite groups them).
    """

    lowerings: tuple[str, ...] = ()
    sibling_kernel: bool = False

    # -- exact division ------------------------------------------------------------------------------------------
    def divide_by_code_limit(self, mantissa, *, limit: int):
        """A scale's mantissa divided by the code limit (127, or 7), correctly rounded."""
        raise NotImplementedError

    def reciprocal(self, d):
        """``1 / d`` correctly rounded, for the small arrays a program takes reciprocals of once."""
        raise NotImplementedError

    def divide(self, numerator, denominator):
        """``numerator / denominator`` of float32 arrays a program divides once (a smoothed weight's value)."""
        raise NotImplementedError

    def rounded_quotients(self, values, scales, prescale, *, kept_axes: tuple):
        """``rint((values * prescale) / scales)`` per element, the division correctly rounded (see
        :func:`~jaxpr_rewrite._numerics.exact_division.rounded_quotients`)."""
        raise NotImplementedError

    # -- quantizing a dot's operand ------------------------------------------------------------------------------
    def quantize_dynamic(self, x, *, reduce_axes: tuple):
        """A dot operand quantized with the contract's dynamic scales, one per slice over ``reduce_axes``.

        Returns:
            ``(codes, scales, exponents, (factor, power))``: the codes and scales of
            :func:`~jaxpr_rewrite._numerics.quantize.quantize_parts` for every finite slice, NaN scales (or Inf)
            for a slice holding NaN or Inf, and the scales' epilogue factors.
        """
        raise NotImplementedError

    def quantize_static(self, x, static, *, reduce_axes: tuple, sums_values: bool):
        """A dot operand quantized with a calibrated static scale (see
        :func:`~jaxpr_rewrite._numerics.static_scales.quantize_static_parts`); ``sums_values``: the operand is a
        matrix feeding a pre-quantized weight's dot, whose slices holding NaN or Inf may be found in a sum over its
        values rather than over its codes. Returns the parts as :meth:`quantize_dynamic` does."""
        raise NotImplementedError

    def static_scale_fields(self, vector, *, count: int) -> tuple:
        """The ``count`` fields of a stored static scale vector, as 0-d arrays."""
        raise NotImplementedError

    # -- writing into a quantized array ------------------------------------------------------------------------
    def write_per_slice(self, array, update, *starts):
        """A quantized array's per-slice scales (or exponents) with ``update``, the written slices', at ``starts``:
        ``lax.dynamic_update_slice`` by default. ``starts`` are the ``dynamic_update_slice`` primitive's (a negative
        one clamped to 0, not counted from the end: ``lax``'s API wrapped the user's once already)."""
        return lax.dynamic_update_slice_p.bind(array, update, *starts)

    # -- the dot -------------------------------------------------------------------------------------------------
    def check_gemm(self) -> None:
        """Refuse to build an int8 GEMM the device would compute wrong (an :class:`Int8ifyError` saying why and what
        to do); nothing to check by default."""

    def laid_out(self, operand, *, batch_axes: tuple, contracting_axes: tuple):
        """A dot's float operand in the layout its codes are best computed in (the operand itself by default)."""
        return operand

    def gemm_codes(self, lhs_codes, rhs_codes) -> tuple:
        """The codes as the platform's int8 GEMM takes them."""
        return lhs_codes, rhs_codes

    def int8_sums(self, lhs_codes, rhs_codes, *, dimension_numbers):
        """The int32 sums of one int8 x int8 dot (a contraction that cannot overflow int32)."""
        raise NotImplementedError

    def scaled_dot(self, lhs, rhs, *, dimension_numbers, lhs_reduce: tuple, rhs_reduce: tuple, out_dtype,
                   fused_kernel: bool, keep_operands: bool, portable: Callable):
        """One rewritten dot, quantized, summed and scaled (with its quantized operands where ``keep_operands``, as
        :func:`~jaxpr_rewrite._dots.int8_dot.dot_result` returns them); ``fused_kernel``: one kernel may compute it.
        ``portable()`` is the contract's program, which a platform without a dot program of its own returns."""
        return portable()

    def dot_output(self, out, *, batched: bool, decode_like: bool):
        """The rewritten dot's result as its consumers read it (``batched``: the dot has batch dimensions;
        ``decode_like``: a stored operand, a KV cache, meets a few rows of a float one, as in a decode step)."""
        return out

    def sibling_dots(self, lhs, rhss, *, contracting: tuple, out_dtypes: tuple, each_dot: Callable) -> tuple:
        """Several dots of one activation ``lhs`` (each right operand's contracting axes in ``contracting``, each
        result's dtype in ``out_dtypes``); ``each_dot()`` computes them one by one, as a platform without a kernel for
        them does."""
        return each_dot()


# lowering platform name -> its Platform
PLATFORMS: dict[str, Platform] = {}


def register_platform(platform: Platform) -> Platform:
    """Register ``platform`` for each of its lowering names.

    Raises:
        Int8ifyError: a lowering name that is registered already (a platform is never silently replaced).
    """
    for name in platform.lowerings:
        if name in PLATFORMS:
            raise Int8ifyError(f"a platform is registered for {name!r} already ({type(PLATFORMS[name]).__name__})")
        PLATFORMS[name] = platform
    return platform


def lowering_names() -> tuple[str, ...]:
    """The lowering platform names a program can be traced for."""
    return tuple(PLATFORMS)


class PlatformChoice:
    """Several platforms' programs in one: each method is a ``lax.platform_dependent`` choice between theirs, for a
    program lowered later for one of them (``jax.export(..., platforms=[...])``)."""

    def __init__(self, names: Sequence[str]):
        self.names = tuple(names)

    def __getattr__(self, method: str):
        def chosen(*operands, **static):
            branches = {name: _branch(name, getattr(PLATFORMS[name], method), operands, static)
                        for name in self.names}
            return lax.platform_dependent(**branches)

        return chosen


def _branch(name: str, method, operands, static):
    """One platform's branch: its method, with everything traced inside it for that platform alone."""

    def branch():
        with target(name):
            return method(*operands, **static)

    return branch


# the lowering platforms the programs traced now are for (None: the default device's)
_target: contextvars.ContextVar = contextvars.ContextVar("platforms", default=None)


def checked_platforms(names: str | Sequence[str]) -> tuple[str, ...]:
    """``names`` (one lowering platform name or several) as a tuple of registered ones, each once.

    Raises:
        Int8ifyError: no name, or one int8ify has no program for.
    """
    if isinstance(names, str):
        names = (names,)
    try:
        names = tuple(dict.fromkeys(names))
    except TypeError:
        names = None
    if not names or any(name not in PLATFORMS for name in names):
        raise Int8ifyError(f"platforms must name one or more of {lowering_names()}, got {names!r}")
    return names


@contextlib.contextmanager
def target(names: str | Sequence[str] | None):
    """Trace the programs made inside for the lowering platforms ``names`` (``"cpu"``, ``"cuda"``, ``"rocm"``,
    ``"tpu"``, or several); ``None`` keeps the enclosing choice (by default, the default device's platform)."""
    if names is None:
        yield
        return
    token = _target.set(checked_platforms(names))
    try:
        yield
    finally:
        _target.reset(token)


def targeted() -> tuple[str, ...]:
    """The lowering platforms the programs traced now are for: :func:`target`'s, else the default device's."""
    names = _target.get()
    return names if names is not None else (default_platform(),)


def current() -> Platform | PlatformChoice:
    """The platform the program traced now is for (:func:`targeted`), or a :class:`PlatformChoice` of several."""
    names = targeted()
    if len(names) == 1:
        platform = PLATFORMS.get(names[0])
        if platform is None:
            raise Int8ifyError(f"int8ify has no program for the platform {names[0]!r}; it knows {lowering_names()}")
        return platform
    return PlatformChoice(names)


def per_platform(program: Callable):
    """``program()`` traced for the platform the program is for, or, for several, one ``lax.platform_dependent``
    choice between ``program()`` traced for each alone (a rewritten dot's whole program per platform, rather than a
    choice at each place where the platforms differ)."""
    names = targeted()
    if len(names) == 1:
        return program()
    return lax.platform_dependent(**{name: _branch(name, program, (), {}) for name in names})


def check_gemms() -> None:
    """:meth:`Platform.check_gemm` of each platform the program traced now is for."""
    for name in targeted():
        PLATFORMS[name].check_gemm()
