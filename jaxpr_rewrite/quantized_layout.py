"""How a :class:`~jaxpr_rewrite.quantized.QuantizedArray` is laid out when taken apart: its named children
(:data:`ARRAY_FIELDS`) and metadata (:data:`METADATA_FIELDS`), at :data:`LAYOUT_VERSION`. The pytree flattening,
``jax.export``'s serialization and :mod:`jaxpr_rewrite.stored` (checkpoints, SafeTensors) all read these tables."""

from __future__ import annotations

import json
from typing import Mapping

import jax
import jax.numpy as jnp

from .errors import Int8ifyError
from .int4 import INT4_MAX
from .quantize import INT8_MAX

__all__ = ["ARRAY_FIELDS", "CODE_LIMITS", "FIELD_AXES", "LAYOUT_VERSION", "METADATA_FIELDS", "OPTIONAL_ARRAY_FIELDS",
           "READABLE_LAYOUT_VERSIONS", "read_metadata", "readable_versions", "register_export"]

# The version of the layout below (children and metadata), stored with every serialized QuantizedArray: a reader
# refuses a version it does not know instead of misreading it.
LAYOUT_VERSION = 2
# The versions this int8ify reads: each one's children are the first of ARRAY_FIELDS (version 1 had no
# smooth_inverse), and a missing optional child reads as None.
READABLE_LAYOUT_VERSIONS = (1, 2)
# The array children, in flatten order (a new optional child is appended here and to OPTIONAL_ARRAY_FIELDS).
ARRAY_FIELDS = ("codes", "scales", "exponents", "smooth", "epilogue_factor", "epilogue_power", "activation_scale",
                "smooth_inverse")
# The children that may be None (absent).
OPTIONAL_ARRAY_FIELDS = frozenset({"smooth", "epilogue_factor", "epilogue_power", "activation_scale", "smooth_inverse"})
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
}
# The code range of each supported width.
CODE_LIMITS = {8: INT8_MAX, 4: INT4_MAX}


def read_metadata(metadata: Mapping, where: str) -> tuple:
    """The pytree aux data from :meth:`QuantizedArray.metadata`'s JSON values, or an error naming ``where``."""
    version = metadata.get("layout_version")
    if version not in READABLE_LAYOUT_VERSIONS:
        raise Int8ifyError(f"{where} is stored in QuantizedArray layout version {version!r}; this int8ify reads "
                           f"{readable_versions()} (write it again with this int8ify, or quantize the float "
                           "params again)")
    missing = [name for name in METADATA_FIELDS if name not in metadata]
    if missing:
        raise Int8ifyError(f"{where} is malformed: metadata missing {missing}")
    return tuple(read(metadata[name]) for name, (_, read) in METADATA_FIELDS.items())


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
