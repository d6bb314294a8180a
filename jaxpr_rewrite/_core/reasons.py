"""Why a matmul stays float, as a value: :class:`KeptFloat` (its kind, :class:`Why`, and the sentence shown)."""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["KeptFloat", "Why"]


class Why(enum.Enum):
    """The kinds of reasons a matmul is not rewritten."""

    SKIP_PATTERN = enum.auto()  # its name scope matches a ``skip`` pattern
    SKIP_IF = enum.auto()  # the ``skip_if`` predicate returned true
    SMALL_CONTRACTION = enum.auto()  # it sums fewer products than ``min_contracting_size``
    INTEGER_DOT = enum.auto()  # it multiplies integers (left as it is)
    DERIVATIVE_ONLY = enum.auto()  # it is in a sub-jaxpr that only defines derivatives
    UNSUPPORTED_RAGGED = enum.auto()  # a ragged layout the rewrite cannot express (int8ify raises)
    NO_RULE = enum.auto()  # inside a higher-order primitive without a rule (int8ify raises)


@dataclasses.dataclass(frozen=True)
class KeptFloat:
    """Why one matmul stays float.

    Attributes:
        why: the kind of reason.
        text: the reason in words, as the report prints it.
    """

    why: Why
    text: str

    def __str__(self) -> str:
        return self.text
