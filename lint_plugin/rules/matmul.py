"""JX10x: matmuls and convolutions that break the int8 contract, and matmuls out of the rewrite's reach."""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import libcst as cst

from jx_codes import BROADCAST_MULTIPLY_SUM, CONVOLUTION, FLOAT_MATMUL, HIDDEN_MATMUL, INT8_ACCUMULATOR

from ..call_args import kwarg, positional
from ..dtypes import is_int32_dtype, is_integer_or_bool
from ..kinds import INT8, STATIC, is_traced
from ..names import CONV_FUNCS, MATMUL_FUNCS, short_name
from ..walk import FunctionWalk
from ._base import ANYWHERE, PLAIN, TRACED, Invalid, Rule
from ._broadcast import is_emulated_matmul
from ._operand_dtypes import operand_dtype

__all__ = ["BroadcastMultiplySum", "Convolution", "FloatMatmul", "HiddenMatmul", "Int8MatmulInt8Accumulator",
           "is_hidden_matmul"]

_EINSUM = "jax.numpy.einsum"
_TENSORDOT = ("jax.numpy.tensordot", "jax.numpy.linalg.tensordot")
_MULTI_DOT = "jax.numpy.linalg.multi_dot"
_ATTENTION = "jax.nn.dot_product_attention"
_SUBSCRIPTS = (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString, cst.Name, cst.Attribute)
# ``x.__matmul__(w)`` is ``x @ w``; ``x.__rmatmul__(w)`` is ``w @ x``
_MATMUL_DUNDERS = {"__matmul__": False, "__rmatmul__": True}


class Matmul(NamedTuple):
    name: str                              # how the message names it: "@", "jnp.matmul", ...
    operands: List[cst.BaseExpression]     # ``*ops`` counts as one operand
    int32_acc: bool                        # preferred_element_type=int32 was passed
    is_operator: bool                      # ``@`` (cannot take preferred_element_type)


def _int32_accumulator(call: cst.Call, walk: FunctionWalk) -> bool:
    pet = kwarg(call, "preferred_element_type")
    return pet is not None and is_int32_dtype(pet, walk.info.imports)


def _einsum_contracts(spec: str) -> bool:
    """Whether an einsum spec sums over an index shared by two operands (``"bk,kn->bn"``, implicit
    ``"i,i"``): a contraction, what a matmul is. ``"...k,k->...k"`` (scaling) and ``"i,j->ij"`` (an
    outer product) sum nothing; a spec that does not read as one is taken to contract."""
    inputs, arrow, output = spec.replace(" ", "").replace("...", "").partition("->")
    terms = inputs.split(",")
    if not all(term.isalpha() or term == "" for term in (*terms, output)):
        return True
    sets = [set(term) for term in terms]
    in_two = {index for i, term in enumerate(sets) for other in sets[i + 1:] for index in term & other}
    # without ``->`` the output is the indices seen once, so every shared one is summed
    return bool(in_two - set(output)) if arrow else bool(in_two)


def _einsum_operands(args: List[cst.BaseExpression],
                     starred: List[cst.BaseExpression]) -> Optional[List[cst.BaseExpression]]:
    """The operands of an einsum that contracts; None for one that does not (or is not a spec call)."""
    if not args or not isinstance(args[0], _SUBSCRIPTS):
        return None
    spec = args[0].evaluated_value if isinstance(args[0], (cst.SimpleString, cst.ConcatenatedString)) else None
    if isinstance(spec, str) and not _einsum_contracts(spec):
        return None
    operands = args[1:] + starred
    if len(operands) < 2 and not starred:
        return None  # one-operand einsum: a transpose/trace/sum, not a matmul
    return operands


def _is_outer_tensordot(call: cst.Call, args: List[cst.BaseExpression]) -> bool:
    """``jnp.tensordot(a, b, axes=0)``: an outer product, no index summed."""
    axes = kwarg(call, "axes")
    if axes is None and len(args) > 2:
        axes = args[2]
    return isinstance(axes, cst.Integer) and axes.evaluated_value == 0


