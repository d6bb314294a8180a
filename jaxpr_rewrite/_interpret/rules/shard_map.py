"""``shard_map``: the body is rewritten in the mesh's axis environment, as ``shard_map`` itself traces it."""

from __future__ import annotations

from ... import _compat
from .registry import RuleContext, register

__all__ = []


def _shard_map_rule(context: RuleContext, params: dict) -> dict:
    new_params = dict(params)
    new_params["jaxpr"] = context.swap(params["jaxpr"], context=_compat.shard_map_body_context(params))
    return new_params


register("shard_map", subjaxprs=("jaxpr",), rewrite=_shard_map_rule)
