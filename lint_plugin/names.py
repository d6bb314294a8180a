"""Fully qualified names of the JAX-world functions and classes the discovery and the rules know.

Names are written as the import table resolves them (``jax.numpy.matmul``, never ``jnp.matmul``;
see :func:`lint_plugin.aliases.canonical` for the few re-exported paths folded into one spelling).
How operations on arrays propagate (``.shape`` is static, ``jnp.*`` returns arrays, ...) is in
:mod:`lint_plugin.array_api`.
"""

from __future__ import annotations

from typing import Dict, FrozenSet, NamedTuple, Optional, Tuple

__all__ = [
    "CALLBACK_FUNCS",
    "CALLBACK_PREFIXES",
    "CONV_FUNCS",
    "CUSTOM_RULES",
    "DEBUG_FUNCS",
    "ENUM_BASES",
    "EQUINOX",
    "EQUINOX_FIELD",
    "EQUINOX_STATIC_FIELD",
    "HOST_CALLABLE_KEYWORDS",
    "INT8IFY",
    "LINEN",
    "LINEN_COMPACT",
    "MATMUL_FUNCS",
    "METADATA_ARGS",
    "MODULE_BASES",
    "NNX",
    "NNX_VARIABLES",
    "PARTIAL",
    "SHARDING_TYPES",
    "TRANSFORMS",
    "MetadataArgs",
    "TransformSig",
    "host_callable_keyword",
    "is_int8ify",
    "short_name",
]


class TransformSig(NamedTuple):
    """Where a function transform takes its function arguments, and how it traces them.

    ``fun_pos``: positional indices of function arguments; ``fun_kw``: their keyword names;
    ``list_pos``: index of a list/tuple of functions (``lax.switch``); ``params``: which
    parameters of the wrapped function become tracers: ``"all"`` (jit, vmap, lax bodies),
    ``"argnums"`` (grad: only the differentiated ones, default 0), ``"first"`` (equinox's filter
    gradients), ``"trailing"`` (a custom derivative rule, ``bwd(*nondiff, res, g)`` or
    ``jvp(*nondiff, primals, tangents)``: only the last two positional parameters; the ones before are the
    primal's ``nondiff_argnums``, Python values), ``"bound_module"`` (``flax.linen.apply(fn, module)`` and its
    ``init`` kin: ``fn`` runs like a method of the module, which it receives bound as its first parameter, neither
    traced nor static; the others are traced); ``in_specs_pos``: positional index of ``shard_map``'s
    ``in_specs``, whose ``None`` entries pass Python values through; ``int8ify``: the transform is this
    project's ``int8ify``; ``rule_method``: the method of the wrapped function that registers the functions
    of its derivative rules (``f.defvjp``), traced too (see :data:`CUSTOM_RULES`); ``derivative``: the function
    computes derivatives (``bwd``, a ``jvp`` rule), whose matmuls ``int8ify`` keeps float by design, so its
    float matmuls are not reported (JX101); ``python_values``: the transform passes Python values through as they
    are (equinox's filter transforms keep non-array leaves static; ``flax.linen.apply`` calls ``fn`` as it is), so
    the bare truth value of an unannotated parameter is taken to be a Python flag (``if training:``), as in a
    module's method.
    """

    fun_pos: Tuple[int, ...] = (0,)
    fun_kw: Tuple[str, ...] = ("fun", "f")
    list_pos: Optional[int] = None
    params: str = "all"
    in_specs_pos: Optional[int] = None
    int8ify: bool = False
    rule_method: Optional[str] = None
    derivative: bool = False
    python_values: bool = False


