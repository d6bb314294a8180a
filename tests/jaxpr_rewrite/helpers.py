"""Shared test helpers: an independent numpy reference of the int8 contract, tie-free data, jaxpr walkers and
shared test programs.

The reference never calls the library: scales in float32 (``absmax / 127``, correctly rounded by numpy; 1 for an
all-zero slice), codes by numpy division and rounding (ties to even), exact integer sums in int64, and
``a * s_x * s_w`` in float64.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

from jaxpr_rewrite import dot_eqns, iter_eqns  # noqa: F401  (re-exported for the tests)
from jaxpr_rewrite._core import platforms

# the lowering platforms whose programs the tests compare, traced into one program (``lax.platform_dependent``)
PLATFORMS = ("cpu", "cuda", "tpu")


def every_platform():
    """Programs traced inside are traced for each of :data:`PLATFORMS` (one ``lax.platform_dependent`` branch each),
    so that one jaxpr shows, and the CPU can run, each platform's program."""
    return platforms.target(PLATFORMS)


def examples(count: int):
    """Hypothesis settings for a property that runs ``count`` examples under the ``ci`` profile (each new shape is an
    XLA compile, so expensive properties set their own count), scaled with the loaded profile: ``thorough`` runs 16
    times as many (400 / 25), where a fixed ``max_examples`` would pin the count under every profile. The unit is
    the ``ci`` profile's own count, as tests/conftest.py registers it."""
    ci_examples = settings.get_profile("ci").max_examples
    return settings(max_examples=max(1, round(count * settings.default.max_examples / ci_examples)), deadline=None)


SIZES = st.sampled_from([1, 2, 3, 5])  # few distinct sizes: every new shape is an XLA compile


