"""int8ify: rewrite the float matmuls of a JAX program into per-channel int8 matmuls.

Public API (explicit re-exports):

* :func:`int8ify` -- wrap a function; its traced program runs every float ``dot_general`` in int8.
* :func:`int8_matmul` -- the contract for one ``(B, D_in) @ (D_in, D_out)`` product, with codes and scales.
* :func:`quantize` -- symmetric per-slice int8 quantization (``absmax / 127``).
* :func:`quantize_params`, :class:`QuantizedArray` -- weights quantized once, consumed by ``int8ify``.
* :func:`report` -- one row per dot: source line, scope, types, rewritten or why not, measured int8 error.
* :func:`verify`, :func:`assert_int8` -- check a traced program against the int8 contract (JX codes).
* :class:`Int8ifyError` -- raised for programs or options the rewrite cannot handle correctly.
"""

from . import scaled_matmul as _scaled_matmul  # noqa: F401  (registers the mxfp8/nvfp4/auto backends)
from .api import Int8ified, int8ify
from .errors import Int8ifyError
from .matmul import int8_matmul
from .params import QuantizedArray, quantize_params
from .quantize import quantize
from .report import DotRow, Report, report
from .verify import Finding, assert_int8, verify

__all__ = [
    "DotRow",
    "Finding",
    "Int8ified",
    "Int8ifyError",
    "QuantizedArray",
    "Report",
    "assert_int8",
    "int8_matmul",
    "int8ify",
    "quantize",
    "quantize_params",
    "report",
    "verify",
]
