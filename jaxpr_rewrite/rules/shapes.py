"""Shape primitives: only how the command line's diff shows them."""

from __future__ import annotations

from .registry import register

__all__ = []


def _label_broadcast(params) -> list[str]:
    return [f"broadcast_dimensions={tuple(params['broadcast_dimensions'])}"]


register("broadcast_in_dim", label=_label_broadcast)
