"""The alias table, and that every spelling of a name reaches the same rule."""

from __future__ import annotations

import libcst as cst
import pytest

from lint_helpers import codes
from lint_plugin.aliases import ImportTable
from lint_plugin.prefilter import applicable_rules
from lint_plugin.traced_decorators import TracedDecorators

NO_EXTRA = TracedDecorators()


def _table(source):
    table = ImportTable()
    for stmt in cst.parse_module(source).body:
        for small in getattr(stmt, "body", ()):
            if isinstance(small, (cst.Import, cst.ImportFrom)):
                table.add(small)
    return table


@pytest.mark.parametrize("imports, expr, expected", [
    ("import jax.numpy as np_", "np_.matmul", "jax.numpy.matmul"),
    ("from jax import lax as L", "L.scan", "jax.lax.scan"),
    ("from jax.numpy import matmul", "matmul", "jax.numpy.matmul"),
    ("import jax", "jax.numpy.matmul", "jax.numpy.matmul"),
    ("import jax.numpy", "jax.numpy.dot", "jax.numpy.dot"),
    ("from jax import numpy as jnp", "jnp.einsum", "jax.numpy.einsum"),
    ("import numpy as jnp", "jnp.asarray", "numpy.asarray"),
    ("import equinox as eqx", "eqx.filter_jit", "equinox.filter_jit"),
    ("from flax import linen as nn", "nn.Module", "flax.linen.Module"),
    ("from jax.experimental import host_callback as hcb", "hcb.id_tap", "jax.experimental.host_callback.id_tap"),
    ("import jax", "lax.scan", None),
    ("from . import jnp", "jnp.matmul", None),
])
def test_resolve(imports, expr, expected):
    table = _table(imports)
    assert table.resolve(cst.parse_expression(expr)) == expected


TEMPLATE = """
{imports}

@{jit}
def f(x, w):
    return {call}(x, w)
"""


@pytest.mark.parametrize("imports, jit, call", [
    ("import jax\nimport jax.numpy as jnp", "jax.jit", "jnp.matmul"),
    ("import jax\nimport jax.numpy as np_", "jax.jit", "np_.matmul"),
    ("from jax import jit as J\nfrom jax.numpy import matmul", "J", "matmul"),
    ("import jax", "jax.jit", "jax.numpy.matmul"),
    ("import jax as j\nfrom jax import lax as L", "j.vmap", "L.dot"),
    ("import equinox as eqx\nimport jax.numpy as jnp", "eqx.filter_jit", "jnp.dot"),
    ("from functools import partial\nimport jax\nimport jax.numpy as jnp",
     "partial(jax.jit, static_argnums=(2,))", "jnp.dot"),
])
def test_alias_variants_reach_jx101(imports, jit, call):
    assert codes(TEMPLATE.format(imports=imports, jit=jit, call=call)) == ["JX101"]


@pytest.mark.parametrize("imports, jit, call", [
    ("import jax\nimport numpy as jnp", "jax.jit", "jnp.matmul"),       # numpy proper: not a jax matmul
    ("import jax\nimport jax.numpy as jnp", "jax.numpy.jit", "jnp.matmul"),  # not a transform
    ("import jax.numpy as jnp\nfrom mylib import jit", "jit", "jnp.matmul"),  # some other jit
])
def test_lookalikes_are_not_flagged(imports, jit, call):
    assert "JX101" not in codes(TEMPLATE.format(imports=imports, jit=jit, call=call))


def test_extra_traced_decorators():
    src = TEMPLATE.format(imports="import mylib\nimport jax.numpy as jnp", jit="mylib.traced", call="jnp.dot")
    assert codes(src) == []
    assert codes(src, ["mylib.traced"]) == ["JX101"]


def test_file_without_jax_is_skipped_before_parsing():
    need = applicable_rules("import numpy as np\nx = np.ones(3) @ np.ones(3)\n", None, NO_EXTRA)
    assert not need.traced and not need.anywhere and need.tree is None  # not even parsed
    assert applicable_rules("from jax import jit\n\n@jit\ndef f(x):\n    return x\n", None, NO_EXTRA).traced
