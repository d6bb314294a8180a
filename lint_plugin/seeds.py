"""The kind each parameter of a traced function starts with.

A parameter is traced unless something says otherwise: the transform's arguments (see
:class:`~lint_plugin.module_info.RootSpec`), a default value (almost always config:
``axis=-1``, ``eps=1e-6``), a non-array annotation (see :mod:`lint_plugin.annotations`), its use
as metadata in the body (a collective's axis name, a sharding: see
:data:`~lint_plugin.names.METADATA_ARGS`), or the kinds every call site passes (a helper's
parameter is traced when some caller passes a traced value).
"""

from __future__ import annotations

from typing import Dict, Optional, Set

import libcst as cst

from .annotations import AnnotationReader
from .kinds import MODULE_SELF, STATIC, TRACED, UNKNOWN, merge_seed
from .module_info import FuncInfo, ModuleInfo, RootSpec
from .names import METADATA_ARGS

__all__ = ["ParamSeeds"]


class ParamSeeds:
    """Initial environments of the functions of one file."""

    def __init__(self, info: ModuleInfo) -> None:
        self.info = info
        self.annotations = AnnotationReader.of(info)
        self.metadata: Dict[int, Set[str]] = {}  # per function: its parameters used as metadata

    def _metadata_params(self, fi: FuncInfo) -> Set[str]:
        """Names the body of ``fi`` passes as mesh-axis names or shardings (``lax.psum(x, axis_names)``,
        ``NamedSharding(mesh, spec)``): Python values, whatever the callers pass."""
        found = self.metadata.get(id(fi))
        if found is None:
            found = set()
            for call in fi.calls:
                q = self.info.imports.resolve(call.func)
                spec = METADATA_ARGS.get(q) if q is not None else None
                if spec is None:
                    continue
                for i, a in enumerate(a for a in call.args if a.keyword is None and not a.star):
                    if (spec.all_positional or i in spec.positions) and isinstance(a.value, cst.Name):
                        found.add(a.value.value)
                for a in call.args:
                    if a.keyword is not None and a.keyword.value in spec.keywords and isinstance(a.value, cst.Name):
                        found.add(a.value.value)
            self.metadata[id(fi)] = found
        return found

    def initial_env(self, fi: FuncInfo) -> Dict[str, int]:
        env: Dict[str, int] = dict(fi.closure_env) if fi.closure_env else {}
        params = fi.node.params
        module_self = fi.cls is not None and fi.cls.framework is not None
        for i, p in enumerate(fi.params):
            name = p.name.value
            if i == 0 and fi.method_of is not None and name in ("self", "cls"):
                env[name] = MODULE_SELF if module_self else UNKNOWN
                continue
            env[name] = self._param_kind(fi, i, p)
        for p in params.kwonly_params:
            env[p.name.value] = self._param_kind(fi, None, p)
        for star in (params.star_arg, params.star_kwarg):
            if isinstance(star, cst.Param):
                env[star.name.value] = UNKNOWN
        if module_self and fi.method_of is None and "self" not in env:
            env["self"] = MODULE_SELF  # a function nested in a module method sees its ``self``
        return env

    def _param_kind(self, fi: FuncInfo, index: Optional[int], param: cst.Param) -> int:
        """Merged over the roots that trace ``fi`` (positional ``index``, None for keyword-only) and
        the kinds call sites passed; a non-array annotation has the last word."""
        if param.name.value in self._metadata_params(fi):
            return STATIC
        kind: Optional[int] = None
        for spec in fi.roots:
            kind = merge_seed(kind, _root_param_kind(spec, index, param, len(fi.params)))
        seeded = fi.seed.get(param.name.value)
        if seeded is not None:
            kind = merge_seed(kind, seeded)
        annotated = self.annotations.kind(param.annotation)
        if annotated is not None and annotated != TRACED:
            return STATIC if kind == STATIC else annotated
        return UNKNOWN if kind is None else kind


def _root_param_kind(spec: RootSpec, index: Optional[int], p: cst.Param, positional: int) -> int:
    """``p`` is the ``index``-th of ``positional`` positional parameters (``index`` None: keyword-only)."""
    name = p.name.value
    if (index is not None and index < spec.bound_pos) or name in spec.static_names:
        return STATIC
    if index is not None and spec.sig.params == "trailing" and index < positional - 2:
        return STATIC  # the ``nondiff_argnums`` values a custom_vjp ``bwd``/custom_jvp ``jvp`` takes first
    if spec.all_unknown:
        return UNKNOWN
    if index is not None:
        arg = index - spec.bound_pos  # the transform numbers the arguments left after partial's
        if arg in spec.static_nums:
            return STATIC
        if arg in spec.unknown_nums or (spec.traced_nums is not None and arg not in spec.traced_nums):
            return UNKNOWN
    elif spec.traced_nums is not None:
        return UNKNOWN
    if p.default is not None:
        return UNKNOWN  # defaults are almost always config (axis=-1, eps=1e-6, dtype=...)
    return TRACED
