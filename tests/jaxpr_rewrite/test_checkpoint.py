"""Orbax checkpoints of quantized params: bit-identical round trips (Orbax's own checkpointer onto an abstract
target, and save_quantized / load_quantized with or without one), sharded over 8 host CPU devices, read by a
fresh process; clear errors for another layout version, a damaged file and a target that does not fit."""

from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import assert_same_tree, deploy_model, run_fresh_python
from jaxpr_rewrite import Int8ifyError, QuantizedArray, int8ify, quantize_params
from jaxpr_rewrite._quantized import array as quantized
from jaxpr_rewrite._quantized import stored
from jaxpr_rewrite._io.checkpoint import load_quantized, save_quantized, sharded_like


@pytest.fixture(scope="module", params=[8, 4], ids=["int8", "int4"])
def model(request):
    fn, params, x = deploy_model()
    return fn, params, x, jax.device_put(quantize_params(fn, params, x, bits=request.param))


def abstract(tree):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def test_orbax_standard_checkpointer_onto_an_abstract_target(tmp_path, model):
    fn, _, x, qparams = model
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", qparams)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ckpt", abstract(qparams))
    assert_same_tree(restored, qparams)
    np.testing.assert_array_equal(jax.jit(int8ify(fn))(restored, x), jax.jit(int8ify(fn))(qparams, x))
    # without a target Orbax alone returns dicts of the named children: what load_quantized is for
    raw = checkpointer.restore(tmp_path / "ckpt")
    assert set(raw["head"]) == set(quantized.ARRAY_FIELDS)


def test_save_and_load_quantized_with_and_without_target(tmp_path, model):
    fn, _, x, qparams = model
    save_quantized(tmp_path / "ckpt", qparams)
    assert_same_tree(load_quantized(tmp_path / "ckpt"), qparams)
    assert_same_tree(load_quantized(tmp_path / "ckpt", abstract(qparams)), qparams)
    shapes = jax.eval_shape(lambda p: p, qparams)  # ShapeDtypeStructs without shardings
    restored = load_quantized(tmp_path / "ckpt", shapes)
    assert_same_tree(restored, qparams)
    np.testing.assert_array_equal(jax.jit(int8ify(fn))(restored, x), jax.jit(int8ify(fn))(qparams, x))


def test_smoothquant_factors_round_trip(tmp_path):
    fn, params, x = deploy_model()
    qparams = quantize_params(fn, params, x, smooth_alpha=0.5)
    assert qparams["head"].smooth is not None
    save_quantized(tmp_path / "ckpt", qparams)
    restored = load_quantized(tmp_path / "ckpt")
    assert restored["head"].smooth_group == qparams["head"].smooth_group
    assert_same_tree(restored, qparams)
    np.testing.assert_array_equal(jax.jit(int8ify(fn))(restored, x), jax.jit(int8ify(fn))(qparams, x))


needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (tests/conftest.py sets them)")


def float_shardings(params, mesh):
    """Column-parallel weights (output features over "model") where they divide, everything else replicated."""
    def sharding(a):
        return NamedSharding(mesh, P(None, "model") if a.ndim == 2 and a.shape[-1] % 2 == 0 else P())

    return jax.tree_util.tree_map(sharding, params)


@needs_8
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_sharded_restore_keeps_each_leafs_sharding(tmp_path, axis_type):
    fn, params, x = deploy_model()
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type, axis_type))
    qparams = quantize_params(fn, params, x)
    target = sharded_like(jax.eval_shape(lambda p: p, qparams), float_shardings(params, mesh))
    # codes sharded like the float weight, scales (and exponents) along its kept axis: the columns
    layer = target["layers"][0]["w"]
    assert layer.codes.sharding.spec == P(None, "model") and layer.scales.sharding.spec == P("model")
    assert layer.exponents.sharding.spec == P("model") and target["head"].codes.sharding.is_fully_replicated
    save_quantized(tmp_path / "ckpt", jax.device_put(qparams, jax.tree_util.tree_map(lambda a: a.sharding, target)))
    restored = load_quantized(tmp_path / "ckpt", target)
    for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(target)):
        assert got.sharding == want.sharding
    assert_same_tree(restored, qparams)
    plain = ocp.StandardCheckpointer().restore(tmp_path / "ckpt" / "tensors")  # the same tensors, Orbax's format
    np.testing.assert_array_equal(plain["head.codes"], qparams["head"].codes)
    np.testing.assert_array_equal(jax.jit(int8ify(fn))(restored, x), jax.jit(int8ify(fn))(qparams, x))


