"""JX20x: Python control flow and conversions that need a concrete value."""

from __future__ import annotations

import libcst as cst

from jx_codes import CONCRETIZATION, TRACED_CONDITION

from ..aliases import dotted_name
from ..array_api import NUMPY_OK_FUNCS, delegates_to_method
from ..kinds import is_traced
from ..module_info import named_params
from ..walk import FunctionWalk
from ._base import TRACED, Invalid, Rule

__all__ = ["Concretization", "TracedCondition"]


class TracedCondition(Rule):
    """Python control flow on a traced value.

    ``if``/``elif``/``while``/ternary/``assert``/``and``/``or``/``not``, a comprehension's filter
    (``[f(v) for v in xs if v.sum() > 0]``), a ``case`` guard, and a ``match`` whose cases compare a traced
    subject, or a traced item of a tuple or list subject (``match (x, x.sum()): case (a, 0):``), with a value
    (``case 0:``) need its concrete truth value, which a tracer does not have
    (``TracerBoolConversionError`` under ``jit``). Conditions on static values are fine:
    shapes, dtypes, ``len()``, ``x is None``, ``static_argnums``, module config, parameters annotated with
    a Python type, Python containers, dict keys, comparisons with a string or an enum member, and the bare
    truth value of a module method's unannotated parameter (``if train:``, a Python flag), or of a
    function's under ``eqx.filter_jit`` & co. (they keep Python values static) or given to
    ``nn.apply(fn, module)``. A parameter compared with ``==``/``!=`` to an UPPER_CASE constant of another
    module (``model_mode != MODEL_MODE_TRAIN`` with the constant imported from ``common_types``, or
    ``common_types.MODEL_MODE_TRAIN``) is not reported either: such a constant is almost always a mode
    label, whose value the file does not show. The primal of a ``jax.custom_vjp``/``jax.custom_jvp``
    function and the rules ``f.defvjp(fwd, bwd)`` and ``f.defjvp(jvp)`` register are traced code too; their
    ``nondiff_argnums`` values are static.
    """

    entry = TRACED_CONDITION
    scope = TRACED
    message = "Python `{construct}` on a traced value (TracerBoolConversionError under jit); {fix}"
    VALID = [
        """
        import jax

        @jax.jit
        def f(x, mask=None):
            if x.shape[0] > 1 and x.ndim == 2:
                x = x * 2
            if mask is not None:
                x = x * mask
            for i in range(3):
                if i == 0:
                    x = x + 1
            return x
        """,
        """
        from functools import partial
        import jax

        @partial(jax.jit, static_argnames=("training",))
        def f(x, training):
            return x * 0.5 if training else x
        """,
        """
        import flax.linen as nn

        class Block(nn.Module):
            use_bias: bool = True

            @nn.compact
            def __call__(self, x, deterministic: bool = False):
                if self.use_bias:
                    x = x + 1
                if not deterministic:
                    x = x * 2
                return x
        """,
        """
        import flax.linen as nn

        class Block(nn.Module):
            @nn.compact
            def __call__(self, x, *, train):  # a flag the caller passes as a literal (static under jit)
                x = nn.Dropout(0.1)(x, deterministic=not train)
                return x * 2 if train else x
        """,
        """
        import equinox as eqx

        @eqx.filter_jit
        def f(x, training):
            return x * 0.5 if training else x
        """,
        """
        import jax

        @jax.jit
        def f(layers, x, scales):  # comprehension filters on shapes, identity and dict keys
            kept = [w for w in layers if w.ndim == 2 and w is not None]
            named = {k: v for k, v in scales.items() if k.startswith("kernel")}
            return x * len(kept) * len(named) * len([n for n in x.shape if n > 1])
        """,
        """
        import jax

        @jax.jit
        def f(x, y):  # a match on shapes, its captures static; structure patterns on arrays compare nothing
            match x.shape:
                case (n, m) if n > m:
                    x = x.T
            match y:
                case None:
                    return x
                case [first, *rest] if first is None:
                    return x
            return x
        """,
        """
        from functools import partial
        import jax

        @partial(jax.custom_vjp, nondiff_argnums=(1,))
        def f(x, training):
            return x * 0.5 if training else x

        def f_fwd(x, training):
            return f(x, training), None

        def f_bwd(training, res, g):
            return (g * 0.5 if training else g,)

        f.defvjp(f_fwd, f_bwd)
        """,
        """
        from flax import nnx

        from common_types import MODEL_MODE_AUTOREGRESSIVE, MODEL_MODE_TRAIN

        class Attention(nnx.Module):
            def __call__(self, query, model_mode):  # a mode label, passed down to a helper
                if model_mode != MODEL_MODE_TRAIN:
                    query = query * 2
                return self.mask(query, model_mode)

            def mask(self, query, model_mode):
                return query if model_mode == MODEL_MODE_AUTOREGRESSIVE else -query
        """,
    ]
    INVALID = [
        Invalid("""
        import jax, jax.numpy as jnp

        @jax.jit
        def f(x):
            if jnp.all(x == 0):
                return x
            return x / jnp.abs(x).max()
        """, line=5, col=4),
        Invalid("""
        import jax

        @jax.jit
        def f(x):
            s = x.max()
            return x / s if s > 0 else x
        """, line=6, col=20),
        Invalid("""
        import jax

        def body(i, x):
            while x.sum() > 0:
                x = x - 1
            return x

        def run(x):
            return jax.lax.fori_loop(0, 3, body, x)
        """, line=4, col=4),
        Invalid("""
        import jax

        @jax.jit
        def f(x):
            assert (x > 0).all()
            return x
        """, line=5, col=4),
        Invalid("""
        import jax

        @jax.jit
        def f(x, y):
            return x or y
        """, line=5, col=11),
        Invalid("""
        import jax

        @jax.jit
        def f(xs):
            return [v * 2 for v in xs if v.sum() > 0]
        """, line=5, col=33),
        Invalid("""
        import jax

        @jax.jit
        def f(x):
            match x.sum():
                case 0:
                    return x
                case _:
                    return -x
        """, line=5, col=10),
        Invalid("""
        import jax

        @jax.jit
        def f(x):
            match (x, x.sum()):
                case (a, 0):
                    return a
            return -x
        """, line=5, col=14),
        Invalid("""
        import jax

        @jax.jit
        def f(x, w):
            match x.shape:
                case (n, _) if (x @ w).sum() > n:
                    return x
                case _:
                    return -x
        """, line=6, col=23),
        Invalid("""
        import jax

        @jax.custom_vjp
        def f(x):
            return x

        def f_fwd(x):
            return x, x

        def f_bwd(res, g):
            if res.sum() > 0:
                return (g,)
            return (-g,)

        f.defvjp(f_fwd, f_bwd)
        """, line=11, col=4),
    ]

    _FIX = {
        "if": "use jnp.where or lax.cond",
        "elif": "use jnp.where or lax.cond",
        "while": "use lax.while_loop or lax.fori_loop",
        "ternary": "use jnp.where or lax.cond",
        "assert": "use jax.experimental.checkify or check outside the traced function",
        "and": "use jnp.logical_and (or `&`)",
        "or": "use jnp.logical_or (or `|`)",
        "not": "use jnp.logical_not (or `~`)",
        "comprehension if": "compute every item and select with jnp.where (a traced filter has no length)",
        "case guard": "use jnp.where or lax.cond",
        "match": "use lax.switch on an index, or jnp.where",
    }

    def _flag(self, walk: FunctionWalk, node: cst.CSTNode, construct: str) -> None:
        self.report(walk, node, construct=construct, fix=self._FIX[construct])

    def _is_traced_test(self, walk: FunctionWalk, test: cst.BaseExpression) -> bool:
        return is_traced(walk.kind(test)) and not _is_python_flag(walk, test)

    def visit_If(self, node: cst.If, walk: FunctionWalk) -> None:
        if self._is_traced_test(walk, node.test):
            self._flag(walk, node, "if")

    def visit_While(self, node: cst.While, walk: FunctionWalk) -> None:
        if is_traced(walk.kind(node.test)):
            self._flag(walk, node, "while")

    def visit_Assert(self, node: cst.Assert, walk: FunctionWalk) -> None:
        if is_traced(walk.kind(node.test)):
            self._flag(walk, node, "assert")

    def visit_IfExp(self, node: cst.IfExp, walk: FunctionWalk) -> None:
        if self._is_traced_test(walk, node.test):
            self._flag(walk, node.test, "ternary")

    def visit_CompIf(self, node: cst.CompIf, walk: FunctionWalk) -> None:
        if self._is_traced_test(walk, node.test):
            self._flag(walk, node.test, "comprehension if")

    def visit_MatchCase(self, node: cst.MatchCase, walk: FunctionWalk) -> None:
        if node.guard is not None and self._is_traced_test(walk, node.guard):
            self._flag(walk, node.guard, "case guard")

    def visit_Match(self, node: cst.Match, walk: FunctionWalk) -> None:
        for case in node.cases:
            for leaf in walk.case_leaves(case.pattern, node.subject):
                if leaf.value is not None and leaf.compared \
                        and is_traced(walk.equality_kind(leaf.node, leaf.kind, leaf.value)):
                    self._flag(walk, leaf.node or node.subject, "match")

    def visit_BooleanOperation(self, node: cst.BooleanOperation, walk: FunctionWalk) -> None:
        if walk.in_test(node):
            return  # the enclosing if/while/assert/ternary, filter or case guard is reported
        if is_traced(walk.kind(node.left)):
            self._flag(walk, node, "and" if isinstance(node.operator, cst.And) else "or")

    def visit_UnaryOperation(self, node: cst.UnaryOperation, walk: FunctionWalk) -> None:
        if isinstance(node.operator, cst.Not) and not walk.in_test(node) \
                and self._is_traced_test(walk, node.expression):
            self._flag(walk, node, "not")


