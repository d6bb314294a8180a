"""The rules, one module per family, discovered by name.

Every public module in this package is imported once; every :class:`Rule` subclass with a code is
registered. ``RULES`` maps code -> rule class, in code order.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Dict, List, Type

from ._base import ANYWHERE, PLAIN, TRACED, Rule

__all__ = ["ANYWHERE", "PLAIN", "RULES", "TRACED", "Rule", "all_rules", "get_rule"]


def _discover() -> Dict[str, Type[Rule]]:
    found: Dict[str, Type[Rule]] = {}
    for mod in pkgutil.iter_modules(__path__):  # type: ignore[name-defined]
        if mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, Rule) and obj is not Rule and obj.code and obj.__module__ == module.__name__:
                if obj.code in found and found[obj.code] is not obj:
                    raise RuntimeError(f"duplicate rule code {obj.code}: {found[obj.code]} and {obj}")
                found[obj.code] = obj
    return dict(sorted(found.items()))


RULES: Dict[str, Type[Rule]] = _discover()


def all_rules() -> List[Type[Rule]]:
    return list(RULES.values())


def get_rule(code: str) -> Type[Rule]:
    return RULES[code]
