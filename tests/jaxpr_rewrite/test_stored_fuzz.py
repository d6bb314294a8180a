"""Quantized params through every way of storing them, as a property: weights of random shapes (odd lengths for
4-bit packing), 8 or 4 bits, per channel or in blocks, contracted over either axis, with dynamic or static
activation scales and SmoothQuant, some columns all zero, written as SafeTensors and as Orbax checkpoints (also
from column-major host copies, as a TPU hands them out), read back with and without a target: every array
bit-identical, and the program's outputs too."""

import jax
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from helpers import assert_same_tree, column_major, examples
from jaxpr_rewrite import int8ify, quantize_params
from jaxpr_rewrite._io.checkpoint import load_quantized, save_quantized
from jaxpr_rewrite._io.safetensors_io import load_safetensors, save_safetensors


def _program(contract_last):
    """Two layers; the second weight is used as ``x @ w`` or, contracted over its last axis, ``x @ w.T``."""
    def fn(params, x):
        h = jax.nn.gelu(x @ params["first"] + params["bias"])
        return h @ (params["second"].T if contract_last else params["second"])
    return fn


@st.composite
def stored_models(draw):
    block = draw(st.sampled_from([None, 32]))
    k = draw(st.sampled_from([64, 96, 128]))
    hidden = draw(st.sampled_from([64, 128]))
    n = draw(st.sampled_from([33, 64, 65]))  # odd: a 4-bit row packed with a padding code
    contract_last = draw(st.booleans())
    bits = draw(st.sampled_from([8, 4]))
    static = draw(st.booleans())
    smooth = draw(st.booleans()) and block is None and not static
    zero_columns = draw(st.lists(st.integers(0, hidden - 1), max_size=3))
    seed = draw(st.integers(0, 2**16))
    return block, k, hidden, n, contract_last, bits, static, smooth, zero_columns, seed


@examples(12)
@given(stored_models())
def test_stored_params_come_back_bit_identical(tmp_path_factory, case):
    block, k, hidden, n, contract_last, bits, static, smooth, zero_columns, seed = case
    rng = np.random.default_rng(seed)
    second = rng.normal(size=(hidden, n)).astype(np.float32) / 8
    params = {"first": rng.normal(size=(k, hidden)).astype(np.float32) / 8,
              "bias": rng.normal(size=hidden).astype(np.float32),
              "second": np.ascontiguousarray(second.T) if contract_last else second}
    params["first"][:, zero_columns] = 0
    x = rng.normal(size=(16, k)).astype(np.float32)
    program = int8ify(_program(contract_last), block_size=block)
    options = {"bits": bits}
    if static:
        options.update(activations="static", calibration=[(x,), (x[::-1] * 2,)])
    if smooth:
        options.update(smooth_alpha=0.5)
    qparams = quantize_params(program, params, x, **options)
    run = jax.jit(program)
    want = np.asarray(run(qparams, x))
    target = jax.eval_shape(lambda p: p, qparams)
    host_copies = column_major(qparams)
    folder = tmp_path_factory.mktemp("stored")

    save_safetensors(folder / "params.safetensors", qparams)
    save_safetensors(folder / "column_major.safetensors", host_copies)
    save_quantized(folder / "checkpoint", qparams)
    save_quantized(folder / "column_major", host_copies)
    for loaded in (load_safetensors(folder / "params.safetensors"),
                   load_safetensors(folder / "params.safetensors", target),
                   load_safetensors(folder / "column_major.safetensors", target),
                   load_quantized(folder / "checkpoint"),
                   load_quantized(folder / "checkpoint", target),
                   load_quantized(folder / "column_major", target)):
        assert_same_tree(loaded, qparams)
        np.testing.assert_array_equal(np.asarray(run(loaded, x)), want)