def is_hidden_matmul(call: cst.Call, qualname) -> bool:
    """Whether ``call`` (of the function ``qualname``) computes its matmuls inside a library kernel: cuDNN's fused
    attention, ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (the argument is keyword-only)."""
    implementation = kwarg(call, "implementation")
    return (qualname == _ATTENTION and isinstance(implementation, cst.SimpleString)
            and implementation.evaluated_value == "cudnn")


def match_matmul(node: cst.CSTNode, walk: FunctionWalk) -> Optional[Matmul]:
    """A contraction of two or more arrays: ``a @ b`` (also spelt ``a.__matmul__(b)``), a matmul
    function of :data:`~lint_plugin.names.MATMUL_FUNCS` (an einsum or ``tensordot`` only when it sums
    over a shared index), ``jnp.linalg.multi_dot([...])``, or ``x.dot(y)`` on an array."""
    if isinstance(node, cst.BinaryOperation):
        if isinstance(node.operator, cst.MatrixMultiply):
            return Matmul("@", [node.left, node.right], False, True)
        return None
    if not isinstance(node, cst.Call):
        return None
    q = walk.qualname(node.func)
    args = positional(node)
    starred = [a.value for a in node.args if a.star == "*"]  # ``jnp.einsum(spec, *operands)``
    if q is not None and q in MATMUL_FUNCS:
        if is_hidden_matmul(node, q):
            return None  # its matmuls are inside a library kernel: JX105
        if q == _EINSUM:
            operands = _einsum_operands(args, starred)
            if operands is None:
                return None
        elif q == _MULTI_DOT:
            chain = args[0] if args else None
            operands = [el.value for el in chain.elements] if isinstance(chain, (cst.List, cst.Tuple)) \
                else args[:1] + starred
        elif q in _TENSORDOT and _is_outer_tensordot(node, args):
            return None
        else:
            operands = args[:2] + [v for v in (kwarg(node, kw) for kw in ("lhs", "rhs", "a", "b")) if v is not None]
            operands += starred
        return Matmul(short_name(q), operands, _int32_accumulator(node, walk), False)
    f = node.func
    if q is not None or not isinstance(f, cst.Attribute) or len(args) != 1:
        return None
    method = f.attr.value
    if method in _MATMUL_DUNDERS:
        operands = [args[0], f.value] if _MATMUL_DUNDERS[method] else [f.value, args[0]]
        return Matmul(f".{method}", operands, False, True)
    if method == "dot" and is_traced(walk.kind(f.value)):
        return Matmul(".dot", [f.value, args[0]], _int32_accumulator(node, walk), False)
    return None


def _what(operands: List[cst.BaseExpression], walk: FunctionWalk) -> str:
    """How JX101 names the matmul: by the operands' dtype when the source says they are not float."""
    dtypes = [operand_dtype(o, walk) for o in operands]
    if dtypes and all(d is not None and is_integer_or_bool(d) for d in dtypes):
        return f"{dtypes[0]} matmul" if len(set(dtypes)) == 1 else "non-int8 matmul"
    return "float matmul"


class _MatmulRule(Rule):
    """Runs ``check`` on every ``@`` and every call."""

    def check(self, node: cst.CSTNode, walk: FunctionWalk) -> None:
        raise NotImplementedError

    def visit_BinaryOperation(self, node: cst.BinaryOperation, walk: FunctionWalk) -> None:
        if isinstance(node.operator, cst.MatrixMultiply):
            self.check(node, walk)

    def visit_Call(self, node: cst.Call, walk: FunctionWalk) -> None:
        self.check(node, walk)


