"""Fully qualified names the rules and the traced-code discovery know about.

Names are written as the alias table resolves them (``jax.numpy.matmul``, never ``jnp.matmul``).
"""

from __future__ import annotations

from typing import Dict, FrozenSet, Optional, Tuple

__all__ = [
    "TRANSFORMS",
    "TransformSig",
    "FLAX_MODULE_BASES",
    "FLAX_COMPACT",
    "MATMUL_FUNCS",
    "CONV_FUNCS",
    "CALLBACK_FUNCS",
    "CALLBACK_PREFIXES",
    "DEBUG_FUNCS",
    "STATIC_RESULT_FUNCS",
    "NUMPY_OK_FUNCS",
    "is_int8ify",
    "is_array_api",
]


class TransformSig:
    """Where a function transform takes its function arguments, and how it traces them.

    ``fun_pos``: positional indices of function arguments; ``fun_kw``: their keyword names;
    ``list_pos``: index of a list/tuple of functions (``lax.switch``); ``params``: which
    parameters of the wrapped function become tracers: ``"all"`` (jit, vmap, lax bodies),
    ``"argnums"`` (grad: only the differentiated ones, default 0).
    """

    __slots__ = ("fun_pos", "fun_kw", "list_pos", "params", "int8ify")

    def __init__(
        self,
        fun_pos: Tuple[int, ...] = (0,),
        fun_kw: Tuple[str, ...] = ("fun", "f"),
        list_pos: Optional[int] = None,
        params: str = "all",
        int8ify: bool = False,
    ) -> None:
        self.fun_pos = fun_pos
        self.fun_kw = fun_kw
        self.list_pos = list_pos
        self.params = params
        self.int8ify = int8ify


_ALL = TransformSig()
_GRAD = TransformSig(params="argnums")

TRANSFORMS: Dict[str, TransformSig] = {
    "jax.jit": _ALL,
    "jax.pjit": _ALL,
    "jax.pmap": _ALL,
    "jax.vmap": _ALL,
    "jax.grad": _GRAD,
    "jax.value_and_grad": _GRAD,
    "jax.jacfwd": _GRAD,
    "jax.jacrev": _GRAD,
    "jax.hessian": _GRAD,
    "jax.checkpoint": _ALL,
    "jax.remat": _ALL,
    "jax.named_call": _ALL,
    "jax.experimental.shard_map.shard_map": TransformSig(fun_kw=("f",)),
    "jax.shard_map": TransformSig(fun_kw=("f",)),
    "jax.lax.scan": TransformSig(fun_kw=("f",)),
    "jax.lax.map": TransformSig(fun_kw=("f",)),
    "jax.lax.associative_scan": TransformSig(fun_kw=("fn",)),
    "jax.lax.cond": TransformSig(fun_pos=(1, 2), fun_kw=("true_fun", "false_fun")),
    "jax.lax.while_loop": TransformSig(fun_pos=(0, 1), fun_kw=("cond_fun", "body_fun")),
    "jax.lax.fori_loop": TransformSig(fun_pos=(2,), fun_kw=("body_fun",)),
    "jax.lax.switch": TransformSig(fun_pos=(), fun_kw=(), list_pos=1),
    "equinox.filter_jit": _ALL,
    "equinox.filter_vmap": _ALL,
    "equinox.filter_pmap": _ALL,
    "equinox.filter_grad": TransformSig(params="first"),
    "equinox.filter_value_and_grad": TransformSig(params="first"),
    "equinox.filter_checkpoint": _ALL,
    "flax.linen.jit": _ALL,
}

_INT8IFY = TransformSig(int8ify=True)


def is_int8ify(qualname: Optional[str], raw: Optional[str]) -> bool:
    """``int8ify`` from this project, however it was imported."""
    for name in (qualname, raw):
        if name and (name == "int8ify" or name.endswith(".int8ify")):
            return True
    return False


def int8ify_sig() -> TransformSig:
    return _INT8IFY


FLAX_MODULE_BASES: FrozenSet[str] = frozenset({"flax.linen.Module", "flax.linen.module.Module"})
FLAX_COMPACT: FrozenSet[str] = frozenset({"flax.linen.compact", "flax.linen.module.compact"})

_JNP = "jax.numpy."
MATMUL_FUNCS: FrozenSet[str] = frozenset(
    [_JNP + n for n in ("matmul", "dot", "einsum", "tensordot", "inner", "vdot", "outer")]
    + ["jax.numpy.linalg.matmul", "jax.numpy.linalg.vecdot", "jax.numpy.linalg.tensordot"]
    + ["jax.lax." + n for n in ("dot", "dot_general", "batch_matmul")]
)

CONV_FUNCS: FrozenSet[str] = frozenset(
    ["jax.lax." + n for n in (
        "conv", "conv_general_dilated", "conv_with_general_padding", "conv_transpose",
        "conv_general_dilated_local", "conv_general_dilated_patches",
    )]
    + [_JNP + "convolve", _JNP + "correlate"]
    + ["jax.scipy.signal." + n for n in ("convolve", "convolve2d", "correlate", "correlate2d", "fftconvolve")]
)

CALLBACK_FUNCS: FrozenSet[str] = frozenset({
    "jax.pure_callback",
    "jax.experimental.pure_callback",
    "jax.experimental.io_callback",
    "jax.debug.callback",
})
CALLBACK_PREFIXES: Tuple[str, ...] = ("jax.experimental.host_callback.",)

DEBUG_FUNCS: FrozenSet[str] = frozenset({"jax.debug.print", "jax.debug.breakpoint"})

# jnp/lax/jax functions whose result is a Python value (or dtype) even on traced input.
STATIC_RESULT_FUNCS: FrozenSet[str] = frozenset(
    [_JNP + n for n in (
        "shape", "ndim", "size", "result_type", "dtype", "issubdtype", "iinfo", "finfo",
        "promote_types", "isdtype", "can_cast", "isscalar", "iscomplexobj", "isrealobj",
    )]
    + ["jax.dtypes.canonicalize_dtype", "jax.dtypes.result_type", "jax.dtypes.issubdtype",
       "jax.tree_util.tree_structure", "jax.tree.structure", "jax.devices", "jax.device_count",
       "jax.local_device_count", "jax.process_index", "jax.process_count", "jax.lax.axis_size",
       "jax.core.concrete_or_error", "jax.numpy.broadcast_shapes"]
)

# numpy functions that are fine on tracers (they only read static metadata).
NUMPY_OK_FUNCS: FrozenSet[str] = frozenset({
    "shape", "ndim", "size", "dtype", "result_type", "issubdtype", "iinfo", "finfo",
    "promote_types", "can_cast", "isscalar",
})

_ARRAY_API_PREFIXES: Tuple[str, ...] = (
    "jax.numpy.", "jax.lax.", "jax.nn.", "jax.random.", "jax.scipy.", "jax.image.",
)


def is_array_api(qualname: str) -> bool:
    """A jax function returning arrays (so its result under a trace is a tracer)."""
    return qualname.startswith(_ARRAY_API_PREFIXES)
