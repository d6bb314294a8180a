"""Errors raised by int8ify. Each names what is wrong (primitive, shapes, dtypes, option) and the user's code."""

from __future__ import annotations

__all__ = ["Int8ifyError", "QuantizationWarning", "RequantizationWarning", "TracedValueError"]


class Int8ifyError(Exception):
    """A program, an argument or an option that the int8 rewrite cannot handle correctly.

    Raised instead of leaving a float matmul behind or computing a wrong number.
    """


class QuantizationWarning(UserWarning):
    """A parameter that feeds a matmul was left float by :func:`~jaxpr_rewrite.quantize_params`, or a static
    activation scale was calibrated on activations that were all zero (it is then 1)."""


class RequantizationWarning(UserWarning):
    """A rewritten dot quantizes a large argument on every call at too few rows to pay for it, so it runs slower
    than in float (a decode step's attention over a float KV cache): quantize that argument once instead
    (:func:`~jaxpr_rewrite.quantize_cache`, :func:`~jaxpr_rewrite.quantize_params`)."""


class TracedValueError(Int8ifyError):
    """Tracing failed because the function uses a traced array as a Python value (``if x > 0:``, ``int(x)``).

    Attributes:
        code: the lint code of the mistake: ``"JX201"`` (Python control flow on a traced value) or ``"JX202"``
            (a traced value converted to a Python scalar).
        file, line: where in the user's code (``None`` when unknown).
        advice: what to write instead.
        detail: JAX's own error, in one line.
        exception: the name of the exception JAX raised (``"TracerBoolConversionError"``).
    """

    def __init__(self, code: str, file: str | None, line: int | None, text: str, advice: str, detail: str,
                 exception: str):
        self.code, self.file, self.line, self.text, self.advice, self.detail = code, file, line, text, advice, detail
        self.exception = exception
        where = f"{file}:{line}" if line is not None else "<unknown location>"
        at = f" at `{text}`" if text else ""
        super().__init__(f"{where}: {code} {advice} ({detail}{at})")