FRESH = """
import sys
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxpr_rewrite import QuantizedArray, int8ify
from jaxpr_rewrite._io.checkpoint import load_quantized, sharded_like
sys.path.insert(0, sys.argv[3])
from helpers import deploy_fn

qparams = load_quantized(sys.argv[1])  # the directory alone
assert isinstance(qparams["head"], QuantizedArray) and isinstance(qparams["layers"], list)
x = np.load(sys.argv[2])
np.save(sys.argv[2].replace("x.npy", "out.npy"), np.asarray(jax.jit(int8ify(deploy_fn))(qparams, x)))
mesh = jax.make_mesh((4, 2), ("data", "model"))
shardings = jax.tree_util.tree_map(lambda a: NamedSharding(mesh, P(None, "model") if a.shape == (256, 256) else P()),
                                   qparams, is_leaf=lambda v: isinstance(v, QuantizedArray))
sharded = load_quantized(sys.argv[1], sharded_like(jax.eval_shape(lambda p: p, qparams), shardings))
layer = sharded["layers"][1]["w"]
print(tuple(layer.codes.sharding.spec), tuple(layer.scales.sharding.spec), len(layer.codes.sharding.device_set))
"""


@needs_8
def test_a_checkpoint_is_read_by_a_fresh_process(tmp_path, model):
    fn, _, x, qparams = model
    save_quantized(tmp_path / "ckpt", qparams)
    np.save(tmp_path / "x.npy", x)
    printed = run_fresh_python(FRESH, tmp_path / "ckpt", tmp_path / "x.npy", Path(__file__).parent)
    assert printed.split() == ["(None,", "'model')", "('model',)", "8"]
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), jax.jit(int8ify(fn))(qparams, x))


def test_another_layout_version_is_refused_naming_the_leaf(tmp_path, model, monkeypatch):
    *_, qparams = model
    with monkeypatch.context() as patch:  # a future int8ify, writing version 4
        patch.setattr(quantized, "LAYOUT_VERSION", 4)
        patch.setattr(stored, "LAYOUT_VERSION", 4)
        save_quantized(tmp_path / "ckpt", qparams)
    with pytest.raises(Int8ifyError,
                       match=r"layout version 4 \(first leaf \['embed'\]\['b'\]\).*reads versions 1, 2 and 3"):
        load_quantized(tmp_path / "ckpt")


def test_a_target_whose_shapes_differ_is_refused_naming_the_leaf(tmp_path, model):
    fn, params, x, qparams = model
    save_quantized(tmp_path / "ckpt", qparams)
    wider = dict(params, head=np.zeros((256, 66), np.float32))
    other = quantize_params(fn, wider, x, bits=qparams["head"].bits)
    with pytest.raises(Int8ifyError, match=r"leaf \['head'\] is a QuantizedArray of shape \[256, 65\].*\[256, 66\]"):
        load_quantized(tmp_path / "ckpt", jax.eval_shape(lambda p: p, other))
    with pytest.raises(Int8ifyError, match=r"leaf \['head'\] is a QuantizedArray \[256, 65\] in the file, but the "
                                           "target's leaf is a ShapeDtypeStruct"):
        load_quantized(tmp_path / "ckpt", jax.eval_shape(lambda p: p, dict(qparams, head=params["head"])))


def test_a_damaged_checkpoint_is_refused_naming_the_leaf(tmp_path, model):
    *_, qparams = model
    save_quantized(tmp_path / "ckpt", qparams)
    for data in (tmp_path / "ckpt" / "tensors").rglob("d/*"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(Int8ifyError, match=r"could not be read: leaf \[.*\]"):
        load_quantized(tmp_path / "ckpt")
    with pytest.raises(Int8ifyError, match="no checkpoint at"):
        load_quantized(tmp_path / "missing")


def test_quantized_array_children_are_keyed_by_name(model):
    *_, qparams = model
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(qparams["head"])[0]]
    assert paths == [".codes", ".scales", ".exponents", ".epilogue_factor", ".epilogue_power"]
    assert isinstance(qparams["head"], QuantizedArray)
