"""The rules reference of ``docs/lint.md``, generated from the rule classes (their docstrings, messages
and first examples): ``python -m lint_plugin.reference`` prints it; a test keeps the docs in sync."""

from __future__ import annotations

import inspect
from typing import List, Type

from .rules import ANYWHERE, PLAIN, RULES, TRACED, Rule, example_source

__all__ = ["rules_reference"]

_WHERE = {
    TRACED: "traced code",
    PLAIN: "traced code not under `@int8ify`",
    ANYWHERE: "anywhere",
}


def _summary(rule: Type[Rule]) -> str:
    return inspect.cleandoc(rule.__doc__ or "").split("\n\n", 1)[0].replace("\n", " ")


def _section(rule: Type[Rule]) -> List[str]:
    doc = inspect.cleandoc(rule.__doc__ or "")
    bad = rule.INVALID[0]
    flagged = example_source(bad.code).splitlines()
    flagged[bad.line - 1] += f"  # {rule.code}"
    return [
        f"### {rule.code} `{rule.name}`",
        "",
        doc,
        "",
        f"Where: {_WHERE[rule.scope]}. Message: `` {rule.code} {rule.message} ``",
        "",
        "Flagged:",
        "",
        "```python",
        *flagged,
        "```",
        "",
        "Not flagged:",
        "",
        "```python",
        *example_source(rule.VALID[0]).splitlines(),
        "```",
        "",
    ]


def rules_reference() -> str:
    lines = ["| code | name | flags | where | instead |", "|---|---|---|---|---|"]
    lines += [f"| {code} | `{rule.name}` | {_summary(rule)} | {_WHERE[rule.scope]} | {rule.instead} |"
              for code, rule in RULES.items()]
    lines.append("")
    for rule in RULES.values():
        lines += _section(rule)
    return "\n".join(lines)


if __name__ == "__main__":
    print(rules_reference(), end="")
