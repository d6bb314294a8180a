"""The options of the rewrite: :class:`RewriteConfig` (which dots they keep in float: the dot rule's
:func:`~jaxpr_rewrite._interpret.rules.dots.skip_reason`)."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Callable

from .._core.backends import BACKENDS, Backend, backend_names, resolve_backend_name
from .._core.errors import Int8ifyError
from .._core.platforms import checked_platforms
from .._numerics.quantize import MAX_INT32_SAFE_CONTRACTION
from .._quantized.activations import ActivationScales

__all__ = ["GRANULARITIES", "RewriteConfig"]

GRANULARITIES = ("per-channel", "per-tensor")


def _is_int(value) -> bool:
    # bool is an int subclass, but block_size=True is a mistake, not a size
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class RewriteConfig:
    """The options of :func:`int8ify`; hashable, part of the cache key of every rewritten program.

    Attributes:
        skip: name-scope patterns (``fnmatch`` syntax, e.g. ``"*attention*"``); a dot whose scope
            (``jax.named_scope`` / module path, nested scopes joined by ``/``) matches one stays float; JAX's
            transform wrappers (``jvp(attn)`` under ``grad``) are matched through (see
            :func:`~jaxpr_rewrite._core.scopes.matching_pattern`).
        skip_if: a predicate on the ``dot_general`` equation; the dots it returns true for stay float.
        min_contracting_size: dots that sum fewer products than this stay float (tiny dots cost more to
            quantize than they save).
        granularity: ``"per-channel"`` (the contract) or ``"per-tensor"``.
        block_size: one scale per block of this many elements along the contraction (sub-channel).
        backend: what a float dot becomes: ``"int8"`` (the contract), or a registered backend.
        activation_scales: ``None``, or the static scales of the program's matmuls between two activations
            (:func:`~jaxpr_rewrite.calibrate_activation_dots`); needs the per-channel int8 contract.
        late_inlining: whether XLA inlines the rewritten dots' shared programs late (JAX 0.11+): ``None`` decides
            by the platform the program is traced for (on CPU late only for the dots that quantize no operand in the
            program, such as two pre-quantized ones, and block-scaled dots; early elsewhere), ``False`` never,
            ``True`` as on CPU.
        platforms: the lowering platforms (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``) the program is traced
            for: ``None`` for the default device's (``jax.default_device`` included), the usual case; one, for a
            program that runs elsewhere than where it is traced (``jax.export`` on a CPU host for a TPU); several,
            for one exported for each of them (each platform's program is then a ``lax.platform_dependent`` branch).
    """

    skip: tuple[str, ...] = ()
    skip_if: Callable | None = None
    min_contracting_size: int = 0
    granularity: str = "per-channel"
    block_size: int | None = None
    backend: str = "int8"
    activation_scales: ActivationScales | None = None
    late_inlining: bool | None = None
    platforms: tuple[str, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.skip, (str, tuple, list, set, frozenset)):
            raise Int8ifyError(f"skip must be a name-scope pattern or a list of them (strings), got {self.skip!r}")
        skip = (self.skip,) if isinstance(self.skip, str) else tuple(self.skip)
        if not all(isinstance(p, str) for p in skip):
            raise Int8ifyError(f"skip must be name-scope patterns (strings), got {self.skip!r}")
        object.__setattr__(self, "skip", skip)
        if self.skip_if is not None and not callable(self.skip_if):
            raise Int8ifyError(f"skip_if must be a predicate on the dot_general equation, got {self.skip_if!r}")
        if not _is_int(self.min_contracting_size) or self.min_contracting_size < 0:
            raise Int8ifyError(f"min_contracting_size must be a non-negative int, got {self.min_contracting_size!r}")
        if self.granularity not in GRANULARITIES:
            raise Int8ifyError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.block_size is not None:
            if not _is_int(self.block_size) or not 1 <= self.block_size <= MAX_INT32_SAFE_CONTRACTION:
                raise Int8ifyError(
                    f"block_size must be an int in [1, {MAX_INT32_SAFE_CONTRACTION}] (int32 partial sums of a "
                    f"block must not overflow), got {self.block_size!r}"
                )
            if self.granularity != "per-channel":
                raise Int8ifyError("block_size refines per-channel scales; it cannot be combined with per-tensor")
        if self.backend not in backend_names():
            raise Int8ifyError(f"backend must be one of {backend_names()}, got {self.backend!r}")
        if self.late_inlining is not None and not isinstance(self.late_inlining, bool):
            raise Int8ifyError(f"late_inlining must be None (decided by the default backend), True or False, got "
                               f"{self.late_inlining!r}")
        if self.platforms is not None:
            object.__setattr__(self, "platforms", checked_platforms(self.platforms))
        if self.activation_scales is not None:
            if not isinstance(self.activation_scales, ActivationScales):
                raise Int8ifyError(f"activation_scales must be the ActivationScales calibrate_activation_dots "
                                   f"returns, got {type(self.activation_scales).__name__}")
            if not self.uses_per_channel_int8:
                raise Int8ifyError("activation_scales are static scales of the per-channel int8 contract: they "
                                   "need backend='int8', granularity='per-channel' and no block_size")

    @classmethod
    def from_options(cls, **options) -> "RewriteConfig":
        """The config for ``int8ify(**options)``; an unknown option is an error listing the known ones."""
        known = sorted(f.name for f in dataclasses.fields(cls))
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise Int8ifyError(f"unknown int8ify option(s) {unknown}; known options: {known}")
        return cls(**options)

    def replace(self, **options) -> "RewriteConfig":
        """A copy with ``options`` changed (validated like :meth:`from_options`)."""
        return type(self).from_options(**{**self.options(), **options})

    def options(self) -> dict:
        """The options as ``int8ify`` keywords."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def resolved_backend(self) -> str:
        """The name of the backend dots are rewritten to, aliases such as ``"auto"`` resolved for this machine."""
        return resolve_backend_name(self.backend)

    @property
    def dot_backend(self) -> Backend:
        """The :class:`~jaxpr_rewrite._core.backends.Backend` dots are rewritten to on this machine."""
        return BACKENDS[self.resolved_backend]

    @property
    def int8_block_size(self) -> int | None:
        """The block length of block-scaled int8 dots (``block_size`` with the int8 backend), which weights
        quantized with that block length feed; ``None`` otherwise."""
        if self.dot_backend.takes_prequantized and self.granularity == "per-channel":
            return self.block_size
        return None

    def describe_quantization(self) -> str:
        """The options that say how dots quantize, as ``int8ify`` keywords (``backend='mxfp8',
        granularity='per-channel'``), for messages."""
        block = f", block_size={self.block_size}" if self.block_size is not None else ""
        return f"backend={self.backend!r}, granularity={self.granularity!r}{block}"

    @property
    def uses_per_channel_int8(self) -> bool:
        """Whether dots become the plain per-channel int8 contract, the one pre-quantized weights are made for."""
        return (self.dot_backend.takes_prequantized and self.granularity == "per-channel"
                and self.block_size is None)