_ALL = TransformSig()
_FILTERED = TransformSig(python_values=True)
_FILTERED_GRAD = TransformSig(params="first", python_values=True)
_GRAD = TransformSig(params="argnums")
# ``flax.linen.apply(fn, module)(variables, *args)`` (and ``init``/``init_with_output``) calls ``fn(bound_module,
# *args)``: not a transform itself, but ``fn`` is traced code as a module's method is
_LINEN_BOUND_FN = TransformSig(fun_kw=("fn",), params="bound_module", python_values=True)
_SHARD_MAP = TransformSig(fun_kw=("f",), in_specs_pos=2)
_SCAN = TransformSig(fun_kw=("f",))
_COND = TransformSig(fun_pos=(1, 2), fun_kw=("true_fun", "false_fun"))
_WHILE = TransformSig(fun_pos=(0, 1), fun_kw=("cond_fun", "body_fun"))
_FORI = TransformSig(fun_pos=(2,), fun_kw=("body_fun",))
_SWITCH = TransformSig(fun_pos=(), fun_kw=(), list_pos=1)
# ``@pl.when(cond)`` only ever decorates: it takes no function argument in its call.
_DECORATOR_FACTORY = TransformSig(fun_pos=(), fun_kw=())

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
    # the primal of a custom derivative (its ``nondiff_argnums``/``nondiff_argnames`` are Python values)
    "jax.custom_vjp": TransformSig(fun_kw=("fun",), rule_method="defvjp"),
    "jax.custom_jvp": TransformSig(fun_kw=("fun",), rule_method="defjvp"),
    "jax.experimental.shard_map.shard_map": _SHARD_MAP,
    "jax.shard_map": _SHARD_MAP,
    "jax.lax.scan": _SCAN,
    "jax.lax.map": _SCAN,
    "jax.lax.associative_scan": TransformSig(fun_kw=("fn",)),
    "jax.lax.cond": _COND,
    "jax.lax.while_loop": _WHILE,
    "jax.lax.fori_loop": _FORI,
    "jax.lax.switch": _SWITCH,
    "equinox.filter_jit": _FILTERED,
    "equinox.filter_vmap": _FILTERED,
    "equinox.filter_pmap": _FILTERED,
    "equinox.filter_grad": _FILTERED_GRAD,
    "equinox.filter_value_and_grad": _FILTERED_GRAD,
    "equinox.filter_checkpoint": _FILTERED,
    "flax.linen.jit": _ALL,
    "flax.linen.apply": _LINEN_BOUND_FN,
    "flax.linen.init": _LINEN_BOUND_FN,
    "flax.linen.init_with_output": _LINEN_BOUND_FN,
    "flax.nnx.jit": _ALL,
    "flax.nnx.pmap": _ALL,
    "flax.nnx.vmap": _ALL,
    "flax.nnx.grad": _GRAD,
    "flax.nnx.value_and_grad": _GRAD,
    "flax.nnx.remat": _ALL,
    "flax.nnx.checkpoint": _ALL,
    "flax.nnx.scan": _SCAN,
    "flax.nnx.shard_map": _SHARD_MAP,
    "flax.nnx.cond": _COND,
    "flax.nnx.while_loop": _WHILE,
    "flax.nnx.fori_loop": _FORI,
    "flax.nnx.switch": _SWITCH,
    "jax.experimental.pallas.pallas_call": TransformSig(fun_kw=("kernel",)),
    "jax.experimental.pallas.when": _DECORATOR_FACTORY,
}

# The functions ``f.defvjp(fwd, bwd)`` and ``f.defjvp(jvp)`` (also ``@f.defjvp``) register as the derivative
# rules of a ``jax.custom_vjp``/``jax.custom_jvp`` function ``f``: they run on traced values. ``fwd`` takes the
# primal's parameters (``params="all"``: its ``nondiff_argnums`` stay Python values); ``bwd(*nondiff, res, g)``
# and ``jvp(*nondiff, primals, tangents)`` take the ``nondiff_argnums`` values first (``params="trailing"``) and
# compute derivatives: int8ify rewrites the primal and ``fwd`` (the forward pass) and keeps the matmuls of
# ``bwd`` and ``jvp`` float.
CUSTOM_RULES: Dict[str, Tuple[TransformSig, ...]] = {
    "defvjp": (TransformSig(fun_kw=("fwd",)),
               TransformSig(fun_pos=(1,), fun_kw=("bwd",), params="trailing", derivative=True)),
    "defjvp": (TransformSig(fun_kw=("jvp",), params="trailing", derivative=True),),
}

# ``@int8ify`` traces like ``jax.jit`` and rewrites every matmul in the function (JX101 is off there).
INT8IFY = TransformSig(int8ify=True)

PARTIAL = "functools.partial"


def is_int8ify(qualname: Optional[str], raw: Optional[str]) -> bool:
    """``int8ify`` from this project, however it was imported."""
    for name in (qualname, raw):
        if name and (name == "int8ify" or name.endswith(".int8ify")):
            return True
    return False


# The module systems whose methods run as traced code. ``self`` of such a module has attributes
# whose kinds the discovery reads from the class (see :mod:`lint_plugin.module_classes`).
LINEN = "linen"
NNX = "nnx"
EQUINOX = "equinox"

MODULE_BASES: Dict[str, str] = {
    "flax.linen.Module": LINEN,
    "flax.nnx.Module": NNX,
    "equinox.Module": EQUINOX,
}
LINEN_COMPACT = "flax.linen.compact"
NNX_VARIABLES: FrozenSet[str] = frozenset(
    "flax.nnx." + n for n in ("Param", "Variable", "BatchStat", "Cache", "Intermediate", "Perturbation")
)
EQUINOX_FIELD = "equinox.field"
EQUINOX_STATIC_FIELD = "equinox.static_field"