class FloatMatmul(_MatmulRule):
    """A matmul in traced code that is not an int8 x int8 matmul with an int32 accumulator.

    The int8 contract allows one kind of matmul: both operands int8, accumulated in int32. Any other
    matmul in traced code (``@``, ``x.__matmul__(w)``, ``jnp.matmul/dot/einsum/tensordot/inner/vdot``,
    ``jnp.linalg.multi_dot``, ``lax.dot/dot_general/batch_matmul``, ``pl.dot``, ``x.dot(y)``,
    ``jnp.einsum(spec, *operands)``) stays in float (or in the integer type its operands have: the
    message then names that dtype, e.g. ``int32 matmul``, or says ``non-int8 matmul``). A matmul is
    a contraction, a ``dot_general`` that sums over an index, as ``verify`` sees it in the jaxpr: a
    matmul of scales (``sx[:, None] @ sw[None, :]``) counts, while an einsum that sums no shared
    index (``"...k,k->...k"``, ``"i,j->ij"``), ``jnp.tensordot(a, b, axes=0)`` and ``jnp.outer`` (the
    broadcast multiply ``sx[:, None] * sw[None, :]``) are not matmuls. Not reported: matmuls of
    Python/numpy values only (``np.eye(3) @ basis``), functions under ``@int8ify``, which
    rewrites their matmuls, and the derivative rules of a custom derivative (``bwd``, a ``jvp``
    rule), whose matmuls ``int8ify`` keeps float by design (the primal and ``fwd`` are reported).
    """

    entry = FLOAT_MATMUL
    scope = PLAIN
    message = "{what} `{name}` in traced code (operands not both known int8, or no int32 accumulator); {instead}"
    VALID = [
        """
        import jax, jax.numpy as jnp

        @jax.jit
        def f(x_q, w_q):
            a = x_q.astype(jnp.int8)
            b = jnp.int8(w_q)
            return jnp.matmul(a, b, preferred_element_type=jnp.int32)
        """,
        """
        import jax
        from jaxpr_rewrite import int8ify

        @jax.jit
        @int8ify
        def f(x, w):
            return x @ w
        """,
        """
        import jax.numpy as jnp

        def not_traced(x, w):
            return x @ w
        """,
        """
        import jax
        import numpy as np

        _BASIS = np.linspace(0.0, 1.0, 9).reshape(3, 3)

        @jax.jit
        def f(x):
            gram = _BASIS @ _BASIS.T  # numpy on the host, a constant under the trace
            return x * gram.sum()
        """,
        """
        import jax, jax.numpy as jnp

        @jax.jit
        def f(acc, sx, sw, gain):
            scaled = jnp.einsum("...k,k->...k", acc, gain)
            return scaled * jnp.outer(sx, sw) * jnp.einsum("i,j->ij", sx, sw)
        """,
    ]
    INVALID = [
        Invalid("""
        import jax

        @jax.jit
        def f(x, w):
            return x @ w
        """, line=5, col=11),
        Invalid("""
        import jax, jax.numpy as jnp

        @jax.jit
        def f(x, w):
            xq, wq = x.astype(jnp.int8), w.astype(jnp.int8)
            return jnp.matmul(xq.astype(jnp.float32), wq.astype(jnp.float32))
        """, line=6, col=11),
        Invalid("""
        import jax

        @jax.jit
        def f(acc, sx, sw):
            return acc * (sx[:, None] @ sw[None, :])
        """, line=5, col=18),
        Invalid("""
        import jax, jax.numpy as jnp

        @jax.jit
        def f(x, w):
            return jnp.einsum("bk,kn", x, w)
        """, line=5, col=11),
        Invalid("""
        import jax, jax.numpy as jnp

        @jax.jit
        def f(x, w1, w2):
            return jnp.linalg.multi_dot([x, w1, w2])
        """, line=5, col=11),
        Invalid("""
        import jax

        @jax.jit
        def f(x, w):
            return x.__matmul__(w)
        """, line=5, col=11),
        Invalid("""
        import jax

        project = lambda x, w: x @ w
        fast_project = jax.jit(project)
        """, line=3, col=23),
        Invalid("""
        import jax, jax.numpy as jnp

        @jax.jit
        def f(spec, *operands):
            return jnp.einsum(spec, *operands)
        """, line=5, col=11),
        Invalid("""
        import flax.linen as nn
        import jax.numpy as jnp

        class Dense(nn.Module):
            features: int

            @nn.compact
            def __call__(self, x):
                k = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
                return jnp.dot(x, k)
        """, line=10, col=15),
    ]

    def check(self, node: cst.CSTNode, walk: FunctionWalk) -> None:
        mm = match_matmul(node, walk)
        if mm is None:
            return
        kinds = [walk.kind(o) for o in mm.operands]
        if all(k == STATIC for k in kinds):
            return
        if len(kinds) >= 2 and all(k == INT8 for k in kinds):
            return  # int8 x int8: fine with an int32 accumulator, JX102 otherwise
        self.report(walk, node, what=_what(mm.operands, walk), name=mm.name)


