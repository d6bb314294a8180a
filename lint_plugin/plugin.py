"""flake8 glue: the ``JX`` tree plugin and its ``--jx-traced-decorators`` option."""

from __future__ import annotations

from typing import Any, Iterator, Sequence, Tuple, Type

from .engine import lint_source

__all__ = ["Int8Checker", "__version__"]

__version__ = "0.1.0"


class Int8Checker:
    """flake8 entry point ``JX = lint_plugin.plugin:Int8Checker``.

    flake8 only runs a plugin as a tree plugin when ``__init__`` takes ``tree``; the rules work on
    a libcst module built from ``lines``. ``tree`` (parsed by flake8 anyway) only serves the cheap
    prefilter that skips the libcst parse of files the rules cannot apply to.
    """

    name = "int8ify-lint"
    version = __version__
    traced_decorators: Tuple[str, ...] = ()
    honour_noqa = True

    def __init__(self, tree: Any, lines: Sequence[str]) -> None:
        self.tree = tree
        self.lines = lines

    @classmethod
    def add_options(cls, option_manager: Any) -> None:
        option_manager.add_option(
            "--jx-traced-decorators",
            default="",
            parse_from_config=True,
            comma_separated_list=True,
            help="Comma-separated decorators (dotted names as imported, e.g. mylib.traced) whose "
                 "functions the JX rules treat as traced code, like @jax.jit. (Default: none)",
        )

    @classmethod
    def parse_options(cls, options: Any) -> None:
        value = getattr(options, "jx_traced_decorators", ()) or ()
        if isinstance(value, str):
            value = value.split(",")
        cls.traced_decorators = tuple(v.strip() for v in value if v and v.strip())
        cls.honour_noqa = not getattr(options, "disable_noqa", False)

    def run(self) -> Iterator[Tuple[int, int, str, Type["Int8Checker"]]]:
        source = "".join(self.lines)
        for v in lint_source(source, self.traced_decorators, honour_noqa=self.honour_noqa, tree=self.tree):
            yield v.line, v.col, v.message, type(self)
