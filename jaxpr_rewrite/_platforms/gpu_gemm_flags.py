"""The XLA flags under which a Hopper GPU's int8 GEMMs give wrong sums, refused before a program is built.

XLA's Triton GEMM gives an int8 dot on compute capability 9 (H100, H200) a default tiling whose K block is 16, and
the PTX it emits for that tiling feeds the block's 16 values to both halves of ``mma.m16n8k32``: every int32 sum
comes out doubled (read in the PTX of XLA's H100 and H200 compiles, JAX 0.10.2 and 0.12.0.1; an A100's default
tiling takes K blocks of 128). XLA runs that tiling when it autotunes nothing (``--xla_gpu_autotune_level=0``),
and below level 4 its autotuner keeps the fastest tiling without comparing results, so a doubling one can win (an
H200 kept one for small dots). At level 4, XLA's default, every tiling runs on random data and one whose result
differs from cuBLAS's is dropped; int8ify hands its GEMMs int8 buffers so that the data are int8 codes
(``int8_dot._int8_buffers``). With ``--xla_gpu_enable_triton_gemm=false`` the GEMMs run on cuBLAS at any level.
"""

from __future__ import annotations

import functools
import os

from .._core.errors import Int8ifyError
from .._core.jaxprs import cuda_capability_major, default_device

__all__ = ["check_int8_gemm_flags", "int8_gemm_flag_problem"]

CHECKED_AUTOTUNE_LEVEL = 4  # XLA's default level: each tiling's result is compared with cuBLAS's


def _last_setting(xla_flags: str, name: str) -> str | None:
    """The value the last ``--name=value`` of ``xla_flags`` sets (XLA reads them in order), or ``None``."""
    value = None
    for token in xla_flags.split():
        key, equals, setting = token.partition("=")
        if equals and key.lstrip("-") == name:
            value = setting
    return value


@functools.lru_cache(maxsize=64)
def int8_gemm_flag_problem(xla_flags: str) -> str | None:
    """What in ``xla_flags`` (an ``XLA_FLAGS`` value) makes a Hopper GPU's int8 GEMMs give doubled sums.

    Returns:
        The problem and its fix, in words, or ``None`` when the flags are safe.
    """
    if (_last_setting(xla_flags, "xla_gpu_enable_triton_gemm") or "true").lower() in ("false", "0"):
        return None
    setting = _last_setting(xla_flags, "xla_gpu_autotune_level")
    try:
        level = int(setting) if setting is not None else CHECKED_AUTOTUNE_LEVEL
    except ValueError:  # XLA refuses the flag itself
        return None
    if level >= CHECKED_AUTOTUNE_LEVEL:
        return None
    if level <= 0:
        how = "XLA autotunes nothing and runs its default Triton tiling for int8 GEMMs, whose"
    else:
        how = ("XLA's autotuner keeps the fastest Triton tiling without comparing its result, and a tiling "
               "whose")
    return (f"XLA_FLAGS sets --xla_gpu_autotune_level={setting}: {how} K block of 16 feeds the same values to both "
            "halves of each mma.m16n8k32, so every int8 sum comes out doubled. Leave the autotune level at its "
            f"default ({CHECKED_AUTOTUNE_LEVEL}: each tiling is checked against cuBLAS), or add "
            "--xla_gpu_enable_triton_gemm=false to run the int8 GEMMs on cuBLAS")


def _hopper_device() -> str | None:
    """The default device's kind (:func:`~jaxpr_rewrite._core.jaxprs.default_device`) when it is an NVIDIA GPU of
    compute capability 9, else ``None``."""
    device = default_device()
    if cuda_capability_major(device) == 9:
        return f"{device.device_kind} (compute capability {device.compute_capability})"
    return None


def check_int8_gemm_flags() -> None:
    """Refuse to build an int8 GEMM that the default device would compute wrong under this process' ``XLA_FLAGS``.

    Raises:
        Int8ifyError: the default device is a Hopper GPU and ``XLA_FLAGS`` lowers XLA's autotuning below the level
            that checks each int8 GEMM tiling, with Triton GEMMs on.
    """
    device = _hopper_device()
    if device is None:
        return
    problem = int8_gemm_flag_problem(os.environ.get("XLA_FLAGS", ""))
    if problem is not None:
        raise Int8ifyError(f"int8 dots on this {device} would be wrong: {problem}")
