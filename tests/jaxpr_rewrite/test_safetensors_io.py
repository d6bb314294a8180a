"""A quantized pytree as one SafeTensors file: read back from the file alone (no float params, a fresh process),
readable by another tool from the documented layout, and clear errors naming the leaf for a truncated file,
another layout version and a target that does not fit."""

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from helpers import (FRESH_PROCESS_DEVICE, assert_same_tree, column_major, deploy_model, reference_codes,
                     reference_scales, reference_unpack_int4, run_fresh_python)
from jaxpr_rewrite import Int8ifyError, QuantizedArray, int8ify, quantize_params
from jaxpr_rewrite._io.safetensors_io import LAYOUT_KEY, load_safetensors, save_safetensors


@pytest.fixture(scope="module", params=[8, 4], ids=["int8", "int4"])
def model(request):
    fn, params, x = deploy_model()
    return fn, params, x, quantize_params(fn, params, x, bits=request.param)


def test_round_trip_without_the_float_params(tmp_path, model):
    fn, params, x, qparams = model
    save_safetensors(tmp_path / "model.safetensors", qparams)
    restored = load_safetensors(tmp_path / "model.safetensors")
    assert_same_tree(restored, qparams)
    assert_same_tree(load_safetensors(tmp_path / "model.safetensors", jax.eval_shape(lambda p: p, qparams)), qparams)
    np.testing.assert_array_equal(jax.jit(int8ify(fn))(restored, x), jax.jit(int8ify(fn))(qparams, x))
    # no float weight in the file: the only float tensors are scales, their epilogue factors and the bias
    with safe_open(tmp_path / "model.safetensors", framework="numpy") as file:
        floats = {name for name in file.keys() if file.get_tensor(name).dtype.kind == "f"}
    assert floats == {"embed.b"} | {f"{leaf}.{part}" for leaf in ("embed.w", "layers.0.w", "layers.1.w", "head")
                                    for part in ("scales", "epilogue_factor", "epilogue_power")}
    float_bytes = sum(np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(params))
    ratio = (tmp_path / "model.safetensors").stat().st_size / float_bytes
    # codes, and per output channel its scale, exponent and two epilogue factors (16 bytes)
    assert ratio < (0.29 if qparams["head"].bits == 8 else 0.17), ratio


FRESH = """
import sys
import jax
import numpy as np
from jaxpr_rewrite import int8ify
from jaxpr_rewrite._io.safetensors_io import load_safetensors
sys.path.insert(0, sys.argv[3])
from helpers import deploy_fn

qparams = load_safetensors(sys.argv[1])
np.save(sys.argv[2], np.asarray(jax.jit(int8ify(deploy_fn))(qparams, np.load(sys.argv[2]))))
print(qparams["head"])
"""


def test_a_fresh_process_runs_the_model_from_the_file_alone(tmp_path, model):
    fn, _, x, qparams = model
    save_safetensors(tmp_path / "model.safetensors", qparams)
    np.save(tmp_path / "io.npy", x)
    printed = run_fresh_python(FRESH, tmp_path / "model.safetensors", tmp_path / "io.npy", Path(__file__).parent)
    assert printed.strip() == repr(qparams["head"])
    with jax.default_device(FRESH_PROCESS_DEVICE):
        expected = jax.jit(int8ify(fn))(jax.device_put(qparams, FRESH_PROCESS_DEVICE), x)
    np.testing.assert_array_equal(np.load(tmp_path / "io.npy"), expected)


