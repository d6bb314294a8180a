"""The ``"int8"`` backend (the contract, the default): the int8 programs of :mod:`~jaxpr_rewrite._dots.int8_dot` and
:mod:`~jaxpr_rewrite._dots.ragged_dot` with straight-through gradients, registered with what they can take; and
``"int8-fused"``, the same contract with one GPU kernel per dot of a pre-quantized weight."""

from __future__ import annotations

from .._core import platforms
from .._core.backends import SiblingDots, register_backend
from .._dots.int8_dot import Scheme, int8_dot_general_impl, int8_sibling_dots_impl
from .._dots.ragged_dot import int8_ragged_dot_general_impl, ragged_dot_float
from .._dots.straight_through import straight_through, straight_through_group
from .._interpret.config import RewriteConfig
from .._numerics.quantize import MAX_INT32_SAFE_CONTRACTION
from .._platforms.gpu import fits_fused_kernel_dot
from .._quantized.array import is_quantized

__all__ = ["int8_backend", "int8_dot_general", "int8_fused_backend", "int8_ragged_dot_general", "int8_sibling_dots"]


def _dot_impl(lhs, rhs, float_params, out_dtype, scheme):
    return int8_dot_general_impl(lhs, rhs, dict(float_params)["dimension_numbers"], out_dtype, scheme)


def _inlines_early(lhs, rhs, float_params, out_dtype, scheme) -> bool:
    """Whether XLA:CPU gets the dot's program inlined early: where it quantizes an operand, which it then fuses with
    what computes that operand, XLA:CPU runs it faster so (JAX 0.12: the Flax MLP 5-16% with dynamic scales, 7-10%
    with static ones, the MiniLM encoder 13% with static scales and 11-13% with dynamic ones, whose NaN-to-Inf
    select on a higher-rank activation's values joins the kernel computing it only early; ``docs/performance.md``).
    A dot of two pre-quantized operands quantizes nothing, and a block-scaled dot's blocks have not been measured
    early: both keep late inlining, about half the compile time of a deep model."""
    return scheme.block_size is None and not (is_quantized(lhs) and is_quantized(rhs))


def _as_dots_read_it(x):
    """A pre-quantized operand with only the arrays the int8 programs read (its codes, its stored epilogue factors or
    else its scales and exponents, its static activation scale): the other operand was smoothed before the dot, and
    a jitted call pays for every array its program is handed, read or not (a 4-layer MLP's weights with their
    ``scales`` and ``exponents`` too, 25 inputs instead of 17: up to 15% more time per call at batch 1 on CPU, 1-5% on
    a TPU v5e at d 1024; ``docs/performance.md``, "Only what a dot reads"). Any other operand as it is."""
    if not is_quantized(x):
        return x
    unread = dict(smooth=None, smooth_inverse=None, value=None)
    if x.epilogue_factor is not None:  # the program's epilogue and the straight-through value read only these
        unread.update(scales=None, exponents=None)
    return x.replace(**unread)


_dot_impl.__name__ = "int8_dot_general_impl"
int8_dot_general = straight_through(_dot_impl, early_when=_inlines_early)
"""``int8_dot_general(lhs, rhs, float_params, out_dtype, scheme)``: one float ``dot_general`` computed in int8
under :class:`Scheme` ``scheme``, as ``int32_sum * lhs_scale * rhs_scale`` in ``out_dtype``, with a
straight-through gradient. ``lhs``/``rhs`` may be :class:`QuantizedArray` (pre-quantized weights, no gradient)."""

int8_ragged_dot_general = straight_through(int8_ragged_dot_general_impl, ragged_dot_float, n_extra=1)
"""``int8_ragged_dot_general(lhs, rhs, group_sizes, float_params, out_dtype, scheme)``: one float
``ragged_dot_general`` in int8, with a straight-through gradient."""


