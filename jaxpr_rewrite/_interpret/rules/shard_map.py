"""``shard_map``: the body is rewritten in the mesh's axis environment, as ``shard_map`` itself traces it; a
pre-quantized weight is carried into the body, each of its arrays sharded like the float weight's axes it runs over
(as :func:`~jaxpr_rewrite.checkpoint.sharded_like` places them), so the body's dots read its codes."""

from __future__ import annotations

import numpy as np
import jax
from jax.sharding import PartitionSpec
from ... import _compat
from ..._core.errors import Int8ifyError
from ..._core.source import describe_source
from ..._quantized.array import ARRAY_FIELDS, FIELD_AXES, is_quantized
from .calls import follow_call
from .common import materialised
from .registry import RuleContext, register

__all__ = []


def _shard_map_rule(context: RuleContext, params: dict) -> dict:
    new_params = dict(params)
    new_params["jaxpr"] = context.swap(params["jaxpr"], context=_compat.shard_map_body_context(params))
    return new_params


def _shard_map_quantized(context: RuleContext, eqn, invals):
    """``jax.shard_map`` again, each pre-quantized operand passed as its arrays (sharded per :func:`_child_specs`)
    and rebuilt in the body with the metadata of its shard."""
    p = eqn.params
    flat, specs, rebuilds = [], [], []
    for value, spec in zip(invals, p["in_specs"]):
        if is_quantized(value):
            child_specs, local = _child_specs(value, spec, p["mesh"], eqn, context)
            children = [getattr(value, name) for name in ARRAY_FIELDS]
            rebuilds.append((len(flat), len(children), local))
            flat += children
            specs += child_specs
        else:
            rebuilds.append((len(flat), None, None))
            flat.append(value)
            specs.append(spec)
    jaxpr = p["jaxpr"]

    def body(*values):
        operands = [values[start] if count is None else
                    type(local).tree_unflatten(local.tree_flatten()[1], values[start:start + count])
                    for start, count, local in rebuilds]
        return tuple(materialised(context.interpret(jaxpr, [], operands)))

    mapped = jax.shard_map(body, mesh=p["mesh"], in_specs=tuple(specs), out_specs=tuple(p["out_specs"]),
                           axis_names=_compat.shard_map_manual_axes(p), check_vma=p["check_vma"])
    return list(mapped(*flat))


def _child_specs(value, spec: PartitionSpec, mesh, eqn, context: RuleContext):
    """The spec of each of a pre-quantized weight's arrays (:data:`~jaxpr_rewrite._quantized.array.ARRAY_FIELDS`,
    ``None`` for an absent one) from the float weight's ``spec``: codes like it, each other array like the weight's axes
    it runs over (:data:`~jaxpr_rewrite._quantized.array.FIELD_AXES`; a static scale replicated); and the weight as one
    shard of it (a 4-bit weight's unpacked length is its shard's)."""
    entries = (*spec, *(None,) * (value.ndim - len(spec)))
    sizes = [int(np.prod([mesh.shape[n] for n in ((e,) if isinstance(e, str) else e or ())])) for e in entries]
    where = describe_source(eqn, context.where)
    if value.block_size is not None and any(sizes[a] > 1 for a in value.contracting):
        raise Int8ifyError(f"shard_map at {where} splits the contracting axes of a block-scaled weight ({value!r}), "
                           "whose blocks run over the whole contraction: shard its other axes, or pass it float")
    local = value
    if value.bits != 8:
        if (value.length // sizes[-1]) % 2 and sizes[-1] > 1:
            raise Int8ifyError(f"shard_map at {where} splits the packed last axis of a 4-bit weight ({value!r}) into "
                               f"shards of {value.length // sizes[-1]} columns, an odd number: two columns share a "
                               "byte; shard it so that each device holds an even number of columns, or pass it float")
        local = value.replace(length=value.length // sizes[-1])
    specs = []
    for name in ARRAY_FIELDS:
        child = getattr(value, name)
        axes = FIELD_AXES[name](value) if name in FIELD_AXES else ()
        specs.append(None if child is None else PartitionSpec(*(entries[a] if a is not None else None for a in axes)))
    return specs, local


register("shard_map", subjaxprs=("jaxpr",), rewrite=_shard_map_rule, quantized=_shard_map_quantized,
         follow=follow_call)