class Int8MatmulInt8Accumulator(_MatmulRule):
    """An int8 x int8 matmul without ``preferred_element_type=jnp.int32``.

    Without an int32 accumulator the products are summed in int8 and wrap around. Reported anywhere
    (traced or not), since the result is wrong either way.
    """

    entry = INT8_ACCUMULATOR
    scope = ANYWHERE
    message = ("int8 x int8 matmul `{name}` without preferred_element_type=jnp.int32 accumulates in "
               "int8 and wraps around; {fix}")
    VALID = [
        """
        import jax.numpy as jnp

        def f(x, w):
            return jnp.matmul(x.astype(jnp.int8), w.astype(jnp.int8), preferred_element_type=jnp.int32)
        """,
        """
        import jax.numpy as jnp

        def f(x, w):
            return jnp.matmul(x.astype(jnp.int8), w)
        """,
    ]
    INVALID = [
        Invalid("""
        import jax.numpy as jnp

        def f(x, w):
            xq = x.astype(jnp.int8)
            wq = w.astype(jnp.int8)
            return jnp.matmul(xq, wq)
        """, line=6, col=11),
        Invalid("""
        import jax.numpy as jnp

        def f(x, w):
            xq, wq = x.astype(jnp.int8), w.astype(jnp.int8)
            return xq @ wq
        """, line=5, col=11),
        Invalid("""
        import numpy as np
        import jax.numpy as jnp
        from jax import lax

        def f(x, w):
            xq = lax.convert_element_type(x, np.int8)
            wq = jnp.asarray(w, dtype="int8")
            return lax.dot(xq, wq, preferred_element_type=np.int8)
        """, line=8, col=11),
    ]

    def check(self, node: cst.CSTNode, walk: FunctionWalk) -> None:
        mm = match_matmul(node, walk)
        if mm is None or mm.int32_acc or len(mm.operands) < 2:
            return
        if all(walk.kind(o) == INT8 for o in mm.operands):
            fix = ("use jnp.matmul(a, b, preferred_element_type=jnp.int32) instead of `@`" if mm.is_operator
                   else "pass preferred_element_type=jnp.int32")
            self.report(walk, node, name=mm.name, fix=fix)


_SUMS = frozenset({"jax.numpy.sum", "jax.numpy.nansum"})


def _sum_axis(call: cst.Call, first_positional_is_array: bool) -> Optional[cst.BaseExpression]:
    """The ``axis`` a sum is given (``x.sum(1)``, ``jnp.sum(x, axis=-2)``); None for a full sum."""
    axis = kwarg(call, "axis")
    if axis is None:
        args = positional(call)
        idx = 1 if first_positional_is_array else 0
        if len(args) > idx:
            axis = args[idx]
    return None if axis is None or (isinstance(axis, cst.Name) and axis.value == "None") else axis