def test_another_tool_reads_the_documented_layout(tmp_path, model):
    """With safetensors, json and numpy alone, as docs/deploy.md describes: 4-bit codes unpacked from their
    nibbles, each scale ``scales * 2**exponents`` over the kept axes; they are the contract's codes and scales of
    the float weight (an independent numpy reference)."""
    _, params, _, qparams = model
    save_safetensors(tmp_path / "model.safetensors", qparams)
    with safe_open(tmp_path / "model.safetensors", framework="numpy") as file:
        layout = json.loads(file.metadata()[LAYOUT_KEY])
        tensors = {name: file.get_tensor(name) for name in file.keys()}
    assert layout["format"] == "int8ify.quantized-pytree" and layout["layout_version"] == 3
    originals = {"embed.w": params["embed"]["w"], "layers.1.w": params["layers"][1]["w"], "head": params["head"]}
    found = []
    for leaf in layout["leaves"]:
        assert set(leaf) >= {"path", "kind", "tensors", "shape", "dtype"}
        name = ".".join(str(key) for _, key in leaf["path"])
        if leaf["kind"] != "quantized":
            np.testing.assert_array_equal(tensors[leaf["tensors"]["value"]], params["embed"]["b"])
            continue
        meta, names = leaf["metadata"], leaf["tensors"]
        codes = tensors[names["codes"]]
        if meta["bits"] == 4:
            assert codes.dtype == np.uint8 and codes.shape[-1] == -(-meta["length"] // 2)
            codes = reference_unpack_int4(codes, meta["length"])
        contracting = tuple(a + len(leaf["shape"]) for a in meta["from_end"])
        scale = tensors[names["scales"]].astype(np.float64) * np.exp2(tensors[names["exponents"]].astype(np.float64))
        limit = 127 if meta["bits"] == 8 else 7
        if name in originals:
            np.testing.assert_array_equal(codes, reference_codes(originals[name], contracting, limit))
            np.testing.assert_array_equal(scale, reference_scales(originals[name], contracting, limit))
        found.append(name)
    assert found == ["embed.w", "head", "layers.0.w", "layers.1.w"]


def test_a_truncated_file_names_the_first_leaf_cut_off(tmp_path, model):
    *_, qparams = model
    save_safetensors(tmp_path / "model.safetensors", qparams)
    data = (tmp_path / "model.safetensors").read_bytes()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    last = max((entry["data_offsets"][1], name) for name, entry in header.items() if name != "__metadata__")[1]
    leaf = last if last == "embed.b" else last.rsplit(".", 1)[0]
    key = "".join(f"[{k}]" if k.isdigit() else f"['{k}']" for k in leaf.split("."))
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    with pytest.raises(Int8ifyError, match=rf"truncated: leaf {re.escape(key)} \(tensor {re.escape(last)}\)"):
        load_safetensors(tmp_path / "cut.safetensors")
    (tmp_path / "header.safetensors").write_bytes(data[:20])
    with pytest.raises(Int8ifyError, match="truncated inside its header"):
        load_safetensors(tmp_path / "header.safetensors")


def test_another_layout_version_is_refused_naming_the_leaf(tmp_path, model):
    *_, qparams = model
    save_safetensors(tmp_path / "model.safetensors", qparams)
    with safe_open(tmp_path / "model.safetensors", framework="numpy") as file:
        layout = json.loads(file.metadata()[LAYOUT_KEY])
        tensors = {name: file.get_tensor(name) for name in file.keys()}
    layout["layout_version"] = 4
    save_file(tensors, tmp_path / "v4.safetensors", metadata={LAYOUT_KEY: json.dumps(layout)})
    with pytest.raises(Int8ifyError,
                       match=r"layout version 4 \(first leaf \['embed'\]\['b'\]\).*reads versions 1, 2 and 3"):
        load_safetensors(tmp_path / "v4.safetensors")
    # a leaf whose own metadata is of another version (the document says 3) is named too
    layout["layout_version"] = 3
    layout["leaves"][-1]["metadata"]["layout_version"] = 4
    save_file(tensors, tmp_path / "leaf.safetensors", metadata={LAYOUT_KEY: json.dumps(layout)})
    with pytest.raises(Int8ifyError, match=r"leaf \['layers'\]\[1\]\['w'\] is stored in QuantizedArray layout "
                                           "version 4"):
        load_safetensors(tmp_path / "leaf.safetensors")
    save_file(tensors, tmp_path / "plain.safetensors")
    with pytest.raises(Int8ifyError, match="not written by save_safetensors"):
        load_safetensors(tmp_path / "plain.safetensors")


def test_a_version_1_file_reads_its_smoothed_weights(tmp_path):
    """Layout version 1 had no ``smooth_inverse``: its smoothed weights load without it and the program computes
    the reciprocal itself, to the same bits."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    x[:, 3] *= 30
    params = {"w": (rng.standard_normal((64, 16)) / 8).astype(np.float32)}
    fn = lambda p, x: x @ p["w"]  # noqa: E731
    qparams = quantize_params(fn, params, x, smooth_alpha=0.5)
    save_safetensors(tmp_path / "v2.safetensors", qparams)
    with safe_open(tmp_path / "v2.safetensors", framework="numpy") as file:
        layout = json.loads(file.metadata()[LAYOUT_KEY])
        assert "w.smooth_inverse" in file.keys()
        tensors = {name: file.get_tensor(name) for name in file.keys() if name != "w.smooth_inverse"}
    layout["layout_version"] = 1
    for leaf in layout["leaves"]:
        leaf.get("tensors", {}).pop("smooth_inverse", None)
        leaf.get("metadata", {})["layout_version"] = 1
    layout["tensors"] = {name: spec for name, spec in layout["tensors"].items() if name in tensors}
    save_file(tensors, tmp_path / "v1.safetensors", metadata={LAYOUT_KEY: json.dumps(layout)})
    old = load_safetensors(tmp_path / "v1.safetensors")
    assert old["w"].smooth is not None and old["w"].smooth_inverse is None
    children, aux = qparams["w"].tree_flatten()  # version 1's seven children (exported: test_export.py)
    assert QuantizedArray.tree_unflatten(aux, children[:7]).smooth_inverse is None
    np.testing.assert_array_equal(jax.jit(int8ify(fn))(old, x), jax.jit(int8ify(fn))(qparams, x))


def test_a_target_whose_shapes_differ_is_refused_naming_the_leaf(tmp_path, model):
    fn, params, x, qparams = model
    save_safetensors(tmp_path / "model.safetensors", qparams)
    target = jax.eval_shape(lambda p: p, qparams)
    target["embed"]["b"] = jax.ShapeDtypeStruct((255,), np.float32)
    with pytest.raises(Int8ifyError, match=r"leaf \['embed'\]\['b'\] is float32\[256\] in the file, but the "
                                           r"target's is float32\[255\]"):
        load_safetensors(tmp_path / "model.safetensors", target)
    target = jax.eval_shape(lambda p: p, qparams)
    target["extra"] = jax.ShapeDtypeStruct((3,), np.float32)
    with pytest.raises(Int8ifyError, match=r"the target has leaves the file does not: \['extra'\]"):
        load_safetensors(tmp_path / "model.safetensors", target)
    assert isinstance(qparams["head"], QuantizedArray)


def test_a_leaf_that_is_not_an_array_is_named_with_what_to_do(tmp_path, model):
    """An Equinox module holds its activation function as a leaf: the error names it and the way to store the
    arrays alone (docs/deploy.md runs that way end to end)."""
    fn, params, x, qparams = model
    with pytest.raises(Int8ifyError, match=r"cannot store the leaf at \['activation'\]: it is a ufunc, not an "
                                           r"array or a QuantizedArray; store the arrays alone .*eqx\.partition"):
        save_safetensors(tmp_path / "model.safetensors", {**qparams, "activation": np.tanh})


def test_strided_arrays_are_written_as_their_values(tmp_path, model):
    """SafeTensors writes an array from its data pointer; arrays laid out otherwise than dense row-major (a view,
    a column-major copy, as ``np.asarray`` of a TPU array with a short last axis gives) are written by value."""
    *_, qparams = model
    strided = {"q": column_major(qparams),
               "every_other_column": np.arange(48, dtype=np.float32).reshape(6, 8)[:, ::2]}
    assert not strided["q"]["head"].codes.flags.c_contiguous
    save_safetensors(tmp_path / "strided.safetensors", strided)
    restored = load_safetensors(tmp_path / "strided.safetensors")
    assert_same_tree(restored["q"], qparams)
    np.testing.assert_array_equal(restored["every_other_column"], strided["every_other_column"])
