"""One kernel per dot on NVIDIA GPUs: a float activation times an int8 weight (a matrix, or one that flattens to it) as
a single Pallas (Triton) kernel (:mod:`~jaxpr_rewrite._platforms.fused_gpu_kernel`), the ``"int8-fused"`` backend's GPU
program; and one kernel for several such dots of one activation (attention's query, key and value projections).

XLA's GPU compiler cannot put a quantization into its GEMM kernel's prologue: the codes of every dynamic activation
are a kernel of their own (and the absmax a second one, unless it joins the previous epilogue), so the int8
program of the 4 x 1024 MLP launches 13 kernels where bfloat16 launches 7 (``benchmarks/accelerators.py``). The
kernel is the dot's whole program, with the ``"int8"`` backend's numbers bit for bit. This module says which dots
it fits, prepares its operands (a float weight is quantized here), and keeps it working where XLA cannot see into
it: sharded operands stay sharded (``custom_partitioning``) and ``vmap`` batches it (``custom_vmap``).
"""

from __future__ import annotations

import functools

import jax
import jax.custom_batching
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .._numerics.float64_scales import quantize_with_float64_scales
from .fused_gpu_kernel import KernelForm, WeightLayout, contraction_block, kernel_call, operands_per_weight
from .._core.layout import is_static
from .._numerics.quantize import MAX_INT32_SAFE_CONTRACTION
from .._quantized.array import is_quantized

__all__ = ["fits_fused_kernel", "fused_dot", "fused_dots"]

_FLOATS = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


def fits_fused_kernel(lhs, rhs, dimension_numbers) -> bool:
    """Whether :func:`fused_dot` computes this dot: a float activation (at least one row) contracted over its last
    axes, no batch axes, a contraction the int8 tensor cores tile (a multiple of 16) whose int32 sums cannot
    overflow, and on the right a weight contracted over its leading or its trailing axes in the same order (a
    matrix either way round, or Flax's ``DenseGeneral`` kernels, ``(d, heads, head_dim)`` and ``(heads, head_dim,
    d)``): a per-channel int8 one (with a float32 static activation scale, or none), or a float one that the program
    quantizes."""
    (lc, rc), (lb, rb) = dimension_numbers
    shape, count = lhs.shape, len(lc)
    if not all(is_static(d) for d in (*shape, *rhs.shape)):
        return False  # the kernel's grid is laid out when tracing (jax.export's symbolic shapes: the int8 program)
    if is_quantized(rhs):
        fits_rhs = rhs.codes.dtype == np.int8 and (rhs.activation_scale is None
                                                   or rhs.activation_scale.dtype == np.float32)
    else:
        fits_rhs = np.dtype(rhs.dtype) in _FLOATS
    k = int(np.prod(shape[len(shape) - count:], dtype=np.int64))
    return (fits_rhs and not lb and not rb and 0 < count < rhs.ndim and np.dtype(lhs.dtype) in _FLOATS
            and tuple(lc) == tuple(range(len(shape) - count, len(shape)))
            and tuple(rc) in (tuple(range(count)), tuple(range(rhs.ndim - count, rhs.ndim)))
            and int(np.prod(shape[:len(shape) - count], dtype=np.int64)) > 0 and 0 not in rhs.shape
            and k <= MAX_INT32_SAFE_CONTRACTION and contraction_block(k) is not None)


def fused_dot(x, weight, weight_contracting, interpret: bool = False):
    """``x @ weight`` under the int8 contract as one kernel (see the module docstring).

    Under ``jit`` with sharded operands the kernel runs on each device's rows of ``x`` and columns of the weight
    (a sharded contraction is gathered first: a row's absmax needs all of it), and the result keeps that sharding;
    XLA would otherwise gather the whole activation onto every device and replicate the result.

    Arguments:
        x: the float activation, contracted over its last axes (as many as the weight's; any leading shape).
        weight: a per-channel int8 :class:`~jaxpr_rewrite.quantized.QuantizedArray` (as
            :meth:`~jaxpr_rewrite.quantized.QuantizedArray.dot_operand` gives it); with an ``activation_scale``, the
            activation takes that calibrated scale, else the contract's dynamic one per row. Or a float array,
            quantized here as the ``"int8"`` backend quantizes it on a GPU, its float64 scale per column read by the
            epilogue (:func:`~jaxpr_rewrite._numerics.float64_scales.quantize_with_float64_scales`).
        weight_contracting: the weight's contracting axes (an int: one), its leading ones (``x @ w``) or its
            trailing ones (``x @ w.T``), in order.
        interpret: run the kernel with Pallas' interpreter (any platform; for tests).

    Returns:
        float32, ``x``'s leading shape followed by the weight's free axes.
    """
    return fused_dots(x, (weight,), (weight_contracting,), interpret)[0]


