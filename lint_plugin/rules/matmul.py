"""JX10x: matmuls and convolutions that break the int8 contract."""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import libcst as cst

from ..dataflow import FunctionWalk, _kwarg, is_broadcast_product, is_int32_dtype
from ..kinds import INT8, STATIC, is_traced
from ..names import CONV_FUNCS, MATMUL_FUNCS
from ._base import ANYWHERE, PLAIN, TRACED, Rule

__all__ = ["FloatMatmul", "Int8MatmulInt8Accumulator", "BroadcastMultiplySum", "Convolution"]


def short_name(qualname: str) -> str:
    for prefix, short in (("jax.numpy.", "jnp."), ("jax.lax.", "lax."), ("jax.scipy.", "jax.scipy.")):
        if qualname.startswith(prefix):
            return short + qualname[len(prefix):]
    return qualname


class Matmul(NamedTuple):
    name: str                              # how the message names it: "@", "jnp.matmul", ...
    operands: List[cst.BaseExpression]
    int32_acc: bool                        # preferred_element_type=int32 was passed
    is_operator: bool                      # ``@`` (cannot take preferred_element_type)


def match_matmul(node: cst.CSTNode, walk: FunctionWalk) -> Optional[Matmul]:
    if isinstance(node, cst.BinaryOperation):
        if isinstance(node.operator, cst.MatrixMultiply):
            return Matmul("@", [node.left, node.right], False, True)
        return None
    if not isinstance(node, cst.Call):
        return None
    q = walk.qualname(node.func)
    positional = [a.value for a in node.args if a.keyword is None and not a.star]
    if q is not None and q in MATMUL_FUNCS:
        if q == "jax.numpy.einsum":
            subscripts = (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString, cst.Name, cst.Attribute)
            if not positional or not isinstance(positional[0], subscripts):
                return None
            operands = positional[1:]
            if len(operands) < 2:
                return None  # one-operand einsum: a transpose/trace/sum, not a matmul
        else:
            operands = positional[:2]
            for kw in ("lhs", "rhs", "a", "b"):
                v = _kwarg(node, kw)
                if v is not None:
                    operands.append(v)
        pet = _kwarg(node, "preferred_element_type")
        return Matmul(short_name(q), operands, pet is not None and is_int32_dtype(pet, walk), False)
    f = node.func
    if q is None and isinstance(f, cst.Attribute) and f.attr.value == "dot" and len(positional) == 1 \
            and is_traced(walk.kind(f.value)):
        pet = _kwarg(node, "preferred_element_type")
        return Matmul(".dot", [f.value, positional[0]], pet is not None and is_int32_dtype(pet, walk), False)
    return None


