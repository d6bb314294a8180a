"""A portable file: a quantized pytree as one SafeTensors file, read back without the float params.

:func:`save_safetensors` writes :mod:`jaxpr_rewrite._quantized.stored`'s named tensors (int8 or packed int4 codes,
scales, exponents, SmoothQuant factors, and the leaves left float) as the file's tensors and the layout document as the
JSON string ``int8ify.layout`` of its metadata; :func:`load_safetensors` rebuilds the pytree from the file alone (or
onto a target pytree, taking its structure and shardings). docs/deploy.md describes the layout for other tools. Needs
the ``deploy`` extra (``pip install 'int8ify[deploy]'``), which brings ``safetensors``.
"""

from __future__ import annotations

import json
import os
import struct

import jax
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from .._core.errors import Int8ifyError
from .._quantized.stored import abstract_tensors, check_layout, leaf_of_tensor, rebuild, to_stored

__all__ = ["LAYOUT_KEY", "load_safetensors", "save_safetensors"]

# The metadata entry holding the layout document.
LAYOUT_KEY = "int8ify.layout"
# The name SafeTensors' header gives its metadata, which no tensor may have.
RESERVED_NAME = "__metadata__"
# The dtypes SafeTensors stores (safetensors 0.4-0.8), and those among them its numpy reader has no numpy dtype for
# (numpy lacks the float8 types): read from the file's bytes instead, as their ml_dtypes type.
STORED_DTYPES = frozenset({"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
                           "float32", "float64", "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                           "float8_e5m2fnuz", "float8_e8m0fnu", "complex64"})
READ_AS_BYTES = frozenset(name for name in STORED_DTYPES if name.startswith("float8"))


def save_safetensors(path, tree) -> None:
    """Write a pytree of arrays and ``QuantizedArray`` leaves to one SafeTensors file.

    Arguments:
        path: the file to write.
        tree: the pytree (``quantize_params``'s output, say); arrays are gathered to the host.
    """
    tensors, layout = to_stored(tree)
    for name, value in tensors.items():
        if name == RESERVED_NAME or np.dtype(value.dtype).name not in STORED_DTYPES:
            why = (f"its tensor would be named {RESERVED_NAME!r}, the name SafeTensors' header gives its metadata "
                   "(rename that key)" if name == RESERVED_NAME else
                   f"it is {np.dtype(value.dtype).name}, a dtype SafeTensors does not store (it stores "
                   f"{', '.join(sorted(STORED_DTYPES))})")
            raise Int8ifyError(f"cannot save {leaf_of_tensor(layout, name)} to {os.fspath(path)}: {why}; "
                               "save_quantized (Orbax) stores it")
    # SafeTensors writes each array's buffer from its data pointer: a strided one (a view, or the column-major host
    # copy np.asarray gives of a TPU array with a short last axis) must be made dense first, or the file holds the
    # array in its memory order (np.require keeps a 0-d array 0-d, where np.ascontiguousarray makes it 1-d)
    save_file({name: np.require(np.asarray(value), requirements="C") for name, value in tensors.items()},
              os.fspath(path), metadata={LAYOUT_KEY: json.dumps(layout)})


def load_safetensors(path, target=None):
    """Read a file written by :func:`save_safetensors`.

    Arguments:
        path: the file.
        target: ``None``, or a pytree like the saved one (arrays, ``jax.ShapeDtypeStruct`` or ``QuantizedArray``
            leaves): the result then has its structure, and each array its sharding. Without one, the result is
            nested dicts and lists of arrays on the default device.

    Returns:
        The pytree, bit-identical to the one saved.

    Raises:
        Int8ifyError: a file that is not one, is truncated (naming the first leaf cut off), of another layout
            version, or does not fit the target (naming the leaf).
    """
    path = os.fspath(path)
    try:
        handle = safe_open(path, framework="numpy")
    except (SafetensorError, OSError) as e:
        raise Int8ifyError(f"{path} cannot be read as SafeTensors: {_diagnose(path, e)}") from None
    with handle as file:
        metadata = file.metadata() or {}
        if LAYOUT_KEY not in metadata:
            raise Int8ifyError(f"{path} has no '{LAYOUT_KEY}' metadata: it was not written by save_safetensors")
        try:
            layout = json.loads(metadata[LAYOUT_KEY])
        except ValueError as e:
            raise Int8ifyError(f"{path}: its '{LAYOUT_KEY}' metadata, the layout document, is not valid JSON "
                               f"({e})") from None
        check_layout(layout, path)
        abstract = abstract_tensors(layout, target)
        tensors = {}
        for name, want in abstract.items():
            value = _read_bytes(path, name, want) if want.dtype.name in READ_AS_BYTES else file.get_tensor(name)
            if value.shape != want.shape or value.dtype != want.dtype:
                raise Int8ifyError(f"{path}: {leaf_of_tensor(layout, name)} has tensor {name} of "
                                   f"{value.dtype}{list(value.shape)}, but its layout says {want.dtype}"
                                   f"{list(want.shape)}")
            tensors[name] = jax.device_put(value, want.sharding)
    return rebuild(layout, tensors, target)


def _read_bytes(path: str, name: str, want) -> np.ndarray:
    """Tensor ``name`` of the file read from its bytes as ``want``'s dtype (one SafeTensors' numpy reader has no numpy
    dtype for), after checking the header stores it with that dtype and shape."""
    with open(path, "rb") as file:
        (header_length,) = struct.unpack("<Q", file.read(8))
        entry = json.loads(file.read(header_length))[name]
    begin, end = entry["data_offsets"]
    if entry["shape"] != list(want.shape) or end - begin != want.dtype.itemsize * int(np.prod(want.shape)):
        raise Int8ifyError(f"{path}: tensor {name} is {entry['dtype']}{entry['shape']} in the file, but its layout "
                           f"says {want.dtype}{list(want.shape)}")
    data = np.fromfile(path, dtype=np.uint8, count=end - begin, offset=8 + header_length + begin)
    return data.view(want.dtype).reshape(want.shape)


def _diagnose(path: str, error: Exception) -> str:
    """Why a file does not open: the first leaf whose bytes are cut off, from the SafeTensors header (8 bytes of
    little-endian header length, then the JSON header of ``name -> dtype, shape, data_offsets``)."""
    size = os.path.getsize(path) if os.path.exists(path) else 0
    with open(path, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            return f"the file is {size} bytes, too short for a header ({error})"
        (header_length,) = struct.unpack("<Q", head)
        header_bytes = file.read(header_length)
    if len(header_bytes) < header_length:
        return f"the file is truncated inside its header ({size} bytes; {error})"
    try:
        header = json.loads(header_bytes)
        layout = json.loads(header.get("__metadata__", {}).get(LAYOUT_KEY, "null"))
    except ValueError:
        return f"its header is not valid JSON ({error})"
    data_start = 8 + header_length
    cut = sorted((entry["data_offsets"][1], name) for name, entry in header.items()
                 if name != "__metadata__" and data_start + entry["data_offsets"][1] > size)
    if not cut:
        return str(error)
    first = cut[0][1]
    whose = leaf_of_tensor(layout, first) if isinstance(layout, dict) and "leaves" in layout else f"tensor {first}"
    return (f"the file is truncated: {whose} (tensor {first}) ends at byte {data_start + cut[0][0]}, the file has "
            f"{size}")
