"""The ``--jx-traced-decorators`` names, and the one rule that matches a decorator against them."""

from __future__ import annotations

from typing import FrozenSet, Iterable, Optional

__all__ = ["TracedDecorators"]


class TracedDecorators:
    """Decorators (dotted names as written or imported) whose functions are traced code.

    A dotted entry (``mylib.traced``) matches that spelling in the source or the name it resolves
    to through the imports; any entry also matches a spelling whose last part is the entry
    (so ``my_jit`` matches ``@my_jit`` and ``@tools.my_jit``).
    """

    __slots__ = ("names", "last_parts")

    def __init__(self, names: Iterable[str] = ()) -> None:
        self.names: FrozenSet[str] = frozenset(n.strip() for n in names if n and n.strip())
        # what the cheap text check looks for: the name as a file must spell it somewhere
        self.last_parts: FrozenSet[str] = frozenset(n.rsplit(".", 1)[-1] for n in self.names)

    def matches(self, raw: str, qualname: Optional[str]) -> bool:
        """Whether the decorator spelled ``raw`` (resolving to ``qualname``) is one of these."""
        names = self.names
        return bool(names) and (raw in names or qualname in names or raw.rsplit(".", 1)[-1] in names)

    def mentioned_in(self, source: str) -> bool:
        return any(part in source for part in self.last_parts)