def fused_dots(x, weights, weight_contractings, interpret: bool = False) -> tuple:
    """``x @ weight`` for each of several weights, as one kernel: the column blocks of every result in one grid,
    each block quantizing ``x``'s rows as :func:`fused_dot` does (with its own weight's static scale, if any). The
    program of sibling dots such as attention's query, key and value projections: one launch where each dot alone
    is one, and the codes and results are those of :func:`fused_dot`.

    Arguments:
        x: the float activation.
        weights: the weights, each as :func:`fused_dot` takes it.
        weight_contractings: each weight's contracting axes, as :func:`fused_dot` takes them (as many for each).
        interpret: run the kernel with Pallas' interpreter.

    Returns:
        A tuple of float32 results.
    """
    contractions = [(c,) if isinstance(c, int) else tuple(c) for c in weight_contractings]
    count = len(contractions[0])
    leading_shape = x.shape[:x.ndim - count]
    k = int(np.prod(x.shape[x.ndim - count:], dtype=np.int64))
    layouts, operands, free_shapes = [], [], []
    for weight, contracting in zip(weights, contractions):
        rows_contract = contracting == tuple(range(count))
        free_shape = weight.shape[count:] if rows_contract else weight.shape[:weight.ndim - count]
        n = int(np.prod(free_shape, dtype=np.int64))
        if is_quantized(weight):
            codes, columns = weight.codes, weight.epilogue_factors(np.float32)
            static = () if weight.activation_scale is None else (
                lax.convert_element_type(weight.activation_scale, np.float32),)
        else:  # its float64 scale per column, read by the epilogue as the int8 backend's GPU program reads it
            codes, _, _, weight_scale = quantize_with_float64_scales(weight, contracting)
            columns, static = (weight_scale,), ()
        layouts.append(WeightLayout(rows_contract, len(columns) == 1, bool(static)))
        operands += [codes.reshape((k, n) if rows_contract else (n, k)), *(c.reshape(n) for c in columns), *static]
        free_shapes.append(free_shape)
    outs = _batchable_kernel(KernelForm(tuple(layouts), interpret))(x.reshape(-1, k), *operands)
    return tuple(out.reshape(*leading_shape, *free) for out, free in zip(outs, free_shapes))


# -- sharding: rows of x and columns of the weight stay where they are, the contraction is gathered -------------
def _mesh_axes(sharding, dim: int) -> tuple:
    """The mesh axes dimension ``dim`` of an operand is sharded over (none for a dimension past its spec)."""
    spec = tuple(sharding.spec)
    entry = spec[dim] if dim < len(spec) else None
    return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


def _shardings(form: KernelForm, mesh, arg_shapes):
    """The operands' and the results' shardings: ``x``'s rows and each weight's columns as they are (a columns'
    axis that the rows use too is dropped: a result holds each axis once), everything else whole."""
    rows = _mesh_axes(arg_shapes[0].sharding, 0)
    named = functools.partial(NamedSharding, mesh)
    args, results = [named(P(rows or None, None))], []
    for weight, (codes, *_) in zip(form.weights, operands_per_weight(form.weights, arg_shapes[1:])):
        columns = _mesh_axes(codes.sharding, 1 if weight.rows_contract else 0)
        columns = None if set(rows) & set(columns) or not columns else columns
        args += [named(P(None, columns) if weight.rows_contract else P(columns, None)),
                 *(named(P(columns)) for _ in range(weight.columns)), *([named(P())] if weight.static else [])]
        results.append(named(P(rows or None, columns)))
    return args, tuple(results)


def _infer_sharding(form, mesh, arg_shapes, result_shape):
    return _shardings(form, mesh, arg_shapes)[1]


def _partition(form, mesh, arg_shapes, result_shape):
    args, results = _shardings(form, mesh, arg_shapes)
    return mesh, functools.partial(kernel_call, form), results, tuple(args)


def _sharding_rule(form, mesh, arg_shapes, result_shape):
    """Shardy's rule: rows ``m`` and each weight's columns ``n<i>`` pass through, the contraction ``k`` (and a
    static scale's fields ``s<i>``) must be whole on each device."""
    operands, results, whole = [ArrayMapping("m", "k")], [], ["k"]
    for i, weight in enumerate(form.weights):
        n = f"n{i}"
        operands += [ArrayMapping("k", n) if weight.rows_contract else ArrayMapping(n, "k"),
                     *(ArrayMapping(n) for _ in range(weight.columns))]
        if weight.static:
            operands.append(ArrayMapping(f"s{i}"))
            whole.append(f"s{i}")
        results.append(ArrayMapping("m", n))
    return SdyShardingRule(tuple(operands), tuple(results), need_replication_factors=tuple(whole))


@functools.partial(custom_partitioning, static_argnums=(0,))
def _partitioned_kernel(form, *operands):
    return kernel_call(form, *operands)


_partitioned_kernel.def_partition(partition=_partition, infer_sharding_from_operands=_infer_sharding,
                                  sharding_rule=_sharding_rule)


# -- vmap: custom_partitioning has no batching rule ---------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _batchable_kernel(form: KernelForm):
    """The partitioned kernel for ``form``, under ``vmap`` too: a batch of activations is more rows (one call, the
    partitioning kept); a batch of weights, a batched Pallas call (its own rule adds a grid axis)."""

    @jax.custom_batching.custom_vmap
    def kernel(*operands):
        return _partitioned_kernel(form, *operands)

    @kernel.def_vmap
    def _batched(axis_size, in_batched, *operands):
        x, *weight_operands = operands
        out_batched = (True,) * len(form.weights)
        if not any(in_batched[1:]):
            outs = kernel(x.reshape(-1, x.shape[-1]), *weight_operands)
            return tuple(out.reshape(axis_size, x.shape[1], out.shape[-1]) for out in outs), out_batched
        operands = [v if batched else jnp.broadcast_to(v, (axis_size, *v.shape))
                    for v, batched in zip(operands, in_batched)]
        return jax.vmap(functools.partial(kernel_call, form))(*operands), out_batched

    return kernel