class FloatMatmul(Rule):
    code = "JX101"
    name = "float-matmul"
    scope = PLAIN
    message = ("float matmul `{name}` in traced code (operands not both known int8, or no int32 "
               "accumulator); wrap the function with @int8ify or quantize both operands to int8 and "
               "pass preferred_element_type=jnp.int32")
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
        from int8ify import int8ify

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
        import jax.numpy as jnp
        from jax import lax

        @jax.jit
        def f(x, w):
            xq = lax.convert_element_type(x, jnp.int8)
            wq = w.astype("int8")
            return lax.dot_general(xq, wq, (((1,), (0,)), ((), ())), preferred_element_type="int32")
        """,
    ]
    INVALID = [
        """
        import jax

        @jax.jit
        def f(x, w):
            return x @ w
        """,
        """
        import jax, jax.numpy as jnp

        @jax.jit
        def f(x, w, sx, sw):
            xq = x.astype(jnp.int8)
            wq = w.astype(jnp.int8)
            y = jnp.matmul(xq.astype(jnp.float32), wq.astype(jnp.float32))
            return y * jnp.outer(sx, sw)
        """,
        """
        import flax.linen as nn
        import jax.numpy as jnp

        class Dense(nn.Module):
            features: int

            @nn.compact
            def __call__(self, x):
                k = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
                return jnp.dot(x, k)
        """,
    ]

    def _check(self, node: cst.CSTNode, walk: FunctionWalk) -> None:
        mm = match_matmul(node, walk)
        if mm is None:
            return
        kinds = [walk.kind(o) for o in mm.operands]
        if all(k == STATIC for k in kinds):
            return
        if len(kinds) >= 2 and all(k == INT8 for k in kinds):
            return  # int8 x int8: fine with an int32 accumulator, JX102 otherwise
        self.report(walk, node, name=mm.name)

    def visit_BinaryOperation(self, node: cst.BinaryOperation, walk: FunctionWalk) -> None:
        if isinstance(node.operator, cst.MatrixMultiply):
            self._check(node, walk)

    def visit_Call(self, node: cst.Call, walk: FunctionWalk) -> None:
        self._check(node, walk)


class Int8MatmulInt8Accumulator(Rule):
    code = "JX102"
    name = "int8-accumulator"
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
        """
        import jax.numpy as jnp

        def f(x, w):
            xq = x.astype(jnp.int8)
            wq = w.astype(jnp.int8)
            return jnp.matmul(xq, wq)
        """,
        """
        import jax.numpy as jnp

        def f(x, w):
            xq, wq = x.astype(jnp.int8), w.astype(jnp.int8)
            return xq @ wq
        """,
        """
        import numpy as np
        import jax.numpy as jnp
        from jax import lax

        def f(x, w):
            xq = lax.convert_element_type(x, np.int8)
            wq = jnp.asarray(w, dtype="int8")
            return lax.dot(xq, wq, preferred_element_type=np.int8)
        """,
    ]

    def _check(self, node: cst.CSTNode, walk: FunctionWalk) -> None:
        mm = match_matmul(node, walk)
        if mm is None or mm.int32_acc or len(mm.operands) < 2:
            return
        if all(walk.kind(o) == INT8 for o in mm.operands):
            fix = ("use jnp.matmul(a, b, preferred_element_type=jnp.int32) instead of `@`" if mm.is_operator
                   else "pass preferred_element_type=jnp.int32")
            self.report(walk, node, name=mm.name, fix=fix)

    def visit_BinaryOperation(self, node: cst.BinaryOperation, walk: FunctionWalk) -> None:
        if isinstance(node.operator, cst.MatrixMultiply):
            self._check(node, walk)

    def visit_Call(self, node: cst.Call, walk: FunctionWalk) -> None:
        self._check(node, walk)


_SUMS = frozenset({"jax.numpy.sum", "jax.numpy.nansum"})


def _axis_given(call: cst.Call, first_positional_is_array: bool) -> bool:
    axis = _kwarg(call, "axis")
    if axis is None:
        positional = [a for a in call.args if a.keyword is None and not a.star]
        idx = 1 if first_positional_is_array else 0
        if len(positional) > idx:
            axis = positional[idx].value
    if axis is None:
        return False
    return not (isinstance(axis, cst.Name) and axis.value == "None")


class BroadcastMultiplySum(Rule):
    code = "JX103"
    name = "broadcast-multiply-sum"
    scope = TRACED
    message = ("broadcast multiply + sum emulates a matmul that the int8 rewrite cannot see, so it "
               "stays float; use jnp.matmul/lax.dot_general on int8 operands with "
               "preferred_element_type=jnp.int32 (or jnp.einsum under @int8ify)")
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
    ]
    INVALID = [
        """
        import jax

        @jax.jit
        def f(x, w):
            return (x[:, :, None] * w[None]).sum(1)
        """,
        """
        import jax, jax.numpy as jnp

        @jax.jit
        def f(a, b):
            return jnp.sum(a[..., None] * b, axis=-2)
        """,
        """
        import jax, jax.numpy as jnp

        @jax.jit
        def f(x_q, w_q):
            prod = x_q[:, :, jnp.newaxis].astype(jnp.int32) * w_q[jnp.newaxis].astype(jnp.int32)
            return prod.sum(axis=1)
        """,
    ]

    def visit_Call(self, node: cst.Call, walk: FunctionWalk) -> None:
        f = node.func
        q = walk.qualname(f)
        if q is None and isinstance(f, cst.Attribute) and f.attr.value == "sum":
            if is_broadcast_product(f.value, walk) and _axis_given(node, False):
                self.report(walk, node)
            return
        if node.args and node.args[0].keyword is None and q in _SUMS:
            if is_broadcast_product(node.args[0].value, walk) and _axis_given(node, True):
                self.report(walk, node)


class Convolution(Rule):
    code = "JX104"
    name = "convolution"
    scope = TRACED
    message = ("convolution `{name}` in traced code stays float (the int8 contract allows only int8 "
               "matmuls); express it as an int8 matmul over patches with preferred_element_type=jnp.int32")
    VALID = [
        """
        import jax, jax.numpy as jnp

        def host_side(x, k):
            return jnp.convolve(x, k)
        """,
    ]
    INVALID = [
        """
        import jax
        from jax import lax

        @jax.jit
        def f(x, k):
            return lax.conv_general_dilated(x, k, (1, 1), "SAME")
        """,
        """
        import jax
        import jax.numpy as np_

        @jax.vmap
        def f(x, k):
            return np_.convolve(x, k, mode="same")
        """,
    ]

    def visit_Call(self, node: cst.Call, walk: FunctionWalk) -> None:
        q = walk.qualname(node.func)
        if q is not None and q in CONV_FUNCS:
            self.report(walk, node, name=short_name(q))
