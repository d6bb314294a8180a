"""Positions computed per top-level statement (placed by ``ast`` line numbers) equal libcst's
``PositionProvider`` over the whole module."""

from __future__ import annotations

import ast
import textwrap

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from lint_plugin.cstwalk import iter_children
from lint_plugin.positions import Positions

TRICKY = textwrap.dedent('''\
    #!/usr/bin/env python
    # a header comment
    """Module docstring
    over two lines."""
    import jax; import jax.numpy as jnp

    x = jnp.ones(3) @ jnp.ones(3); y = (
      x @ x)


    # a comment owned by the decorated function

    @jax.jit
    # between decorators
    @jax.named_call
    def f(a, b):
      if a.sum() > 0:
        return a @ b
      return (
          jnp.dot(a,
                  b))


    class C:
      def g(self, v):
        return v @ v
    # trailing comment
''')


def _nodes(module):
    out, pending = [], [module]
    while pending:
        node = pending.pop()
        if isinstance(node, (cst.Call, cst.BinaryOperation, cst.If, cst.FunctionDef)):
            out.append(node)
        pending.extend(iter_children(node))
    return out


def test_statement_positions_equal_whole_module_positions():
    module = cst.parse_module(TRICKY)
    full = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    nodes = _nodes(module)
    assert len(nodes) > 10
    positions = Positions(module, ast.parse(TRICKY), nodes)
    assert len(positions._tables) == 3  # only the statements holding the nodes asked for
    for node in nodes:
        assert positions[node] == full[node], cst.Module([]).code_for_node(node)


def test_without_an_ast_the_whole_module_is_used():
    module = cst.parse_module(TRICKY)
    full = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    nodes = _nodes(module)
    positions = Positions(module, None, nodes)
    assert all(positions[n] == full[n] for n in nodes)
