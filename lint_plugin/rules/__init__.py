"""The rules, one module per family: JX10x matmuls and convolutions, JX20x Python control flow on
traced values, JX30x host callbacks. ``RULES`` maps code -> rule class, in code order."""

from __future__ import annotations

from typing import Dict, Type

from ._base import ANYWHERE, PLAIN, TRACED, Invalid, Rule, example_source
from .callbacks import DebugCallback, HostCallback
from .control_flow import Concretization, TracedCondition
from .matmul import BroadcastMultiplySum, Convolution, FloatMatmul, HiddenMatmul, Int8MatmulInt8Accumulator

__all__ = [
    "ANYWHERE",
    "PLAIN",
    "RULES",
    "TRACED",
    "BroadcastMultiplySum",
    "Concretization",
    "Convolution",
    "DebugCallback",
    "FloatMatmul",
    "HiddenMatmul",
    "HostCallback",
    "Int8MatmulInt8Accumulator",
    "Invalid",
    "Rule",
    "TracedCondition",
    "example_source",
    "get_rule",
]


def _registry(*rules: Type[Rule]) -> Dict[str, Type[Rule]]:
    found: Dict[str, Type[Rule]] = {}
    for rule in rules:
        if rule.code in found:
            raise RuntimeError(f"duplicate rule code {rule.code}: {found[rule.code]} and {rule}")
        found[rule.code] = rule
    return dict(sorted(found.items()))


RULES: Dict[str, Type[Rule]] = _registry(
    FloatMatmul, Int8MatmulInt8Accumulator, BroadcastMultiplySum, Convolution, HiddenMatmul,
    TracedCondition, Concretization,
    HostCallback, DebugCallback,
)


def get_rule(code: str) -> Type[Rule]:
    return RULES[code]