@st.composite
def dot_problems(draw, with_axes: bool = False):
    """Random dot_general problems: 0-2 batch, contracting, lhs-free and rhs-free dims, each operand's
    axes in a random order (so contracting dims come in any order), one of three float dtypes, and
    optionally an all-zero slice. ``(lhs, rhs, dimension_numbers)``, and with ``with_axes`` each operand's axes as
    ``(kind, index)`` pairs (kind ``"batch"``, ``"contract"``, ``"lhs_free"`` or ``"rhs_free"``)."""
    kinds = {k: draw(st.integers(0, 2)) for k in ("batch", "contract", "lhs_free", "rhs_free")}
    sizes = {k: [draw(SIZES) for _ in range(n)] for k, n in kinds.items()}
    lhs_axes = [("batch", i) for i in range(kinds["batch"])] + [("contract", i) for i in range(kinds["contract"])]
    lhs_axes += [("lhs_free", i) for i in range(kinds["lhs_free"])]
    rhs_axes = [("batch", i) for i in range(kinds["batch"])] + [("contract", i) for i in range(kinds["contract"])]
    rhs_axes += [("rhs_free", i) for i in range(kinds["rhs_free"])]
    lhs_axes = draw(st.permutations(lhs_axes))
    rhs_axes = draw(st.permutations(rhs_axes))
    contract_order = draw(st.permutations(list(range(kinds["contract"]))))
    batch_order = draw(st.permutations(list(range(kinds["batch"]))))
    dims = (
        (
            tuple(lhs_axes.index(("contract", i)) for i in contract_order),
            tuple(rhs_axes.index(("contract", i)) for i in contract_order),
        ),
        (
            tuple(lhs_axes.index(("batch", i)) for i in batch_order),
            tuple(rhs_axes.index(("batch", i)) for i in batch_order),
        ),
    )
    lhs_shape = tuple(sizes[k][i] for k, i in lhs_axes)
    rhs_shape = tuple(sizes[k][i] for k, i in rhs_axes)
    dtype = draw(st.sampled_from([np.float32, np.float32, ml_dtypes.bfloat16, np.float16]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    lhs = rng.normal(scale=draw(st.sampled_from([1e-3, 1.0, 50.0])), size=lhs_shape)
    rhs = rng.normal(size=rhs_shape)
    if draw(st.booleans()) and lhs.size:
        # zero one whole channel (a slice over the contracting dims) of the lhs
        kept = [a for a in range(lhs.ndim) if a not in dims[0][0]]
        index = tuple(rng.integers(lhs_shape[a]) if a in kept else slice(None) for a in range(lhs.ndim))
        lhs[index] = 0
    lhs = away_from_ties(lhs, dims[0][0], dtype=dtype)
    rhs = away_from_ties(rhs, dims[0][1], dtype=dtype)
    return (lhs, rhs, dims, lhs_axes, rhs_axes) if with_axes else (lhs, rhs, dims)


def reference_scale_parts(x, reduce_axes, limit=127) -> tuple[np.ndarray, np.ndarray]:
    """The contract's scale of each slice over ``reduce_axes`` (kept axes in order) as ``(scales, exponents)``
    with ``scale = scales * 2**exponents``, the library's documented representation: ``2**exponents`` the power
    of two of the absmax, ``scales`` its mantissa / 127 in float32 (the top binade keeps the exponent one lower);
    an all-zero slice has scale 1. ``scales * 2**exponents`` is exactly ``absmax / 127`` correctly rounded.
    ``limit=7`` gives the 4-bit weights' ``absmax / 7``."""
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=tuple(reduce_axes), initial=np.float32(0)).astype(np.float64)
    mantissa, exponent = np.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    mantissa, exponent = mantissa * 2, exponent - 1
    top = exponent > 126
    mantissa, exponent = np.where(top, mantissa * 2, mantissa), np.where(top, 126, exponent)
    scales = (mantissa.astype(np.float32) / np.float32(limit)).astype(np.float32)
    zero = amax == 0
    return np.where(zero, np.float32(1), scales).astype(np.float32), np.where(zero, 0, exponent).astype(np.int32)


def reference_scales(x, reduce_axes, limit=127) -> np.ndarray:
    """The scale of each slice as an exact float64 value (``scales * 2**exponents``)."""
    scales, exponents = reference_scale_parts(x, reduce_axes, limit)
    return scales.astype(np.float64) * np.exp2(exponents.astype(np.float64))


def reference_codes(x, reduce_axes, limit=127) -> np.ndarray:
    """int8 codes ``clip(rint(x / s), -127, 127)`` with ``x / s`` correctly rounded in float32 (numpy's division
    of the exactly rescaled ``x * 2**-e`` by ``scales``) and round-half-even (``limit=7``: 4-bit codes)."""
    x = np.asarray(x, np.float32)
    scales, exponents = reference_scale_parts(x, reduce_axes, limit)
    s = np.expand_dims(scales, tuple(reduce_axes))
    prescaled = (x.astype(np.float64) * np.expand_dims(np.exp2(-exponents.astype(np.float64)), tuple(reduce_axes)))
    return np.clip(np.rint(prescaled.astype(np.float32) / s), -limit, limit).astype(np.int8)


def reference_dot(lhs, rhs, dimension_numbers, rhs_limit=127) -> np.ndarray:
    """The contract's value of ``dot_general(lhs, rhs)`` in float64, from exact int64 sums of the codes
    (``rhs_limit=7``: a 4-bit weight on the right, W4A8)."""
    (lc, rc), (lb, rb) = dimension_numbers
    lhs32, rhs32 = np.asarray(lhs, np.float32), np.asarray(rhs, np.float32)
    lq = reference_codes(lhs32, lc).astype(np.int64)
    rq = reference_codes(rhs32, rc, rhs_limit).astype(np.int64)
    acc = _int_dot(lq, rq, dimension_numbers)
    ls = reference_scales(lhs32, lc).astype(np.float64)
    rs = reference_scales(rhs32, rc, rhs_limit).astype(np.float64)
    return acc * _to_output(ls, lhs32.ndim, lc, lb, 0, acc.ndim, len(lb)) * _to_output(
        rs, rhs32.ndim, rc, rb, 1, acc.ndim, len(lb)
    )


def _int_dot(lq, rq, dimension_numbers) -> np.ndarray:
    """Exact ``dot_general`` of integer arrays with numpy einsum (int64 accumulation)."""
    (lc, rc), (lb, rb) = dimension_numbers
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    lsub = [None] * lq.ndim
    rsub = [None] * rq.ndim
    batch, lfree, rfree = [], [], []
    for l_axis, r_axis in zip(lb, rb):
        c = next(letters)
        lsub[l_axis] = rsub[r_axis] = c
        batch.append(c)
    for l_axis, r_axis in zip(lc, rc):
        c = next(letters)
        lsub[l_axis] = rsub[r_axis] = c
    for i in range(lq.ndim):
        if lsub[i] is None:
            lsub[i] = next(letters)
            lfree.append(lsub[i])
    for i in range(rq.ndim):
        if rsub[i] is None:
            rsub[i] = next(letters)
            rfree.append(rsub[i])
    spec = f"{''.join(lsub)},{''.join(rsub)}->{''.join(batch + lfree + rfree)}"
    return np.einsum(spec, lq, rq, dtype=np.int64)


def _to_output(scales, ndim, contract, batch, side, out_ndim, n_batch):
    """Reshape per-channel scales (kept axes in order) to broadcast against the dot output."""
    kept = [a for a in range(ndim) if a not in contract]
    free = [a for a in range(ndim) if a not in contract and a not in batch]
    n_free_lhs_or_rhs = len(free)
    positions = {}
    for i, a in enumerate(batch):
        positions[a] = i
    offset = n_batch if side == 0 else out_ndim - n_free_lhs_or_rhs
    for i, a in enumerate(free):
        positions[a] = offset + i
    order = sorted(range(len(kept)), key=lambda i: positions[kept[i]])
    s = np.transpose(scales, order) if kept else scales
    shape = [1] * out_ndim
    for i in order:
        shape[positions[kept[i]]] = scales.shape[i]
    return np.reshape(s, shape)


def away_from_ties(x, reduce_axes, margin=0.01, dtype=np.float32) -> np.ndarray:
    """Move entries whose ``x / scale`` lies within ``margin`` of a rounding tie away from it.

    XLA may compute ``x / s`` as ``x * (1/s)``, which can flip a value that sits on a tie; these inputs keep
    exact-code assertions honest. A float32 entry moves a quarter step inward; in a narrower ``dtype``
    (where that step may not be representable) it becomes 0. The amax entry sits at exactly +-127 and never
    moves, so the scales stay as they were.
    """
    x = np.asarray(np.asarray(x).astype(dtype), np.float32)
    s = np.expand_dims(reference_scales(x, reduce_axes), tuple(reduce_axes)).astype(np.float64)
    r = x.astype(np.float64) / s
    near_tie = np.abs(np.abs(r - np.floor(r)) - 0.5) < margin
    fixed = (np.round(r) - 0.25 * np.sign(r)) * s if dtype == np.float32 else np.zeros_like(r)
    return np.where(near_tie, fixed, x).astype(dtype)


def with_zero_and_non_finite_rows(draw, x, max_bad: int):
    """For a hypothesis strategy: the matrix ``x`` with, as drawn, one of its rows all zeros and up to ``max_bad``
    rows holding a NaN or an Inf; returns ``(x, sorted indices of those rows)``."""
    rows, cols = x.shape
    if draw(st.booleans()):
        x[draw(st.integers(0, rows - 1))] = 0.0  # an all-zero slice
    bad_rows = draw(st.sets(st.integers(0, rows - 1), max_size=max_bad))
    for r in bad_rows:
        x[r, draw(st.integers(0, cols - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return x, sorted(bad_rows)


def assert_finite_slices_quantized_as_the_contract(quantize_fn, x, bad_rows, axis: int, split=None):
    """``quantize_fn(x, (axis,))`` under ``jit`` (returning ``(codes, scales, exponents, (factor, power))``, as the
    rewritten program's dynamic quantizations do) against the reference on every slice but ``bad_rows``: the codes,
    scales and exponents bit for bit (``split(scales, exponents, amax)`` adjusts the reference's split where a
    quantization documents another one of the same value), and ``factor * power`` exactly the scale. Returns
    ``(scales, factor, finite)`` for the caller's checks of the other slices."""
    codes, scales, exponents, (factor, power) = jax.jit(lambda v: quantize_fn(v, (axis,)))(x)
    scales, factor = np.asarray(scales), np.asarray(factor)
    with np.errstate(invalid="ignore", over="ignore"):  # the reference's codes of a non-finite slice: not compared
        want_codes = reference_codes(x, (axis,))
        want_scales, want_exponents = reference_scale_parts(x, (axis,))
    if split is not None:
        want_scales, want_exponents = split(want_scales, want_exponents, np.max(np.abs(x), axis=axis))
    finite = np.ones(x.shape[1 - axis], bool)
    finite[bad_rows] = False
    take = (lambda a: a[:, finite]) if axis == 0 else (lambda a: a[finite])
    np.testing.assert_array_equal(take(np.asarray(codes)), take(want_codes))
    np.testing.assert_array_equal(scales[finite], want_scales[finite])
    np.testing.assert_array_equal(np.asarray(exponents)[finite], want_exponents[finite])
    got = factor.astype(np.float64)[finite] * np.asarray(power, np.float64)[finite]
    np.testing.assert_array_equal(got, want_scales[finite].astype(np.float64) * 2.0 ** want_exponents[finite])
    return scales, factor, finite


def program_dots(jaxpr):
    """The matmuls of the program each platform runs (:func:`dot_eqns` of one ``lax.platform_dependent`` branch
    each), asserted the same on CPU, GPU and TPU (operand and result types; a GPU's operands may have their last
    contracting dim zero-padded to a contraction length that is a multiple of 4, as ``int32_dot`` pads it there
    only); returns the CPU program's."""
    by_platform = {platform: dot_eqns(jaxpr, platform=platform) for platform in PLATFORMS}
    types = {platform: [[str(v.aval) for v in (*e.invars, *e.outvars)] for e in dots]
             for platform, dots in by_platform.items()}
    assert types["cpu"] == types["tpu"], types
    assert len(by_platform["cuda"]) == len(by_platform["cpu"]), types
    for gpu, cpu in zip(by_platform["cuda"], by_platform["cpu"]):
        assert [str(v.aval) for v in gpu.outvars] == [str(v.aval) for v in cpu.outvars], types
        assert gpu.params["dimension_numbers"] == cpu.params["dimension_numbers"], types
        (lc, rc), _ = cpu.params["dimension_numbers"]
        for gpu_operand, cpu_operand, contracting in zip(gpu.invars, cpu.invars, (lc, rc)):
            assert gpu_operand.aval.dtype == cpu_operand.aval.dtype, types
            padded = [a for a, (g, c) in enumerate(zip(gpu_operand.aval.shape, cpu_operand.aval.shape)) if g != c]
            assert padded in ([], [contracting[-1]]), types
        if any(g.aval.shape != c.aval.shape for g, c in zip(gpu.invars, cpu.invars)):
            assert math.prod(gpu.invars[0].aval.shape[a] for a in lc) % 4 == 0, types
    return by_platform["cpu"]


def is_max_reduction(eqn) -> bool:
    """Whether ``eqn`` takes maxima: ``reduce_max``, or a ``reduce`` by ``max`` from another initial value (the
    GPU's float64 scales start from the smallest normal float64)."""
    if eqn.primitive.name == "reduce":
        return [e.primitive.name for e in eqn.params["jaxpr"].eqns] == ["max"]
    return eqn.primitive.name == "reduce_max"


def assert_all_dots_int8(jaxpr, expected_count=None):
    """Every dot_general in the program, each platform's branches included, is int8 x int8 -> int32 (optionally:
    exactly ``expected_count`` in the program each of CPU, GPU and TPU runs). Returns the CPU program's dots."""
    for e in dot_eqns(jaxpr):
        dtypes = [str(v.aval.dtype) for v in e.invars]
        assert dtypes == ["int8", "int8"], f"float dot left: {e}"
        assert str(e.outvars[0].aval.dtype) == "int32", f"dot without int32 accumulation: {e}"
    if expected_count is not None:
        for platform in PLATFORMS:
            count = len(dot_eqns(jaxpr, platform=platform))
            assert count == expected_count, f"expected {expected_count} dots on {platform}, found {count}"
    return dot_eqns(jaxpr, platform="cpu")


def platform_eqns(jaxpr, platform: str):
    """The equations of ``jaxpr`` (nested ones included) as ``platform`` (``"cpu"``, ``"cuda"``, ``"tpu"``) compiles
    them: of each ``lax.platform_dependent`` choice (a ``cond`` on a ``platform_index``) only that platform's
    branch, or the default one."""
    return iter_eqns(jaxpr, platform=platform)


def assert_same_bits_but_nan(got, want):
    """``got`` and ``want`` have NaN in the same places and every other value bit for bit (a NaN's sign and payload
    are whatever the arithmetic that made it gives)."""
    got, want = np.asarray(got), np.asarray(want)
    nan_differs = np.isnan(got) != np.isnan(want)
    assert not nan_differs.any(), f"NaN in one but not the other at {np.argwhere(nan_differs)[:5].tolist()}"
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    bits = np.dtype(f"u{got.dtype.itemsize}")
    differ = (got.view(bits) != want.view(bits)) & ~np.isnan(want)
    # which values differ tells why (subnormals flushed, an ulp off, a sign of zero): the first few of them
    assert not differ.any(), (f"{int(differ.sum())} of {got.size} values differ; got {got[differ][:5].tolist()}, "
                              f"want {want[differ][:5].tolist()}")


def assert_close_to_reference(got, want, rtol=1e-6, atol=0.0):
    """Each entry within ``rtol`` relative of the float64 reference (so a zero reference is exactly zero)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def reference_per_tensor_matmul(x, w) -> np.ndarray:
    """Per-tensor contract of ``x @ w`` in float64: one float32 scale per operand, exact int64 sums."""
    x32, w32 = np.asarray(x, np.float32), np.asarray(w, np.float32)
    xq = reference_codes(x32, (0, 1)).astype(np.int64)
    wq = reference_codes(w32, (0, 1)).astype(np.int64)
    sx = np.float64(reference_scales(x32, (0, 1)))
    sw = np.float64(reference_scales(w32, (0, 1)))
    return (xq @ wq) * sx * sw


def reference_block_matmul(x, w, block: int, rhs_limit=127) -> tuple[np.ndarray, np.ndarray]:
    """Block-scaled contract of ``x @ w`` (``x``: (B, K), ``w``: (K, N)) in float64.

    The contraction is zero-padded to a multiple of ``block``; each block has one scale per row of ``x``
    and one per column of ``w``; its exact integer partial sums are scaled and the blocks summed
    (``rhs_limit=7``: 4-bit weight codes).

    Returns:
        ``(y, magnitude)``: the value, and the sum of the blocks' absolute terms (the scale of the float32
        rounding error of summing the scaled partial sums).
    """
    x32, w32 = np.asarray(x, np.float32), np.asarray(w, np.float32)
    k = x32.shape[1]
    pad = -k % block
    x32 = np.pad(x32, ((0, 0), (0, pad)))
    w32 = np.pad(w32, ((0, pad), (0, 0)))
    y = np.zeros((x32.shape[0], w32.shape[1]), np.float64)
    magnitude = np.zeros_like(y)
    for start in range(0, k + pad, block):
        xb, wb = x32[:, start:start + block], w32[start:start + block]
        acc = reference_codes(xb, (1,)).astype(np.int64) @ reference_codes(wb, (0,), rhs_limit).astype(np.int64)
        sx = reference_scales(xb, (1,)).astype(np.float64)
        sw = reference_scales(wb, (0,), rhs_limit).astype(np.float64)
        term = acc * sx[:, None] * sw[None, :]
        y += term
        magnitude += np.abs(term)
    return y, magnitude


def away_from_ties_blocks(x, axis: int, block: int) -> np.ndarray:
    """:func:`away_from_ties` applied block by block along ``axis`` (for block-scaled codes)."""
    x = np.array(x, np.float32)
    for start in range(0, x.shape[axis], block):
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, start + block)
        x[tuple(index)] = away_from_ties(x[tuple(index)], (axis,))
    return x


def float_dot_eqns(jaxpr):
    """The dot_generals of a (nested) program that still have a floating operand."""
    def is_float(dtype):
        return np.issubdtype(dtype, np.inexact) or "float" in str(dtype)  # ml_dtypes' bfloat16 included

    return [e for e in dot_eqns(jaxpr) if any(is_float(v.aval.dtype) for v in e.invars)]


@jax.custom_jvp
def dense_with_custom_jvp(x, w):
    """``x @ w`` behind a user ``custom_jvp`` rule (the product rule), for tests of dots inside custom_jvp."""
    return x @ w  # CJVP


@dense_with_custom_jvp.defjvp
def _dense_jvp(primals, tangents):
    (x, w), (dx, dw) = primals, tangents
    return x @ w, dx @ w + x @ dw


def reference_pack_int4(codes) -> np.ndarray:
    """4-bit codes packed as the documented layout says: element ``2 i`` of the last axis in the low nibble of
    byte ``i``, ``2 i + 1`` in the high one, two's complement; an odd length padded with a zero code."""
    codes = np.asarray(codes, np.int64)
    if codes.shape[-1] % 2:
        codes = np.concatenate([codes, np.zeros((*codes.shape[:-1], 1), np.int64)], axis=-1)
    nibbles = codes & 0xF
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)


def reference_unpack_int4(packed, length: int) -> np.ndarray:
    """The codes of :func:`reference_pack_int4`'s bytes, by integer arithmetic."""
    packed = np.asarray(packed, np.int64)
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return np.where(nibbles > 7, nibbles - 16, nibbles)[..., :length].astype(np.int8)


ROOT = Path(__file__).resolve().parents[2]


def first_device_is(monkeypatch, device) -> None:
    """Make ``jax.devices()`` (no backend named) list ``device`` first, as on a GPU host, for the choices int8ify
    makes from the default device (a fake one: ``platform``, ``compute_capability``, ``device_kind``); the host's
    own devices stay reachable by backend name (``jax.devices("cpu")``, ``jax.default_device``)."""
    real_devices = jax.devices
    monkeypatch.setattr(jax, "devices", lambda *backend: real_devices(*backend) if backend else [device])


def run_fresh_python(code: str, *args) -> str:
    """Run ``code`` in a new Python process (this checkout importable, 8 host CPU devices) and return what it
    printed; a failure shows its stderr. Where this process holds a TPU chip the new one runs on the CPU: a chip
    takes one process at a time."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    if jax.default_backend() == "tpu":
        env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def deploy_model(seed=0, width=256):
    """A small served model, at realistic sizes: ``(fn, params, x)`` with a two-layer MLP of weights, a bias left
    float, and a nested list of layers (so paths hold dict keys and sequence indices)."""
    rng = np.random.default_rng(seed)
    params = {
        "embed": {"w": rng.normal(size=(96, width)).astype(np.float32) / 8,
                  "b": rng.normal(size=width).astype(np.float32)},
        "layers": [{"w": rng.normal(size=(width, width)).astype(np.float32) / 16} for _ in range(2)],
        "head": rng.normal(size=(width, 65)).astype(np.float32) / 16,
    }
    x = rng.normal(size=(32, 96)).astype(np.float32)
    return deploy_fn, params, x


def assert_same_tree(got, want):
    """Same structure (QuantizedArray metadata included), every array bit-identical with the same dtype."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def column_major(tree):
    """Host copies of a pytree's arrays, those of two axes or more column-major (as a TPU hands out an array whose
    last axis is short), the rest as they are."""
    return jax.tree_util.tree_map(lambda a: np.asfortranarray(a) if np.ndim(a) >= 2 else np.asarray(a), tree)


def deploy_fn(params, x):
    """The model :func:`deploy_model` returns."""
    h = jax.nn.relu(x @ params["embed"]["w"] + params["embed"]["b"])
    for layer in params["layers"]:
        h = jax.nn.gelu(h @ layer["w"])
    return h @ params["head"]


def evaluate_as(platform: str, fn, *args, excess_precision: bool = False):
    """``fn(*args)`` computed on this machine's CPU with every ``lax.platform_dependent`` choice made as
    ``platform`` makes it (``"cpu"``, ``"cuda"``, ``"tpu"``): a GPU's or TPU's program run on the CPU (its own
    arithmetic, not the device's), whatever the default device. Under a jit it runs where that jit does: give the
    jit :func:`on_cpu` arguments.

    ``excess_precision``: also do what XLA's GPU compiler does under its default ``xla_allow_excess_precision``
    (its SimplifyFPConversions pass): a chain of float conversions ``A -> B -> C`` becomes ``A -> C``, looking
    through the reshapes, transposes and broadcasts that become bitcasts, so a narrowing that is widened again
    (``float32 -> bfloat16/float16/float8 -> float32``) does not round. ``optimization_barrier``,
    ``reduce_precision`` and a ``bitcast_convert_type`` of the narrow value keep the rounding, as they do on the
    GPU."""
    with every_platform():  # (a new function: JAX's cached traces of ``fn`` may be the default platform's alone)
        closed = jax.make_jaxpr(lambda *values: fn(*values))(*args)
    leaves = jax.tree_util.tree_leaves(args)
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):  # inside a jit: on the device its inputs are on
        return _evaluate_as(platform, closed.jaxpr, closed.consts, leaves, excess_precision, {})
    # on the CPU also where the default device is an accelerator: a TPU has no IEEE float64 (XLA splits it into
    # float32 pairs) and divides approximately, so another platform's program run there would not be that program
    with jax.default_device(CPU):
        return _evaluate_as(platform, closed.jaxpr, on_cpu(closed.consts), on_cpu(leaves), excess_precision, {})


CPU = jax.devices("cpu")[0]
# The device run_fresh_python's process computes on, for ``jax.default_device``: the CPU where this process holds a
# TPU chip, else the default.
FRESH_PROCESS_DEVICE = CPU if jax.default_backend() == "tpu" else None


@contextlib.contextmanager
def ieee_float64():
    """float64 on, and what runs inside on the CPU where the default device is a TPU: XLA:TPU has no IEEE float64
    (it splits each value into a pair of float32s, with float32's exponent range), so int8ify's float64 guarantees
    are the CPU's and GPU's (README, Limitations)."""
    with jax.enable_x64(True), jax.default_device(CPU if jax.default_backend() == "tpu" else None):
        yield


# how far a TPU's float32 division (a multiply by a refined reciprocal) was from the IEEE quotient on a v5e chip:
# 2 ulps, on 20,000 quotients across 120 binades (README, Limitations)
TPU_DIVISION_ULPS = 2


def approximate_division() -> bool:
    """Whether the default device divides float32 approximately (within :data:`TPU_DIVISION_ULPS`) rather than
    correctly rounded, where int8ify keeps the device's own division (a smoothed weight's float value): a TPU."""
    return jax.default_backend() == "tpu"


def assert_within_ulps(got, want, ulps: int):
    """float32 ``got`` at most ``ulps`` float32 values away from ``want`` (NaN where ``want`` is NaN)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)

    def ordinal(v):  # float32s as integers in their order: neighbours differ by one, both zeros are 0
        bits = v.view(np.int32).astype(np.int64)
        return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    nan = np.isnan(want)
    bad = (nan != np.isnan(got)) | (~nan & (np.abs(ordinal(got) - ordinal(want)) > ulps))
    assert not bad.any(), (got[bad][:5], want[bad][:5])


def on_cpu(tree):
    """``tree``'s arrays committed to the CPU, so the computations that take them run there (a jit included), also
    on a machine whose default device is an accelerator."""
    return jax.device_put(tree, CPU)


# ops that XLA turns into bitcasts or that keep each element's value: a conversion chain is seen through them
_VALUE_PRESERVING = {"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "copy"}


def _is_float(dtype) -> bool:
    return np.issubdtype(np.dtype(dtype), np.floating) or "float" in str(dtype)


def _evaluate_as(platform, jaxpr, consts, args, excess_precision=False, unrounded=None):
    env = {}
    # var -> the value before a float conversion chain (what XLA:GPU computes it from under excess precision)
    wide = {}

    def read(v):
        return v.val if hasattr(v, "val") else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    if unrounded:
        wide.update({v: unrounded[i] for i, v in enumerate(jaxpr.invars) if i in unrounded})
    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        passed = {i: wide[v] for i, v in enumerate(eqn.invars) if not hasattr(v, "val") and v in wide}
        if name == "platform_index":
            choices = eqn.params["platforms"]
            named = [i for i, names in enumerate(choices) if names is not None and platform in names]
            outs = [np.int32(named[0] if named else choices.index(None))]
        elif name == "cond":
            branch = eqn.params["branches"][int(values[0])]
            inner = {i - 1: w for i, w in passed.items() if i > 0}
            outs = _evaluate_as(platform, branch.jaxpr, branch.consts, values[1:], excess_precision, inner)
        elif name in ("pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call"):
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr")))
            outs = _evaluate_as(platform, inner.jaxpr, inner.consts, values, excess_precision, passed)
        elif (excess_precision and name == "convert_element_type" and 0 in passed
              and _is_float(eqn.params["new_dtype"])):
            # the chain source -> ... -> this dtype, without the roundings in between
            outs = [eqn.primitive.bind(passed[0], **eqn.params)]
        else:
            outs = eqn.primitive.bind(*values, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        if excess_precision:
            if name == "convert_element_type" and _is_float(eqn.params["new_dtype"]):
                wide[eqn.outvars[0]] = passed.get(0, values[0])
            elif name in _VALUE_PRESERVING and 0 in passed:
                wide[eqn.outvars[0]] = eqn.primitive.bind(passed[0], *values[1:], **eqn.params)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]
