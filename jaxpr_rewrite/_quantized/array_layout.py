"""How a :class:`~jaxpr_rewrite.quantized.QuantizedArray` is laid out when taken apart: its named children
(:data:`ARRAY_FIELDS`) and metadata (:data:`METADATA_FIELDS`), at :data:`LAYOUT_VERSION`, and what must hold
between its children (:func:`layout_problems`). The pytree flattening, ``jax.export``'s serialization and
:mod:`jaxpr_rewrite._quantized.stored` (checkpoints, SafeTensors) all read these tables."""

from __future__ import annotations

import json
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .._core.errors import Int8ifyError
from .._numerics.int4 import INT4_MAX, packed_length
from .._numerics.quantize import INT8_MAX
from .._numerics.static_scales import StaticScale

__all__ = ["ARRAY_FIELDS", "CODE_LIMITS", "FIELD_AXES", "LAYOUT_VERSION", "METADATA_FIELDS", "OPTIONAL_ARRAY_FIELDS",
           "READABLE_LAYOUT_VERSIONS", "layout_problems", "metadata_problems", "read_metadata", "readable_versions",
           "register_export"]

# The version of the layout below (children and metadata), stored with every serialized QuantizedArray: a reader
# refuses a version it does not know instead of misreading it.
LAYOUT_VERSION = 3
# The versions this int8ify reads: each one's children are the first of ARRAY_FIELDS (version 1 had no
# smooth_inverse, version 2 no value) and its metadata the first of METADATA_FIELDS (versions 1 and 2 had no
# cache); a missing optional child reads as None, missing metadata as METADATA_DEFAULTS.
READABLE_LAYOUT_VERSIONS = (1, 2, 3)
# The array children, in flatten order (a new optional child is appended here and to OPTIONAL_ARRAY_FIELDS).
ARRAY_FIELDS = ("codes", "scales", "exponents", "smooth", "epilogue_factor", "epilogue_power", "activation_scale",
                "smooth_inverse", "value")
# The children that may be None (absent).
OPTIONAL_ARRAY_FIELDS = frozenset({"smooth", "epilogue_factor", "epilogue_power", "activation_scale", "smooth_inverse",
                                   "value"})
# The length of a stored static activation scale (StaticScale.stored: one vector of its fields).
STATIC_SCALE_LENGTH = len(StaticScale._fields)
# Which axes of the array each child's axes run over (None: an axis of its own, the block index of block-scaled
# scales), so it can be sharded like the float array it stands for; a child not listed is replicated.
FIELD_AXES = {
    "codes": lambda array: tuple(range(array.ndim)),
    "scales": lambda array: array.scale_axes,
    "exponents": lambda array: array.scale_axes,
    "smooth": lambda array: array.contracting,
    "smooth_inverse": lambda array: array.contracting,
    "epilogue_factor": lambda array: array.scale_axes,
    "epilogue_power": lambda array: array.scale_axes,
    "value": lambda array: tuple(range(array.ndim)),
}
# The metadata (pytree aux data), in order, each with how it is written as JSON and read back.
METADATA_FIELDS = {
    "from_end": (list, lambda value: tuple(int(a) for a in value)),
    "dtype": (lambda dtype: dtype.name, jnp.dtype),
    "smooth_group": (lambda group: group, lambda group: group),
    "bits": (int, int),
    "length": (lambda length: length, lambda length: length),
    "block_size": (lambda block: block, lambda block: block),
    "activation_group": (lambda group: group, lambda group: group),
    "cache": (bool, bool),
}
# The metadata a layout written before it existed lacks, and what it reads as there.
METADATA_DEFAULTS = {"cache": False}
# The code range of each supported width.
CODE_LIMITS = {8: INT8_MAX, 4: INT4_MAX}


def read_metadata(metadata: Mapping, where: str) -> tuple:
    """The pytree aux data from :meth:`QuantizedArray.metadata`'s JSON values, or an error naming ``where``."""
    version = metadata.get("layout_version")
    if version not in READABLE_LAYOUT_VERSIONS:
        raise Int8ifyError(f"{where} is stored in QuantizedArray layout version {version!r}; this int8ify reads "
                           f"{readable_versions()} (write it again with this int8ify, or quantize the float "
                           "params again)")
    missing = [name for name in METADATA_FIELDS if name not in metadata and name not in METADATA_DEFAULTS]
    if missing:
        raise Int8ifyError(f"{where} is malformed: metadata missing {missing}")
    try:
        return tuple(read(metadata.get(name, METADATA_DEFAULTS.get(name)))
                     for name, (_, read) in METADATA_FIELDS.items())
    except (TypeError, ValueError) as e:
        raise Int8ifyError(f"{where} is malformed: its metadata {dict(metadata)!r:.200} does not read back "
                           f"({e})") from None


