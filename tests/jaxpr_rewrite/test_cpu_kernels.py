"""The kernels XLA:CPU runs for a quantized MLP, read off its optimized HLO: the structure the CPU speed work built
(``docs/performance.md``), kept from coming undone by a change that leaves every number the same.

Per layer with weights quantized once, for an activation of 4096 values and more: its absmax (a reduction reading
it, with no float temporary as large as it), its scale, its codes, the int8 dot, the minimum over the codes that
catches NaN and Inf, and the epilogue with the model's bias and gelu; with static activation scales the epilogue
also computes the next layer's codes, so no float array the activation's size is written but the model's output.
A smaller activation, whose ``|x|`` XLA:CPU writes out before reducing it in two steps, takes the NaN-safe absmax
(its select joins that ``|x|``) and no minimum over its codes. A single row with static scales is checked on its
codes padded to two rows, as its int8 dot reads them, so they are computed once. A contraction whose length is not a
multiple of 4 takes the same kernels as one that is (only a GPU's program pads it).
"""
import re
from collections import Counter

import jax
import numpy as np
import pytest

from jaxpr_rewrite import int8ify, quantize_params

# XLA:CPU's YNNPACK reductions that read |x| as they reduce came with JAX 0.10.2
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or jax.__version_info__ < (0, 10, 2),
                                reason="the kernels of XLA:CPU from JAX 0.10.2")

WIDTH, LAYERS = 256, 3
# instructions of an entry computation that launch nothing
_NOT_KERNELS = {"parameter", "get-tuple-element", "constant", "tuple", "bitcast"}


def _mlp(params, x):
    for w, b in params:
        x = jax.nn.gelu(x @ w + b)
    return x


def _params(width=WIDTH):
    rng = np.random.default_rng(0)
    return [((rng.standard_normal((width, width)) / 16).astype(np.float32),
             rng.standard_normal(width).astype(np.float32)) for _ in range(LAYERS)]


def _kernel_outputs(qparams, x) -> list[str]:
    """The type of each kernel the optimized CPU program of ``int8ify(_mlp)`` runs, in order (``f32[256,256]``)."""
    hlo = jax.jit(int8ify(_mlp)).lower(qparams, x).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    kernels = re.findall(r"^\s*(?:ROOT )?%?[\w.\-]+ = ([a-z]\w*\[[\d,]*\])\S* ([\w-]+)\(", entry, re.M)
    return [shape for shape, op in kernels if op not in _NOT_KERNELS]


def test_dynamic_scales_take_six_kernels_per_layer_and_no_float_temporary():
    x = np.random.default_rng(1).standard_normal((256, WIDTH)).astype(np.float32)
    kernels = _kernel_outputs(quantize_params(_mlp, _params(), x), x)
    assert Counter(kernels) == {
        "f32[256]": 2 * LAYERS,  # each activation's absmax and its scale
        "s8[256,256]": LAYERS,  # its codes
        "s32[256,256]": LAYERS,  # the int8 dot
        "s8[256]": LAYERS,  # the minimum over its codes
        "f32[256,256]": LAYERS,  # the epilogue, bias and gelu: the layer's output
    }, kernels


def test_static_scales_compute_the_next_codes_in_the_epilogue():
    x = np.random.default_rng(1).standard_normal((256, WIDTH)).astype(np.float32)
    static = quantize_params(_mlp, _params(), x, activations="static", calibration=[(x,)])
    kernels = _kernel_outputs(static, x)
    # per layer its codes (the first from the input, every later one from the epilogue before it), the int8 dot and
    # the minimum over the codes; one float array as large as an activation, the model's output
    assert Counter(kernels) == {"s8[256,256]": LAYERS, "s32[256,256]": LAYERS, "s8[256]": LAYERS,
                                "f32[256,256]": 1}, kernels


@pytest.mark.parametrize("batch", [1, 2, 15])
def test_a_small_batch_takes_seven_kernels_per_layer(batch):
    x = np.random.default_rng(1).standard_normal((batch, WIDTH)).astype(np.float32)
    kernels = _kernel_outputs(quantize_params(_mlp, _params(), x), x)
    # |x| with NaN as Inf, the reduction's two steps, the scale, the codes (one row padded to two: XLA's faster
    # int8 dot path), the dot, the epilogue; no minimum over the codes (two kernels more)
    rows = max(batch, 2)
    per_layer = [f"f32[{batch},256]", f"f32[{batch},8]", f"f32[{batch}]", f"f32[{batch}]", f"s8[{rows},256]",
                 f"s32[{rows},256]", f"f32[{batch},256]"]
    assert Counter(kernels) == Counter(per_layer * LAYERS), kernels


def test_a_single_row_with_static_scales_computes_its_codes_once():
    x = np.random.default_rng(1).standard_normal((1, WIDTH)).astype(np.float32)
    static = quantize_params(_mlp, _params(), x, activations="static", calibration=[(x,)])
    kernels = _kernel_outputs(static, x)
    # per layer its codes padded to two rows (the previous layer's epilogue in the same kernel), the dot, and the
    # minimum over the padded codes in the reduction's two steps; the codes are not computed a second time for the
    # check, nor the epilogue written out between layers
    per_layer = ["s8[2,256]", "s32[2,256]", "s8[2,8]", "s8[2]"]
    assert Counter(kernels) == Counter(per_layer * LAYERS + ["f32[1,256]"]), kernels


@pytest.mark.parametrize("activations", ["dynamic", "static"])
@pytest.mark.parametrize("batch", [1, 64])
def test_a_contraction_not_a_multiple_of_4_takes_the_kernels_of_one_that_is(activations, batch):
    """``int32_dot`` pads a contraction to a multiple of 4 for a GPU's int8 GEMM only. Padded on CPU too, it copied
    each pre-quantized weight's codes on every call (a kernel more per layer), and static scales' check for NaN and
    Inf read the codes unpadded, so XLA computed them twice (21 kernels instead of 13 for three layers)."""

    def kernels(width):
        x = np.random.default_rng(1).standard_normal((batch, width)).astype(np.float32)
        options = {"activations": "static", "calibration": [(x,)]} if activations == "static" else {}
        found = _kernel_outputs(quantize_params(_mlp, _params(width), x, **options), x)
        return Counter(re.sub(rf"\b{width}\b", "width", kernel) for kernel in found)

    assert kernels(WIDTH - 2) == kernels(WIDTH)
