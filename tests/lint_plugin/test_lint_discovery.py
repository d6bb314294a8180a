"""Which functions the discovery finds and how names bind: as Python runs the file.

Each snippet's ``# JXnnn:col`` comments are exactly its reports.
"""

from __future__ import annotations

from lint_helpers import check_annotated


def test_a_name_defined_on_two_branches_may_be_either_function():
    check_annotated('''
    import jax
    from jax import lax


    def run(x, pred, mode):
        if mode == "a":
            def body():
                return x @ x  # JX101:19
            return lax.cond(pred, body, lambda: x)
        else:
            def body():
                return jax.pure_callback(print, x, x)  # JX301:19
            return lax.cond(pred, body, lambda: x)
    ''')


def test_the_later_import_of_a_name_wins():
    check_annotated('''
    import jax
    import numpy as np
    import jax.numpy as np


    @jax.jit
    def f(x):
        return np.dot(x, x)  # JX101:11
    ''')
    check_annotated('''
    import jax
    import jax.numpy as np
    import numpy as np


    @jax.jit
    def f(x):
        return np.dot(x, x)  # JX202:11
    ''')