int8_sibling_dots = straight_through_group(
    int8_sibling_dots_impl, early_when=lambda lhs, rhss, float_params, out_dtypes, scheme: any(
        _inlines_early(lhs, rhs, params, out_dtype, scheme)
        for rhs, params, out_dtype in zip(rhss, float_params, out_dtypes)))
"""``int8_sibling_dots(lhs, rhss, float_params, out_dtypes, scheme)``: several float ``dot_general`` s of one
activation in int8, one kernel on an NVIDIA GPU, each with a straight-through gradient."""


def _scheme_of(config: RewriteConfig, fused_gpu_kernel: bool = False) -> Scheme:
    """``config``'s :class:`Scheme`, for the platforms the program is traced for."""
    block_size = None if config.block_size is None else int(config.block_size)
    return Scheme(config.granularity, block_size, fused_gpu_kernel, platforms.targeted())


def _scheme(config: RewriteConfig, **options) -> Scheme:
    """:func:`_scheme_of`, once the platform is known to compute int8 GEMMs right under this process' settings
    (:meth:`~jaxpr_rewrite._core.platforms.Platform.check_gemm`: a Hopper GPU's ``XLA_FLAGS``): checked at every
    rewrite of a dot (here, not where the GEMM is built: a dot's shared program is traced once per scheme)."""
    platforms.check_gemms()
    return _scheme_of(config, **options)


def _fits_fused_siblings(lhs, rhs, float_params, out_dtype, config: RewriteConfig) -> bool:
    """Whether the dot joins its siblings' program: some platform the program is for computes them in one kernel
    (:attr:`~jaxpr_rewrite._core.platforms.Platform.sibling_kernel`), and the dot fits that kernel."""
    scheme = _scheme_of(config, fused_gpu_kernel=True)
    return (any(platforms.PLATFORMS[name].sibling_kernel for name in scheme.platforms) and scheme.per_channel
            and fits_fused_kernel_dot(lhs, rhs, dict(float_params)["dimension_numbers"], out_dtype))


def _fused_siblings(lhs, rhss, float_params, out_dtypes, config: RewriteConfig) -> tuple:
    return int8_sibling_dots(_as_dots_read_it(lhs), tuple(map(_as_dots_read_it, rhss)), tuple(float_params),
                             tuple(out_dtypes), _scheme(config, fused_gpu_kernel=True))


def _int8_ragged_backend(lhs, rhs, group_sizes, float_params, out_dtype, config: RewriteConfig):
    return int8_ragged_dot_general(_as_dots_read_it(lhs), _as_dots_read_it(rhs), group_sizes, float_params, out_dtype,
                                   _scheme(config))


@register_backend("int8", ragged_dot=_int8_ragged_backend, takes_prequantized=True,
                  max_symbolic_contraction=MAX_INT32_SAFE_CONTRACTION)
def int8_backend(lhs, rhs, float_params, out_dtype, config: RewriteConfig):
    """The int8 contract (the default backend)."""
    return int8_dot_general(_as_dots_read_it(lhs), _as_dots_read_it(rhs), float_params, out_dtype, _scheme(config))


@register_backend("int8-fused", ragged_dot=_int8_ragged_backend, takes_prequantized=True,
                  sibling_dots=SiblingDots(_fits_fused_siblings, _fused_siblings),
                  max_symbolic_contraction=MAX_INT32_SAFE_CONTRACTION)
def int8_fused_backend(lhs, rhs, float_params, out_dtype, config: RewriteConfig):
    """The int8 contract, with a float activation times a pre-quantized weight as one Pallas kernel on an NVIDIA
    GPU (:mod:`~jaxpr_rewrite._platforms.fused_gpu_dot`), and sibling dots of one activation (attention's query, key and
    value projections) as one kernel for all of them: the same numbers, fewer kernels; elsewhere the ``"int8"``
    backend."""
    return int8_dot_general(_as_dots_read_it(lhs), _as_dots_read_it(rhs), float_params, out_dtype,
                            _scheme(config, fused_gpu_kernel=True))