ENUM_BASES: FrozenSet[str] = frozenset(
    "enum." + n for n in ("Enum", "IntEnum", "StrEnum", "Flag", "IntFlag")
)

_JNP = "jax.numpy."
# Contractions. Not ``jnp.outer``: it sums nothing and traces to the broadcast multiply the int8 contract
# asks for (``sx[:, None] * sw[None, :]``); an einsum or ``tensordot`` counts only when it sums a shared index.
MATMUL_FUNCS: FrozenSet[str] = frozenset(
    [_JNP + n for n in ("matmul", "dot", "einsum", "tensordot", "inner", "vdot", "vecdot", "matvec", "vecmat")]
    + ["jax.numpy.linalg." + n for n in ("matmul", "vecdot", "tensordot", "multi_dot")]
    + ["jax.lax." + n for n in ("dot", "dot_general", "batch_matmul", "ragged_dot", "ragged_dot_general")]
    + ["jax.nn.dot_product_attention"]
    + ["jax.experimental.pallas.dot", "operator.matmul"]
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
})
CALLBACK_PREFIXES: Tuple[str, ...] = ("jax.experimental.host_callback.",)

# The keyword of each callback's first parameter when that parameter is the Python function run on
# the host (``host_callback.id_print`` takes a value there instead, so it is absent).
HOST_CALLABLE_KEYWORDS: Dict[str, str] = {
    **{name: "callback" for name in CALLBACK_FUNCS},
    "jax.debug.callback": "callback",
    "jax.experimental.host_callback.id_tap": "tap_func",
    "jax.experimental.host_callback.call": "callback_func",
}


def host_callable_keyword(qualname: Optional[str]) -> Optional[str]:
    """For a callback API, the keyword of its host-function parameter (always positional 0)."""
    return HOST_CALLABLE_KEYWORDS.get(qualname) if qualname is not None else None


# host callbacks for debugging (JX302), as jaxpr_rewrite.verify tells them from the others (JX301)
DEBUG_FUNCS: FrozenSet[str] = frozenset({"jax.debug.print", "jax.debug.breakpoint", "jax.debug.callback"})


class MetadataArgs(NamedTuple):
    """The arguments of a JAX function that are Python metadata (mesh-axis names, shardings), never
    tracers: positional indices (``all_positional``: every one) and keywords."""

    positions: Tuple[int, ...] = ()
    keywords: Tuple[str, ...] = ()
    all_positional: bool = False


_AXIS_NAME_SECOND = MetadataArgs((1,), ("axis_name",))
_SHARDING_SECOND = MetadataArgs((1,), ("shardings", "out_shardings", "device"))

# A parameter passed to one of these as such an argument is a Python value in the function.
METADATA_ARGS: Dict[str, MetadataArgs] = {
    **{"jax.lax." + n: _AXIS_NAME_SECOND for n in (
        "psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute", "pshuffle", "all_to_all",
        "pbroadcast", "pswapaxes",
    )},
    "jax.lax.axis_index": MetadataArgs((0,), ("axis_name",)),
    "jax.lax.axis_size": MetadataArgs((0,), ("axis_name",)),
    "jax.lax.with_sharding_constraint": _SHARDING_SECOND,
    "jax.device_put": _SHARDING_SECOND,
    "jax.sharding.reshard": _SHARDING_SECOND,
    "jax.sharding.NamedSharding": MetadataArgs((0, 1), ("mesh", "spec")),
    "jax.sharding.PartitionSpec": MetadataArgs(all_positional=True),
    "jax.P": MetadataArgs(all_positional=True),
}

# Sharding classes: a parameter annotated with one holds Python metadata.
SHARDING_TYPES: FrozenSet[str] = frozenset(
    ["jax.sharding." + n for n in ("PartitionSpec", "NamedSharding", "Sharding", "Mesh", "AbstractMesh",
                                   "PositionalSharding", "SingleDeviceSharding")]
    + ["jax.P"]
)


def short_name(qualname: str) -> str:
    """How messages spell a qualified name: ``jnp.matmul``, ``lax.dot``."""
    for prefix, short in (("jax.numpy.", "jnp."), ("jax.lax.", "lax."), ("jax.experimental.pallas.", "pl.")):
        if qualname.startswith(prefix):
            return short + qualname[len(prefix):]
    return qualname
