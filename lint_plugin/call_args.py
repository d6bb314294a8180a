"""Reading the arguments of a libcst ``Call``."""

from __future__ import annotations

from typing import List, Optional

import libcst as cst

__all__ = ["kwarg", "positional"]


def kwarg(call: cst.Call, name: str) -> Optional[cst.BaseExpression]:
    """The value passed as ``name=...``, or ``None``."""
    for a in call.args:
        if a.keyword is not None and a.keyword.value == name:
            return a.value
    return None


def positional(call: cst.Call) -> List[cst.BaseExpression]:
    """The plain positional arguments (not ``*args``/``**kwargs``), in order."""
    return [a.value for a in call.args if a.keyword is None and not a.star]