def _is_python_flag(walk: FunctionWalk, test: cst.BaseExpression) -> bool:
    """Whether ``test`` is the bare truth value (``if train:``, ``not train``) of an unannotated parameter of a
    Flax or Equinox module's method, or of a function under a transform that passes Python values through
    (``eqx.filter_jit`` and its kin, ``nn.apply``): almost always a Python flag (``train``, ``decode``) that the
    caller passes as a literal, where it is static; an array's bare truth value is rarely what such a function asks."""
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        test = test.expression
    fi = walk.func
    if not isinstance(test, cst.Name) or fi is None:
        return False
    module_method = fi.method_of is not None and fi.method_of.framework is not None
    if not (module_method or any(spec.sig.python_values for spec in fi.roots)):
        return False
    return any(p.name.value == test.value and p.annotation is None for p in named_params(fi.node.params))


_CONVERTERS = ("bool", "int", "float", "complex")
# builtins that compare their arguments (or the items of their one argument) in Python, or take their
# truth values, with what to use instead
_COMPARING_BUILTINS = {
    "max": "use jnp.maximum (jnp.max over an array)",
    "min": "use jnp.minimum (jnp.min over an array)",
    "sorted": "use jnp.sort",
    "any": "use jnp.any",
    "all": "use jnp.all",
}


