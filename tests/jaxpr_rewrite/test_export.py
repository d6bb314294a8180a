"""``jax.export`` of a rewritten program taking quantized params: it serializes, deserializes in a fresh process
and gives bit-identical outputs (exported for one batch size or any), and the exported module holds only int8
dots."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from jax.tree_util import PyTreeDef, default_registry

from helpers import FRESH_PROCESS_DEVICE, deploy_model, run_fresh_python
from jaxpr_rewrite import QuantizedArray, int8ify, quantize_params

# The fresh process knows nothing of the model: it imports jaxpr_rewrite (which registers QuantizedArray for
# export's pytree serialization), rebuilds the arguments from the exported structure and the saved leaves.
FRESH = """
import sys
import jax
import numpy as np
import jaxpr_rewrite  # noqa: F401

blob, leaves, expected = sys.argv[1:]
exported = jax.export.deserialize(bytearray(open(blob, "rb").read()))
stored = np.load(leaves)
args, kwargs = jax.tree_util.tree_unflatten(exported.in_tree, [stored[f"leaf{i}"] for i in range(len(stored.files))])
(qparams, x) = args
print(type(qparams["head"]).__name__, qparams["head"].bits)
out = exported.call(qparams, x)
np.testing.assert_array_equal(np.asarray(out), np.load(expected))
print("bit-identical")
if jax.export.is_symbolic_dim(exported.in_avals[-1].shape[0]):  # exported for any batch: each row's own numbers
    np.testing.assert_array_equal(np.asarray(exported.call(qparams, x[:5])), np.load(expected)[:5])
    print("any batch")
