"""Dots that quantize a large argument on every call where the dot cannot pay for it: a float KV cache read by a
decode step's attention, float weights passed to a jitted step at a small batch.

Quantizing an operand with dynamic scales reads it twice (its absmax, then its codes) and writes its codes, which the
int8 dot reads again: about 2.5 times the bytes the float dot reads (3 times for bfloat16). That is paid back only
where the dot is bound by its arithmetic, not by reading that operand: it multiplies each of the operand's values by
``2 * rows`` flops, ``rows`` being the other operand's rows per batch element (a decode step's attention: a group of
query heads, 4 or 8; a Dense layer: the batch). On a TPU v5e (197 bf16 TFLOP/s over 819 GB/s of HBM) a dot of fewer
than about 240 rows is bound by reading its operands; a Llama-3-8B-shaped decode step whose attention re-quantized its
bfloat16 KV cache on every token ran at 0.43-0.64 times bfloat16's speed on that chip. The fix is to quantize such an
array once: :func:`~jaxpr_rewrite.quantize_cache` for a KV cache, :func:`~jaxpr_rewrite.quantize_params` for weights.
"""

from __future__ import annotations

import dataclasses
import math

from .._core.jaxprs import VALUE_MOVING_PRIMITIVES, forward_jaxprs, is_float_dot, matmul_dimension_numbers
from .._core.layout import contraction_size, is_static
from .._core.scopes import join_scope
from .._core.source import UNKNOWN, Location, describe_source, eqn_location
from .config import RewriteConfig
from .rules.dots import skip_reason

__all__ = ["MEMORY_BOUND_ROWS", "REQUANTIZED_ELEMENTS", "RequantizedArgument", "requantized_arguments"]

# An argument this large (values) quantized on every call is worth a warning: 2 MiB of bfloat16, far more than the
# dot's other costs at a decode step's sizes; smaller ones cost microseconds.
REQUANTIZED_ELEMENTS = 2**20
# Rows per batch element below which a dot is bound by reading its operands on every accelerator and CPU measured
# (a TPU v5e's balance is about 240 bf16 flops per byte, an H200's 500; XLA:CPU's int8 dots are memory-bound still
# lower): there quantizing an operand per call costs more than the int8 dot saves.
MEMORY_BOUND_ROWS = 256

# primitives whose first operand's values reach their output where they are not overwritten: a cache written into
_WRITES_INTO_FIRST = frozenset({"dynamic_update_slice", "scatter"})


@dataclasses.dataclass(frozen=True)
class RequantizedArgument:
    """A rewritten dot that quantizes (part of) an argument of the program on every call, at too few rows to pay.

    Attributes:
        eqn: the ``dot_general`` equation.
        where: its user source.
        operand: 0 or 1, the side of the dot that reads the argument.
        argument: the index of the argument among the program's inputs.
        shape: the dot operand's shape.
        rows: the other operand's rows per batch element.
    """

    eqn: object
    where: Location
    operand: int
    argument: int
    shape: tuple
    rows: int

    def message(self, argument: str) -> str:
        """The warning, ``argument`` naming the argument (its path among the call's arguments)."""
        aval = self.eqn.invars[self.operand].aval
        mib = math.prod(self.shape) * aval.dtype.itemsize / 2**20
        return (f"the {self.eqn.primitive.name} at {describe_source(self.eqn, self.where)} quantizes the argument "
                f"{argument} ({aval.str_short()}, {mib:.0f} MiB) on every call, and multiplies each of its values by "
                f"only {self.rows} row(s) of its other operand: reading it to quantize it costs more than the int8 "
                f"dot saves, so this dot runs slower than in float. Quantize it once and pass it quantized: "
                f"quantize_cache(...) for a KV cache, quantize_params(...) for weights; or keep the dot float with "
                f"skip=[...] or skip_if")


def requantized_arguments(jaxpr, config: RewriteConfig, float_arguments) -> list[RequantizedArgument]:
    """The rewritten dots of ``jaxpr`` that quantize, on every call, at least :data:`REQUANTIZED_ELEMENTS` values of
    one of its ``float_arguments`` (indices of its inputs; pre-quantized ones are not), reached through moves, slices
    and writes into it, nested calls and loops included, with fewer than :data:`MEMORY_BOUND_ROWS` rows on the other
    side."""
    origin = {var: index for index, var in enumerate(jaxpr.invars) if index in set(float_arguments)}
    found: list = []
    _walk(jaxpr, origin, config, "", UNKNOWN, found)
    return found


def _walk(jaxpr, origin: dict, config: RewriteConfig, scope: str, where: Location, found: list) -> None:
    for eqn in jaxpr.eqns:
        here = join_scope(scope, eqn.source_info.name_stack)
        name = eqn.primitive.name
        reads = [origin.get(v) if not hasattr(v, "val") else None for v in eqn.invars]
        if is_float_dot(eqn):
            if skip_reason(eqn, config, here) is None:
                found += _requantized(eqn, reads, eqn_location(eqn, where))
            continue
        if reads and reads[0] is not None and (name in VALUE_MOVING_PRIMITIVES or name in _WRITES_INTO_FIRST):
            origin[eqn.outvars[0]] = reads[0]
        for sub in forward_jaxprs(eqn):
            # a nested program's inputs are the equation's last operands (a call's all of them, a loop body's its
            # consts and carries, a cond branch's all but the index)
            sub_origin = {inner: reads[len(reads) - len(sub.invars) + i]
                          for i, inner in enumerate(sub.invars) if len(sub.invars) <= len(reads)}
            _walk(sub, {v: a for v, a in sub_origin.items() if a is not None}, config, here,
                  eqn_location(eqn, where), found)


def _requantized(eqn, reads, where: Location) -> list[RequantizedArgument]:
    (lc, rc), (lb, rb) = matmul_dimension_numbers(eqn)
    found = []
    for side, (contracting, batch) in enumerate(((lc, lb), (rc, rb))):
        argument = reads[side]
        shape = tuple(eqn.invars[side].aval.shape)
        other = tuple(eqn.invars[1 - side].aval.shape)
        if argument is None or not all(is_static(d) for d in (*shape, *other)):
            continue
        other_contracting, other_batch = ((rc, rb) if side == 0 else (lc, lb))
        rows = math.prod(other) // max(1, contraction_size(other, other_contracting) * contraction_size(
            other, other_batch))
        if math.prod(shape) >= REQUANTIZED_ELEMENTS and rows < MEMORY_BOUND_ROWS:
            found.append(RequantizedArgument(eqn, where, side, argument, shape, rows))
    return found