class Concretization(Rule):
    """Forcing a traced value to a concrete Python or numpy value.

    ``bool()``, ``int()``, ``float()``, ``complex()``, ``.item()``, ``.tolist()``, ``np.*`` (numpy
    proper, not ``jax.numpy``) and ``math.*`` on a traced value raise ``ConcretizationTypeError``
    (or ``TracerArrayConversionError``) under ``jit``. So do the builtins that compare values or take
    their truth in Python: ``max``/``min`` of several arguments, one of them traced (``max(x.sum(), 0.0)``),
    and ``max``/``min``/``sorted``/``any``/``all`` of one literal list, tuple or set with a traced item or of
    a comprehension of traced items (``any(v.sum() > 0 for v in xs)``). Any other single argument is not
    flagged (``sorted(params)`` of a dict of arrays iterates its keys), nor is a call with ``key=`` (it
    compares the keys). On static values (``int(x.shape[0])``, ``np.prod(x.shape)``,
    ``max(x.shape[0], 1)``) they are fine. The ``jax.numpy`` functions whose output's shape depends on the
    values (``nonzero``, ``argwhere``, ``flatnonzero``, ``unique`` and its kin, one-argument ``where``,
    ``compress``, ``extract``, the ``*1d`` set operations) need them concrete too, unless given ``size=``.
    """

    entry = CONCRETIZATION
    scope = TRACED
    message = ("`{call}` on a traced value needs a concrete Python value (ConcretizationTypeError "
               "under jit); {fix}")
    VALID = [
        """
        import jax
        import numpy as np

        @jax.jit
        def f(x):
            n = int(x.shape[0])
            d = np.prod(x.shape)
            return x.reshape(n, -1) / float(d)
        """,
        """
        import jax.numpy as np

        def f(x):
            return float(x.sum())
        """,
        """
        import jax
        import numpy as np

        @jax.jit
        def f(x):
            return np.mean(x) + np.sum(x, axis=0)  # numpy calls the tracer's own .mean(), .sum()
        """,
        """
        import jax

        @jax.jit
        def f(x, params, n: int):
            rows = max(x.shape[0] // 2, 1, min(n, 3))
            widths = sorted([x.shape[-1], len(params)])
            first = min(params, key=len)  # a traced pytree's keys or items, compared by a key
            names = sorted(params)  # a dict of arrays: its keys
            if any(w > 1 for w in widths) and all([rows, n]):
                x = x * params[first]
            return x, names
        """,
        """
        import jax
        import jax.numpy as jnp

        @jax.jit
        def f(x):
            rows, cols = jnp.nonzero(x > 0, size=4, fill_value=0)  # a static output shape
            return jnp.where(x > 0, x, 0.0)[rows, cols], jnp.unique(x, size=3)
        """,
    ]
    INVALID = [
        Invalid("""
        import jax

        @jax.jit
        def f(x):
            return x * float(x.max())
        """, line=5, col=15),
        Invalid("""
        import jax
        import jax.numpy as jnp

        @jax.jit
        def f(x):
            (rows,) = jnp.where(x > 0)
            return x[rows]
        """, line=6, col=14),
        Invalid("""
        import jax
        import numpy as onp

        @jax.jit
        def f(x):
            y = onp.asarray(x)
            return y
        """, line=6, col=8),
        Invalid("""
        import jax

        @jax.grad
        def f(x):
            print(x.item())
            return x.sum()
        """, line=5, col=10),
        Invalid("""
        import jax

        @jax.jit
        def f(x):
            m = max(x.sum(), 0.0)
            return x / m
        """, line=5, col=8),
        Invalid("""
        import jax

        @jax.jit
        def f(xs):
            if any(v.sum() > 0 for v in xs):
                return xs
            return [-v for v in xs]
        """, line=5, col=7),
        Invalid("""
        import jax

        @jax.jit
        def f(a, b):
            lo, hi = sorted([a.min(), b.min()])
            return a + lo + hi
        """, line=5, col=13),
    ]

    def visit_Call(self, node: cst.Call, walk: FunctionWalk) -> None:
        func = node.func
        if isinstance(func, cst.Name):
            if func.value in _CONVERTERS and len(node.args) == 1 and walk.is_builtin(func, func.value) \
                    and is_traced(walk.kind(node.args[0].value)):
                self.report(walk, node, call=f"{func.value}()",
                            fix="keep it an array (jnp.where / lax.cond for branches, .astype for dtypes)")
            elif func.value in _COMPARING_BUILTINS and walk.is_builtin(func, func.value) \
                    and _compares_traced(node, walk, func.value):
                self.report(walk, node, call=f"{func.value}()", fix=_COMPARING_BUILTINS[func.value])
            return
        if isinstance(func, cst.Attribute) and func.attr.value in ("item", "tolist") and not node.args \
                and is_traced(walk.kind(func.value)):
            self.report(walk, node, call=f".{func.attr.value}()",
                        fix="keep it an array and return it from the traced function")
            return
        q = walk.qualname(func)
        if q is None:
            return
        if q.startswith("jax.numpy.") and _shape_from_values(node, q, walk):
            self.report(walk, node, call=f"{dotted_name(func) or q}()",
                        fix="pass size= (and fill_value=) so that its output's shape is static")
            return
        if q.startswith(("numpy.", "math.")):
            last = q.rpartition(".")[2]
            if last in NUMPY_OK_FUNCS or delegates_to_method(q, [walk.kind(a.value) for a in node.args[:1]]):
                return
            if any(is_traced(walk.kind(a.value)) for a in node.args):
                raw = dotted_name(func) or q
                fix = ("use the jax.numpy equivalent" if q.startswith("numpy.")
                       else "use the jax.numpy equivalent of this math function")
                self.report(walk, node, call=f"{raw}()", fix=fix)