class BroadcastMultiplySum(Rule):
    """A matmul emulated by a broadcast multiply and a sum over an axis.

    ``(x[:, :, None] * w[None]).sum(1)`` and ``jnp.sum(a[..., None] * b[None], axis=-2)`` (also
    through a variable holding the product) compute a matmul the int8 rewrite cannot see, so it
    stays float: two operands expanded along different axes, multiplied into all B x D_in x D_out
    products and summed over the shared axis, the pattern ``verify`` finds in the jaxpr. So does one
    expanded operand times one that is not, summed over an axis the expanded one spans
    (``jnp.sum(pre[:, :, :, None] * x, axis=2)``, ``(alpha[:, None] * probs).sum(0)``,
    ``jnp.sum(softmax * pos[..., None], axis=-2)``): broadcast along the other's free axis and summed
    over the axis they share, it is a matrix-vector product (batched or not),
    ``jnp.einsum("bsk,bskd->bsd", pre, x)``. The linter reads the axes from the source, both counted
    from the same end (a non-negative ``axis`` assumes the expanded operand is not broadcast to a higher
    rank); ``verify``, which sees the jaxpr, reports only a product broadcast on both sides, since one
    broadcast operand summed over looks like any scaled sum there (int8ify's own epilogue followed by a
    sum over the outputs). Not reported: both expanded along the same axis, a sum
    over the inserted axis (``(acc * sx[:, None]).sum(1)``, scaled rows summed), axes counted from
    different ends (``jnp.sum(x * mask[..., None], axis=1)``), a product followed by a full sum, and
    scaling by broadcast scales (``acc * sx[:, None] * sw[None, :]``).
    """

    entry = BROADCAST_MULTIPLY_SUM
    scope = TRACED
    message = ("broadcast multiply + sum emulates a matmul that the int8 rewrite cannot see, so it "
               "stays float; {instead}")
    VALID = [
        """
        import jax, jax.numpy as jnp

        @jax.jit
        def f(acc, sx, sw):
            return acc.astype(jnp.float32) * sx[:, None] * sw[None, :]
        """,
        """
        import jax, jax.numpy as jnp

        @jax.jit
        def f(x, mask):
            return jnp.sum(x * mask, axis=-1)
        """,
        """
        import jax, jax.numpy as jnp

        @jax.jit
        def f(acc, sx, gate, up):
            row_sums = (acc * sx[:, None]).sum(1)
            return row_sums + jnp.sum(gate[:, None] * up[:, None], axis=0)
        """,
    ]
    INVALID = [
        Invalid("""
        import jax

        @jax.jit
        def f(x, w):
            return (x[:, :, None] * w[None]).sum(1)
        """, line=5, col=11),
        Invalid("""
        import jax, jax.numpy as jnp

        @jax.jit
        def f(a, b):
            return jnp.sum(a[..., None] * b[None], axis=-2)
        """, line=5, col=11),
        Invalid("""
        import jax, jax.numpy as jnp

        @jax.jit
        def f(x, w):
            return jnp.sum(jnp.expand_dims(x, -1) * jnp.expand_dims(w, 0), axis=1)
        """, line=5, col=11),
        Invalid("""
        import jax, jax.numpy as jnp

        @jax.jit
        def f(x_q, w_q):
            prod = x_q[:, :, jnp.newaxis].astype(jnp.int32) * w_q[jnp.newaxis].astype(jnp.int32)
            return prod.sum(axis=1)
        """, line=6, col=11),
        Invalid("""
        import jax, jax.numpy as jnp

        @jax.jit
        def f(pre, x):
            return jnp.sum(pre[:, :, :, None] * x, axis=2)
        """, line=5, col=11),
        Invalid("""
        import jax

        @jax.jit
        def f(alpha, probs):
            return (alpha[:, None] * probs).sum(axis=0)
        """, line=5, col=11),
    ]

    def visit_Call(self, node: cst.Call, walk: FunctionWalk) -> None:
        f = node.func
        q = walk.qualname(f)
        if q is None and isinstance(f, cst.Attribute) and f.attr.value == "sum":
            product, axis = f.value, _sum_axis(node, False)
        elif node.args and node.args[0].keyword is None and q in _SUMS:
            product, axis = node.args[0].value, _sum_axis(node, True)
        else:
            return
        if axis is not None and is_emulated_matmul(product, walk, axis):
            self.report(walk, node)