def readable_versions() -> str:
    """The layout versions this int8ify reads, for error messages."""
    *older, newest = READABLE_LAYOUT_VERSIONS
    return f"versions {', '.join(map(str, older))} and {newest}" if older else f"version {newest}"


def register_export(cls) -> None:
    """Register ``cls`` (:class:`~jaxpr_rewrite.quantized.QuantizedArray`) for ``jax.export``'s serialization of an
    exported function's argument and result structure, its metadata written as JSON: an exported program taking
    quantized params deserializes in another process once ``jaxpr_rewrite`` is imported."""

    def serialize(aux: tuple) -> bytes:
        return json.dumps(cls.tree_unflatten(aux, [None] * len(ARRAY_FIELDS)).metadata()).encode()

    def deserialize(data: bytes) -> tuple:
        return read_metadata(json.loads(data), "a QuantizedArray of an exported program")

    jax.export.register_pytree_node_serialization(cls, serialized_name="int8ify.QuantizedArray",
                                                  serialize_auxdata=serialize, deserialize_auxdata=deserialize)


def _not_an_array(name: str, value) -> str | None:
    """The problem with a child that is not an array (nor a tracer or ShapeDtypeStruct): what it is instead."""
    if value is None:
        return f"{name} is missing (None)"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return None
    shown = repr(value)
    shown = f" ({shown})" if len(shown) <= 40 else ""
    return f"{name} is a {type(value).__name__}{shown}, not an array (build children with jnp.asarray)"


# How a child per weight may be stacked: the weights a lax.scan slices (a tree_map of jnp.stack over
# QuantizedArrays) carry the codes' leading axes on every child.
STACKED = ", after any leading axes the codes are stacked along"


def _stacked(shape: tuple, trailing: tuple, array) -> bool:
    """Whether ``shape`` is ``trailing`` after leading axes of the codes that precede the contracting ones."""
    lead = len(shape) - len(trailing)
    return (0 <= lead <= min(array.contracting, default=array.ndim) and shape[lead:] == trailing
            and shape[:lead] == array.shape[:lead])


def metadata_problems(array) -> list[str]:
    """What is wrong with the static fields (a QuantizedArray built with ``replace``), given its codes' rank."""
    problems = []
    ndim = len(array.codes.shape)
    from_end = array.from_end
    if not (isinstance(from_end, tuple) and all(_is_int(-a, 1) and -a <= ndim for a in from_end)
            and len(set(from_end)) == len(from_end)):
        problems.append(f"from_end is {from_end!r}, not distinct contracting axes counted from the end (each in "
                        f"-{ndim}..-1 for {ndim}-d codes)")
    if not (isinstance(array.dtype, np.dtype) and jnp.issubdtype(array.dtype, jnp.floating)):
        problems.append(f"dtype is {getattr(array.dtype, 'name', repr(array.dtype))}, not a float dtype (the dtype "
                        "of the float array it stands for)")
    if array.bits not in CODE_LIMITS:
        problems.append(f"bits is {array.bits!r}, not one of {sorted(CODE_LIMITS)}")
    elif (array.bits == 4) != (array.length is not None):
        problems.append(f"length is {array.length!r} for {array.bits}-bit codes (the unpacked last axis' length "
                        "of 4-bit codes; None for 8-bit ones)")
    elif array.length is not None and not _is_int(array.length, 0):
        problems.append(f"length is {array.length!r}, not a non-negative int")
    if array.block_size is not None and not _is_int(array.block_size, 1):
        problems.append(f"block_size is {array.block_size!r}, not a positive int (or None)")
    if not isinstance(array.cache, bool):
        problems.append(f"cache is {array.cache!r}, not True or False")
    return problems


def _is_int(value, least: int) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= least