"""


def _exported(bits, any_batch=False):
    """The deploy model's program exported for the device a fresh process runs it on (``FRESH_PROCESS_DEVICE``), its
    quantized params, input and expected output computed there."""
    on_tpu = FRESH_PROCESS_DEVICE is not None
    with jax.default_device(FRESH_PROCESS_DEVICE):
        fn, params, x = deploy_model()
        qparams = quantize_params(fn, params, x, bits=bits)
        program = jax.jit(int8ify(fn))
        spec = jax.ShapeDtypeStruct((*jax.export.symbolic_shape("batch"), *x.shape[1:]), x.dtype) if any_batch else x
        exported = jax.export.export(program, platforms=["cpu"] if on_tpu else None)(qparams, spec)
        return exported, qparams, x, np.asarray(program(qparams, x))


@pytest.mark.parametrize("bits, any_batch", [(8, False), (4, False), (8, True)])
def test_export_round_trip_in_a_fresh_process(tmp_path, bits, any_batch):
    exported, qparams, x, expected = _exported(bits, any_batch)
    (tmp_path / "program.bin").write_bytes(exported.serialize())
    leaves = jax.tree_util.tree_leaves(((qparams, x), {}))
    np.savez(tmp_path / "leaves.npz", **{f"leaf{i}": np.asarray(leaf) for i, leaf in enumerate(leaves)})
    np.save(tmp_path / "expected.npy", expected)
    printed = run_fresh_python(FRESH, tmp_path / "program.bin", tmp_path / "leaves.npz", tmp_path / "expected.npy")
    assert printed.split() == ["QuantizedArray", str(bits), "bit-identical"] + ["any", "batch"] * any_batch


def test_deserialized_structure_keeps_the_metadata():
    exported, qparams, x, expected = _exported(4)
    again = jax.export.deserialize(exported.serialize())
    assert again.in_tree == jax.tree_util.tree_structure(((qparams, x), {}))
    rebuilt = jax.tree_util.tree_unflatten(again.in_tree, jax.tree_util.tree_leaves(((qparams, x), {})))
    head = rebuilt[0][0]["head"]
    assert isinstance(head, QuantizedArray) and (head.shape, head.contracting, head.bits) == ((256, 65), (0,), 4)
    with jax.default_device(FRESH_PROCESS_DEVICE):
        np.testing.assert_array_equal(np.asarray(again.call(qparams, x)), expected)


def test_a_program_exported_with_layout_version_1_deserializes():
    """Version 1 had seven children (no ``smooth_inverse``): an exported program's structure of that layout
    deserializes to QuantizedArrays whose ``smooth_inverse`` is None, which the program runs as it is."""
    exported, qparams, x, expected = _exported(8)

    def is_quantized(tree):
        return tree.node_data() is not None and tree.node_data()[0] is QuantizedArray

    def seven_children(tree):
        if is_quantized(tree):
            return PyTreeDef.from_node_data_and_children(default_registry, tree.node_data(), tree.children()[:7])
        if tree.node_data() is None:  # a leaf
            return tree
        return PyTreeDef.from_node_data_and_children(default_registry, tree.node_data(),
                                                     [seven_children(child) for child in tree.children()])

    def quantized_child_counts(tree):
        if is_quantized(tree):
            return [len(tree.children())]
        return [n for child in (tree.children() if tree.node_data() else ()) for n in quantized_child_counts(child)]

    old = dataclasses.replace(exported, in_tree=seven_children(exported.in_tree))
    assert quantized_child_counts(exported.in_tree) == [9] * 4 and quantized_child_counts(old.in_tree) == [7] * 4
    again = jax.export.deserialize(old.serialize())
    rebuilt = jax.tree_util.tree_unflatten(again.in_tree, jax.tree_util.tree_leaves(((qparams, x), {})))
    head = rebuilt[0][0]["head"]
    assert isinstance(head, QuantizedArray) and head.smooth_inverse is None and head.codes.dtype == np.int8
    with jax.default_device(FRESH_PROCESS_DEVICE):
        np.testing.assert_array_equal(np.asarray(again.call(qparams, x)), expected)


@pytest.mark.parametrize("bits", [8, 4])
def test_exported_module_holds_only_int8_dots(bits):
    exported, *_ = _exported(bits)
    text = exported.mlir_module()
    dots = re.findall(r"stablehlo\.dot_general .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)", text)
    assert dots, text
    for lhs, rhs, out in dots:
        assert lhs.endswith("xi8>") and rhs.endswith("xi8>") and out.endswith("xi32>"), (lhs, rhs, out)
    assert "stablehlo.dot " not in text  # no other matmul primitive
    # each matmul of the model calls an int8 dot's body (the two layers of one type share theirs)
    assert len(re.findall(r"call @int8_dot_general", text)) == 4


def test_export_for_a_gpu_of_a_scaled_matmul_backend():
    """As README.md says: export for a GPU refuses the mxfp8 backend's cuDNN call, which has no compatibility
    guarantee, and exports with that check disabled; the int8 backend exports as it is."""
    x, w = np.ones((64, 256), np.float32), np.ones((256, 128), np.float32)

    def program(backend):
        return jax.jit(int8ify(lambda x, w: x @ w, backend=backend))

    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility guarantees"):
        jax.export.export(program("mxfp8"), platforms=["cuda"])(x, w)
    disabled = [jax.export.DisabledSafetyCheck.custom_call("__op$block_scaled_dot")]
    exported = jax.export.export(program("mxfp8"), platforms=["cuda"], disabled_checks=disabled)(x, w)
    assert "stablehlo.custom_call @__op$block_scaled_dot" in exported.mlir_module()
    assert jax.export.export(program("int8"), platforms=["cuda"])(x, w).platforms == ("cuda",)


# A server with JAX and safetensors alone: it never imports jaxpr_rewrite (nor could it deserialize a QuantizedArray)
SERVER = """
import sys
import jax
import numpy as np
from safetensors.numpy import load_file

blob, tensors, x, expected = sys.argv[1:]
exported = jax.export.deserialize(bytearray(open(blob, "rb").read()))
out = exported.call(load_file(tensors), np.load(x))
np.testing.assert_array_equal(np.asarray(out), np.load(expected))
print("bit-identical", "jaxpr_rewrite" in sys.modules)
"""


@pytest.mark.parametrize("bits", [8, 4])
def test_a_program_exported_over_named_tensors_is_served_by_jax_alone(tmp_path, bits):
    from jaxpr_rewrite.safetensors_io import save_safetensors
    from jaxpr_rewrite import over_tensors

    with jax.default_device(FRESH_PROCESS_DEVICE):
        fn, params, x = deploy_model()
        qparams = quantize_params(fn, params, x, bits=bits)
        program, tensors = over_tensors(int8ify(fn), qparams)
        exported = jax.export.export(jax.jit(program), platforms=["cpu"])(tensors, x)
        expected = np.asarray(jax.jit(int8ify(fn))(qparams, x))
    assert exported.in_tree == jax.tree_util.tree_structure(((tensors, x), {}))  # a dict of arrays: JAX's own nodes
    (tmp_path / "program.bin").write_bytes(exported.serialize())
    save_safetensors(tmp_path / "model.safetensors", qparams)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "expected.npy", expected)
    printed = run_fresh_python(SERVER, tmp_path / "program.bin", tmp_path / "model.safetensors", tmp_path / "x.npy",
                               tmp_path / "expected.npy")
    assert printed.split() == ["bit-identical", "False"]
