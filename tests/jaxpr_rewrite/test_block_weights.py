"""Block-scaled weights quantized once (``quantize_params(int8ify(fn, block_size=B), ...)``, 8 or 4 bits): the
same numbers as the dynamic block-scaled path for 8 bits, bit for bit; 4-bit blocks against an independent numpy
reference (blocks zero-padded, one scale per column and block, exact int64 partial sums); all-zero blocks, odd
contraction lengths, transposed weights, files and errors."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import (assert_all_dots_int8, reference_block_matmul, reference_codes, reference_scales,
                     reference_unpack_int4)
from jaxpr_rewrite import Int8ifyError, QuantizedArray, int8ify, quantize_params
from jaxpr_rewrite._io.checkpoint import sharded_like
from jaxpr_rewrite._io.safetensors_io import load_safetensors, save_safetensors


def weight(rows, cols, seed=0):
    w = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32) / np.sqrt(rows)
    w[:128, 3] = 0  # all-zero blocks of column 3 (for blocks of 32 to 128)
    return w


def dense(params, x):
    return x @ params["w"]


def dense_transposed(params, x):
    return x @ params["w"].T


@pytest.mark.parametrize("block", [32, 64, 128])
def test_8_bit_blocks_are_bit_identical_to_the_dynamic_path(block):
    w = weight(333, 256)  # odd contraction: the last block is zero-padded
    x = np.random.default_rng(1).normal(size=(64, 333)).astype(np.float32)
    program = int8ify(dense, block_size=block)
    qparams = quantize_params(program, {"w": w}, x)
    q = qparams["w"]
    assert isinstance(q, QuantizedArray) and q.block_size == block
    assert q.scales.shape == (256, -(-333 // block)) and q.codes.shape == (333, 256)
    np.testing.assert_array_equal(np.asarray(jax.jit(program)(qparams, x)), np.asarray(jax.jit(program)({"w": w}, x)))
    assert_all_dots_int8(program.rewritten_jaxpr(qparams, x), 1)


@pytest.mark.parametrize("fn", [dense, dense_transposed], ids=["x@w", "x@w.T"])
@pytest.mark.parametrize("block", [32, 128])
def test_4_bit_blocks_match_the_reference(fn, block):
    as_matrix = weight(333, 256)  # (K, N), odd K
    w = as_matrix if fn is dense else np.ascontiguousarray(as_matrix.T)
    x = np.random.default_rng(2).normal(size=(64, 333)).astype(np.float32)
    program = int8ify(fn, block_size=block)
    q = quantize_params(program, {"w": w}, x, bits=4)["w"]
    assert q.bits == 4 and q.block_size == block
    # the stored codes and scales, block by block, against the reference of each (zero-padded) block
    k = as_matrix.shape[0]
    padded = np.pad(as_matrix, ((0, -k % block), (0, 0)))
    codes = reference_unpack_int4(np.asarray(q.codes), q.length)
    codes = codes if fn is dense else codes.T
    for b in range(padded.shape[0] // block):
        rows = slice(b * block, (b + 1) * block)
        np.testing.assert_array_equal(codes[rows], reference_codes(padded[rows], (0,), limit=7)[:k - b * block])
        scale = np.asarray(q.scale_values(), np.float64)[:, b]
        np.testing.assert_array_equal(scale, reference_scales(padded[rows], (0,), limit=7))
    assert np.asarray(q.scale_values())[3, 0] == 1  # the all-zero block
    out = np.asarray(jax.jit(program)({"w": q}, x), np.float64)
    want, magnitude = reference_block_matmul(x, as_matrix, block, rhs_limit=7)
    # float32 scaling of each block, then a float32 sum of the blocks: a few ulps of the terms' magnitude
    np.testing.assert_array_less(np.abs(out - want), 4e-7 * magnitude + 1e-30)
    assert_all_dots_int8(program.rewritten_jaxpr({"w": q}, x))


def test_block_weights_round_trip_through_a_file(tmp_path):
    w = weight(256, 128)
    x = np.random.default_rng(3).normal(size=(16, 256)).astype(np.float32)
    program = int8ify(dense, block_size=64)
    qparams = quantize_params(program, {"w": w}, x, bits=4)
    save_safetensors(tmp_path / "w.safetensors", qparams)
    loaded = load_safetensors(tmp_path / "w.safetensors")
    assert loaded["w"].block_size == 64 and loaded["w"].scales.shape == (128, 4)
    np.testing.assert_array_equal(np.asarray(jax.jit(program)(loaded, x)), np.asarray(jax.jit(program)(qparams, x)))


def test_block_weights_in_a_dot_of_another_block_length_are_an_error():
    w = weight(256, 128)
    x = np.ones((4, 256), np.float32)
    qparams = quantize_params(int8ify(dense, block_size=64), {"w": w}, x)
    with pytest.raises(Int8ifyError, match="quantized with block_size=64 .* meets a dot with block_size=32"):
        int8ify(dense, block_size=32)(qparams, x)
    with pytest.raises(Int8ifyError, match="quantized with block_size=64 .* meets a dot with no block_size"):
        int8ify(dense)(qparams, x)


@pytest.mark.parametrize("options, instead", [
    ({"block_size": 32}, r"quantize it with the same options, quantize_params\(int8ify\(fn, block_size=...\)"),
    ({"granularity": "per-tensor"}, "pass the float weight"),
    ({"backend": "mxfp8"}, "pass the float weight"),
])
def test_per_channel_weights_in_dots_quantized_otherwise_are_an_error(options, instead):
    """The reverse of the above: per-channel int8 codes re-quantized under other options (they ran silently,
    neither their contract nor what the options give the float weight) are an error naming the line."""
    x = np.ones((4, 256), np.float32)
    qparams = quantize_params(dense, {"w": weight(256, 128)}, x)
    with pytest.raises(Int8ifyError, match=r"dot_general at .*test_block_weights\.py:\d+ \(dense\) gets a weight "
                                           r"quantized per channel in int8 .* the options quantize its dots "
                                           r"otherwise \(backend=.*; " + instead):
        int8ify(dense, **options)(qparams, x)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 host devices (tests/conftest.py sets them)")
def test_block_scales_shard_along_the_kept_axis():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    qparams = quantize_params(int8ify(dense, block_size=64), {"w": weight(256, 128)}, np.ones((4, 256), np.float32))
    target = sharded_like(jax.eval_shape(lambda p: p, qparams), {"w": NamedSharding(mesh, P(None, "model"))})
    assert target["w"].scales.shape == (128, 4) and tuple(target["w"].scales.sharding.spec) == ("model", None)