class Convolution(Rule):
    """A convolution in traced code.

    ``lax.conv*`` (``conv_general_dilated``, ``conv_transpose``, ``conv_general_dilated_local``,
    ``conv_general_dilated_patches``, ...), ``jnp.convolve``/``jnp.correlate`` and
    ``jax.scipy.signal.convolve*/correlate*`` stay float: the int8 contract allows only int8 matmuls.
    """

    entry = CONVOLUTION
    scope = TRACED
    message = ("convolution `{name}` in traced code stays float (the int8 contract allows only int8 "
               "matmuls); {instead}")
    VALID = [
        """
        import jax, jax.numpy as jnp

        def host_side(x, k):
            return jnp.convolve(x, k)
        """,
    ]
    INVALID = [
        Invalid("""
        import jax
        from jax import lax

        @jax.jit
        def f(x, k):
            return lax.conv_general_dilated(x, k, (1, 1), "SAME")
        """, line=6, col=11),
        Invalid("""
        import jax
        import jax.numpy as np_

        @jax.vmap
        def f(x, k):
            return np_.convolve(x, k, mode="same")
        """, line=6, col=11),
    ]

    def visit_Call(self, node: cst.Call, walk: FunctionWalk) -> None:
        q = walk.qualname(node.func)
        if q is not None and q in CONV_FUNCS:
            self.report(walk, node, name=short_name(q))


class HiddenMatmul(Rule):
    """A call whose matmuls run in float inside a library kernel, out of int8ify's reach.

    ``jax.nn.dot_product_attention(..., implementation="cudnn")`` computes attention's two matmuls in
    one cuDNN call: the traced program holds that call, not its matmuls, so ``@int8ify`` cannot
    rewrite them (it refuses the call, with this code, and ``verify`` reports it). The XLA
    implementation (``implementation="xla"``, or ``None``, which picks it) computes them as einsums
    that int8ify rewrites. Reported in any traced code, under ``@int8ify`` too (JX101 does not report
    the call as well); an implementation passed as a variable is not (it may be ``"xla"``). A matmul
    with a ``jax.experimental.sparse`` operand, and a ``jax.export``'ed program's float matmuls run
    by ``Exported.call``, are out of reach the same way; which operand is sparse and what a module
    holds are known only when tracing, so ``int8ify`` and ``verify`` report those (JX105), not the
    linter.
    """

    entry = HIDDEN_MATMUL
    scope = TRACED
    message = '`{name}(..., implementation="cudnn")` computes its matmuls in float inside cuDNN; {instead}'
    VALID = [
        """
        import jax

        @jax.jit
        def f(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, implementation="xla")
        """,
        """
        from jaxpr_rewrite import int8ify
        import jax

        @int8ify
        def f(q, k, v, implementation):
            return jax.nn.dot_product_attention(q, k, v, implementation=implementation)
        """,
    ]
    INVALID = [
        Invalid("""
        from jaxpr_rewrite import int8ify
        import jax

        @int8ify
        def f(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        """, line=6, col=11),
        Invalid("""
        import jax
        from jax.nn import dot_product_attention as attention

        @jax.jit
        def f(q, k, v):
            return attention(q, k, v, implementation='cudnn')
        """, line=6, col=11),
    ]

    def visit_Call(self, node: cst.Call, walk: FunctionWalk) -> None:
        q = walk.qualname(node.func)
        if is_hidden_matmul(node, q):
            self.report(walk, node, name=short_name(q))