# jax.numpy functions whose output's shape is the count of some values, unless size= fixes it
_SIZED_BY_VALUES = frozenset({"nonzero", "argwhere", "flatnonzero", "unique", "unique_values", "unique_counts",
                              "unique_inverse", "unique_all", "compress", "extract", "intersect1d", "union1d",
                              "setdiff1d", "setxor1d"})


def _shape_from_values(call: cst.Call, q: str, walk: FunctionWalk) -> bool:
    """Whether the ``jax.numpy`` call ``q`` has an output shape set by its traced arguments' values: one of
    :data:`_SIZED_BY_VALUES`, or ``where`` with a condition alone, on a traced argument and without ``size=``."""
    name = q[len("jax.numpy."):]
    positional = [a.value for a in call.args if a.keyword is None and not a.star]
    if name == "where":
        if len(positional) != 1 or any(a.keyword is not None and a.keyword.value in ("x", "y") for a in call.args):
            return False
    elif name not in _SIZED_BY_VALUES:
        return False
    if any(a.keyword is not None and a.keyword.value == "size" for a in call.args) or any(a.star for a in call.args):
        return False
    return any(is_traced(walk.kind(a.value)) for a in call.args)


def _compares_traced(call: cst.Call, walk: FunctionWalk, name: str) -> bool:
    """Whether the builtin ``name`` (``max``, ``min``, ``sorted``, ``any``, ``all``) compares traced values or takes
    their truth: two or more positional arguments (``max``/``min``) of which one is traced, or one argument that is
    a literal list/tuple/set with a traced item (and two items or more for ``max``/``min``/``sorted``, which only
    compare then) or a comprehension of traced items.
    A lone argument of any other kind is not known to hold traced items (``sorted(params)`` of a dict iterates
    its keys); nor are the values a ``key=`` function compares."""
    if any(a.star for a in call.args) or any(a.keyword is not None and a.keyword.value == "key" for a in call.args):
        return False
    args = [a.value for a in call.args if a.keyword is None]
    if len(args) > 1:
        return name in ("max", "min") and any(is_traced(walk.kind(a)) for a in args)
    if len(args) != 1:
        return False
    arg = args[0]
    if isinstance(arg, (cst.List, cst.Tuple, cst.Set)):
        items = arg.elements
        return len(items) >= (1 if name in ("any", "all") else 2) \
            and not any(isinstance(e, cst.StarredElement) for e in items) \
            and any(is_traced(walk.kind(e.value)) for e in items)
    if isinstance(arg, (cst.ListComp, cst.SetComp, cst.GeneratorExp)) and not isinstance(arg.elt, cst.Name):
        return is_traced(walk.kind(arg.elt))  # a bare loop variable could be a key of a dict of arrays
    return False
