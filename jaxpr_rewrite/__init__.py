"""int8ify: rewrite the float matmuls of a JAX program into per-channel int8 matmuls.

Public API (explicit re-exports):

* :func:`int8ify`, :class:`Int8ified` -- wrap a function; its traced program runs every float matmul in int8.
* :func:`int8_matmul` -- the contract for one ``(B, D_in) @ (D_in, D_out)`` product, with codes and scales.
* :func:`quantize`, :class:`QuantizedArray` -- symmetric per-slice int8 quantization (``absmax / 127``).
* :func:`quantize_params` -- weights quantized once, consumed by ``int8ify``; :class:`QuantizationWarning`.
* :func:`quantize_cache` -- an int8 KV cache, quantized once, written and read in int8 by ``int8ify``'d steps.
* :func:`calibrate_activation_dots`, :class:`ActivationScales` -- static scales for the matmuls between two
  activations (``int8ify(fn, activation_scales=...)``).
* :func:`report`, :class:`Report`, :class:`DotRow` -- one row per matmul: source, scope, types, decision, error;
  :class:`KeptFloat`, :class:`Why` -- why a matmul stays float.
* :func:`over_tensors` -- a program over a quantized pytree's named tensors, to export and serve with JAX alone.
* :func:`verify`, :func:`assert_int8`, :class:`Finding` -- check a traced program against the int8 contract.
* :class:`RewriteConfig`, :func:`register_backend` -- the options, and the registry of what a float dot becomes.
* :func:`iter_eqns`, :func:`dot_eqns`, :func:`default_platform` -- every equation / matmul of a program, nested
  jaxprs included, of every platform's branch or of the one a platform runs.
* :class:`Int8ifyError`, :class:`TracedValueError` -- raised for programs or options the rewrite cannot handle;
  :class:`RequantizationWarning` -- a dot that quantizes a large argument on every call, slower than float.
"""

from . import _platforms  # noqa: F401  (registers the CPU, GPU and TPU platforms)
from ._backends import int8 as _int8_backend  # noqa: F401  (registers the int8 backend)
from ._backends import scaled_matmul as _scaled_matmul  # noqa: F401  (registers the mxfp8/nvfp4/auto backends)
from ._api import Int8ified, int8ify
from ._ptq.calibration import calibrate_activation_dots
from ._core.backends import register_backend, register_backend_alias
from ._interpret.config import RewriteConfig
from ._core.errors import Int8ifyError, RequantizationWarning, TracedValueError
from ._core.jaxprs import default_platform, dot_eqns, iter_eqns
from ._dots.matmul import int8_matmul
from ._ptq.cache import quantize_cache
from ._ptq.params import QuantizationWarning, quantize_params
from ._dots.operands import quantize
from ._quantized.array import QuantizedArray
from ._inspect.report import DotRow, Report, report
from ._quantized.activations import ActivationScales
from ._quantized.stored import over_tensors
from ._core.reasons import KeptFloat, Why
from ._inspect.verify import Finding, assert_int8, verify

__all__ = [
    "ActivationScales",
    "DotRow",
    "Finding",
    "Int8ified",
    "Int8ifyError",
    "KeptFloat",
    "QuantizationWarning",
    "QuantizedArray",
    "Report",
    "RequantizationWarning",
    "RewriteConfig",
    "TracedValueError",
    "Why",
    "assert_int8",
    "calibrate_activation_dots",
    "int8_matmul",
    "default_platform",
    "dot_eqns",
    "int8ify",
    "iter_eqns",
    "over_tensors",
    "quantize",
    "quantize_cache",
    "quantize_params",
    "register_backend",
    "register_backend_alias",
    "report",
    "verify",
]
