"""Module classes of flax linen, flax nnx and equinox, and what their attributes hold.

``self.<attr>`` inside such a module has a kind the class declares:

* linen: dataclass fields are config (static); ``self.param(...)``/``self.variable(...)`` assigned
  in ``setup`` are traced; anything else is config too (submodules, static settings);
* nnx: attributes assigned in ``__init__`` from ``nnx.Param``/``nnx.Variable``/... are Variables
  (their ``.value`` and ``[...]`` are traced arrays, their truthiness is static); from literals,
  or from ``__init__`` parameters with a Python-type annotation or a literal default, static;
  anything else unknown;
* equinox: fields annotated with an array type (``jax.Array``, ``Float[Array, ...]``) are traced;
  ``eqx.field(static=True)`` and Python-type annotations (``int``, ``Callable``, ``tuple[int, ...]``)
  static; anything else unknown.

Attributes of module classes of this file that a class derives from are inherited.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import libcst as cst

from .aliases import dotted_name
from .annotations import AnnotationReader
from .call_args import kwarg
from .cstwalk import iter_children
from .kinds import STATIC, TRACED, UNKNOWN, VARIABLE, join
from .module_info import ClassInfo, FuncInfo, ModuleInfo, named_params
from .names import ENUM_BASES, EQUINOX, EQUINOX_FIELD, EQUINOX_STATIC_FIELD, LINEN, MODULE_BASES, NNX, NNX_VARIABLES

__all__ = ["attribute_kind", "resolve_classes"]

# what ``self.<attr>`` is when the class says nothing about ``attr``
_DEFAULT_ATTR_KIND = {LINEN: STATIC, NNX: UNKNOWN, EQUINOX: UNKNOWN}
# linen's collection of all variables is traced, whatever the class declares
_LINEN_TRACED_ATTRS = {"variables": TRACED}
_LITERALS = (cst.Integer, cst.Float, cst.SimpleString, cst.ConcatenatedString)


def resolve_classes(info: ModuleInfo) -> None:
    """Set ``framework`` and ``is_enum`` of every class, following bases through classes of this file."""
    by_name = info.classes_by_name
    changed = True
    while changed:
        changed = False
        for c in info.classes:
            if c.framework is not None and c.is_enum:
                continue
            for raw in c.base_names:
                q = info.imports.resolve_dotted(raw)
                local = by_name.get(raw)
                framework = MODULE_BASES.get(q) if q is not None else (local.framework if local else None)
                if framework is not None and c.framework is None:
                    c.framework = framework
                    changed = True
                if not c.is_enum and (q in ENUM_BASES or (local is not None and local.is_enum)):
                    c.is_enum = True
                    changed = True


def attribute_kind(cls: ClassInfo, attr: str, info: ModuleInfo) -> int:
    """The kind of ``self.<attr>`` inside a method of the module class ``cls``."""
    kinds = _attr_kinds(cls, info, ())
    k = kinds.get(attr)
    if k is not None:
        return k
    return _DEFAULT_ATTR_KIND.get(cls.framework or "", UNKNOWN)


def _attr_kinds(cls: ClassInfo, info: ModuleInfo, seen: Sequence[str]) -> Dict[str, int]:
    if cls.attr_kinds is not None:
        return cls.attr_kinds
    kinds: Dict[str, int] = {}
    for raw in cls.base_names:
        base = info.classes_by_name.get(raw)
        if base is not None and base.framework is not None and base.name not in seen:
            kinds.update(_attr_kinds(base, info, (*seen, cls.name)))
    reader = AnnotationReader.of(info)
    if cls.framework == EQUINOX:
        for field in cls.fields:
            kinds[field.target.value] = _equinox_field_kind(field, reader, info)  # type: ignore[attr-defined]
    elif cls.framework == LINEN:
        kinds.update(_LINEN_TRACED_ATTRS)
        setup = cls.methods.get("setup")
        if setup is not None:
            kinds.update(_self_assignments(setup, _linen_value_kind))
    elif cls.framework == NNX:
        init = cls.methods.get("__init__")
        if init is not None:
            params = _static_params(init, reader)
            kinds.update(_self_assignments(init, lambda value: _nnx_value_kind(value, params, info)))
    cls.attr_kinds = kinds
    return kinds


def _equinox_field_kind(field: cst.AnnAssign, reader: AnnotationReader, info: ModuleInfo) -> int:
    value = field.value
    if isinstance(value, cst.Call):
        q = info.imports.resolve(value.func)
        static = kwarg(value, "static")
        if q == EQUINOX_STATIC_FIELD or (q == EQUINOX_FIELD and isinstance(static, cst.Name)
                                         and static.value == "True"):
            return STATIC
    k = reader.kind(field.annotation)
    return UNKNOWN if k is None else k


def _static_params(init: FuncInfo, reader: AnnotationReader) -> Dict[str, int]:
    """``__init__`` parameters known to hold Python values: annotated with a Python type, or with a
    literal default."""
    out: Dict[str, int] = {}
    for p in named_params(init.node.params):
        k = reader.kind(p.annotation)
        if k == STATIC or (k is None and p.annotation is None and _is_literal(p.default)):
            out[p.name.value] = STATIC
    return out


def _is_literal(node: Optional[cst.BaseExpression]) -> bool:
    if isinstance(node, _LITERALS):
        return True
    if isinstance(node, cst.Name):
        return node.value in ("True", "False")
    if isinstance(node, cst.UnaryOperation):
        return _is_literal(node.expression)
    return False


def _linen_value_kind(value: cst.BaseExpression) -> Optional[int]:
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) \
            and isinstance(value.func.value, cst.Name) and value.func.value.value == "self" \
            and value.func.attr.value in ("param", "variable"):
        return TRACED
    return None


def _nnx_value_kind(value: cst.BaseExpression, static_params: Dict[str, int], info: ModuleInfo) -> Optional[int]:
    if isinstance(value, cst.Name) and value.value == "None":
        return None  # ``self.bias = None`` says nothing about the other branch
    if isinstance(value, cst.IfExp):
        kinds = [k for k in (_nnx_value_kind(v, static_params, info) for v in (value.body, value.orelse))
                 if k is not None]
        return join(*kinds) if len(kinds) == 2 else (kinds[0] if kinds else None)
    if isinstance(value, cst.Call):
        return VARIABLE if info.imports.resolve(value.func) in NNX_VARIABLES else UNKNOWN
    if _is_python_value(value, static_params):
        return STATIC
    return UNKNOWN


def _is_python_value(value: cst.BaseExpression, static_params: Dict[str, int]) -> bool:
    """A literal, a static parameter, or arithmetic/tuples of those."""
    if _is_literal(value):
        return True
    if isinstance(value, cst.Name):
        return value.value in static_params
    if isinstance(value, cst.BinaryOperation):
        return _is_python_value(value.left, static_params) and _is_python_value(value.right, static_params)
    if isinstance(value, (cst.Tuple, cst.List)):
        return all(_is_python_value(el.value, static_params) for el in value.elements)
    return False


def _self_assignments(method: FuncInfo,
                      value_kind: Callable[[cst.BaseExpression], Optional[int]]) -> Dict[str, int]:
    """``self.<attr> = value`` anywhere in ``method``'s own body (not nested functions), each
    attribute's kind joined over its assignments; ``value_kind(value)`` says ``None`` to skip one."""
    out: Dict[str, int] = {}
    stack: List[cst.CSTNode] = [method.node.body]
    while stack:
        node = stack.pop()
        if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.BaseExpression)):
            continue
        if isinstance(node, (cst.Assign, cst.AnnAssign)):
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            value = node.value
            for target in targets:
                raw = dotted_name(target)
                if value is None or raw is None or not raw.startswith("self.") or raw.count(".") != 1:
                    continue
                k = value_kind(value)
                if k is not None:
                    attr = raw[len("self."):]
                    out[attr] = join(out[attr], k) if attr in out else k
            continue
        stack.extend(iter_children(node))
    return out