def layout_problems(array) -> list[str]:
    """What does not fit together among a :class:`~jaxpr_rewrite.quantized.QuantizedArray`'s codes, scales,
    exponents and optional arrays, one sentence each (none for a well-formed array). It reads only the arrays'
    shapes and dtypes and the static fields: arrays of one pytree structure and leaf types have the same problems."""
    not_arrays = [_not_an_array(name, getattr(array, name)) for name in ARRAY_FIELDS
                  if getattr(array, name) is not None or name not in OPTIONAL_ARRAY_FIELDS]
    problems = [problem for problem in not_arrays if problem]
    problems = problems or metadata_problems(array)
    if problems:  # what follows reads the children's shapes and dtypes, and the shapes the metadata gives
        return problems
    kept_shape = array.scales_shape
    codes_dtype = np.dtype(np.int8 if array.bits == 8 else np.uint8)
    if np.dtype(array.codes.dtype) != codes_dtype:
        problems.append(f"codes are {np.dtype(array.codes.dtype).name}, not {codes_dtype.name} for "
                        f"{array.bits}-bit codes")
    elif array.bits == 4 and (array.length is None or array.codes.shape[-1] != packed_length(array.length)):
        problems.append(f"packed codes have shape {tuple(array.codes.shape)}, which cannot hold a last axis of "
                        f"length {array.length}")
    if tuple(array.scales.shape) != kept_shape:
        blocks = f", in blocks of {array.block_size}" if array.block_size is not None else ""
        problems.append(f"scales have shape {tuple(array.scales.shape)}, expected {kept_shape} (the codes "
                        f"{array.shape} without contracting axes {array.contracting}{blocks})")
    if tuple(array.exponents.shape) != tuple(array.scales.shape):
        problems.append(f"exponents have shape {tuple(array.exponents.shape)}, expected {tuple(array.scales.shape)}")
    if (array.epilogue_factor is None) != (array.epilogue_power is None):
        problems.append("epilogue_factor and epilogue_power are set together (both or neither)")
    for name in ("epilogue_factor", "epilogue_power"):
        factor = getattr(array, name)
        if factor is not None and tuple(factor.shape) != tuple(array.scales.shape):
            problems.append(f"{name} has shape {tuple(factor.shape)}, expected {tuple(array.scales.shape)}")
    if np.dtype(array.exponents.dtype) != np.int32:
        problems.append(f"exponents are {np.dtype(array.exponents.dtype).name}, not int32")
    inverse_shape, smooth_shape = (tuple(getattr(v, "shape", ())) for v in (array.smooth_inverse, array.smooth))
    contraction_shape = tuple(array.shape[a] for a in array.contracting)
    if array.smooth is not None and (len(contraction_shape) != 1
                                     or not _stacked(smooth_shape, contraction_shape, array)):
        problems.append(f"smooth factors have shape {smooth_shape}, expected {contraction_shape}: one per index "
                        f"of the single contracting axis{STACKED}")
    scale_shape = tuple(getattr(array.activation_scale, "shape", ()))  # () when absent
    if array.activation_scale is not None and not _stacked(scale_shape, (STATIC_SCALE_LENGTH,), array):
        problems.append(f"activation_scale has shape {scale_shape}, expected ({STATIC_SCALE_LENGTH},): a "
                        f"StaticScale stored as one vector{STACKED}")
    if array.value is not None and (tuple(array.value.shape) != array.shape
                                    or not jnp.issubdtype(array.value.dtype, jnp.floating)):
        problems.append(f"value is {np.dtype(array.value.dtype).name}{list(array.value.shape)}, not the float array "
                        f"of shape {list(array.shape)} the codes stand for")
    if array.smooth_inverse is not None and (array.smooth is None or inverse_shape != smooth_shape):
        problems.append("smooth_inverse is set without smooth factors" if array.smooth is None else
                        f"smooth_inverse has shape {inverse_shape}, expected the smooth factors' {smooth_shape}")
    floats = (("scales", array.scales), ("smooth factors", array.smooth), ("smooth_inverse", array.smooth_inverse),
              ("epilogue_factor", array.epilogue_factor), ("epilogue_power", array.epilogue_power),
              ("activation_scale", array.activation_scale))
    cast = [f"{name} are {np.dtype(value.dtype).name}, not float32/float64" for name, value in floats
            if value is not None and np.dtype(value.dtype).name not in ("float32", "float64")]
    if cast:
        # the usual mixed-precision tree_map(lambda a: a.astype(bfloat16), params) reaches into the scales
        problems.append(
            f"{'; '.join(cast)} (a tree_map cast reached into it: cast whole QuantizedArrays instead, with "
            "jax.tree_util.tree_map(fn, params, is_leaf=jaxpr_rewrite.quantized.is_quantized) and "
            "QuantizedArray.astype, which keeps codes and scales)")
    return problems
