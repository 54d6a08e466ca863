"""Calls to PyTorch's private attention ops by argument name, bound against the op's schema in
the running torch: the positional order of ``aten::_scaled_dot_product_cudnn_attention`` and
its backward changed between releases (an ``attn_bias`` and ``compute_log_sumexp`` came in,
the backward gained its cumulative-length arguments), so a positional call is right for one
release's schema only. :func:`bind` builds the call from the names; :func:`binds` is the
feature test a backend's selection asks (every argument the schema requires has a value).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch


def schema_of(name: str):
    """The schema of ``aten::name`` (its default overload) in this torch, or None."""
    packet = getattr(torch.ops.aten, name, None)
    try:
        return packet.default._schema if packet is not None else None
    except (AttributeError, RuntimeError):
        return None


def bind(schema, values: Dict[str, Any], optional: Dict[str, Any] = None) -> Tuple[list, dict]:
    """``(args, kwargs)`` for ``schema`` from ``values`` (every one must be an argument of the
    schema) and ``optional`` (used where the schema has the argument, dropped where it does
    not: a default this release does not take). A schema argument with neither a value nor a
    default raises TypeError naming it; one with a default and no value takes its default."""
    names = {a.name for a in schema.arguments}
    given = {k: v for k, v in (optional or {}).items() if k in names}
    given.update(values)
    unknown = set(values) - names
    if unknown:
        raise TypeError(f"aten::{schema.name}: this torch's schema has no argument "
                        f"{sorted(unknown)} ({schema})")
    args, kwargs = [], {}
    for a in schema.arguments:
        if a.name in given:
            v = given[a.name]
        elif a.default_value is not None or a.type.kind() == "OptionalType":
            if a.kwarg_only:
                continue
            v = a.default_value
        else:
            raise TypeError(f"aten::{schema.name}: no value for its argument {a.name!r} "
                            f"({schema})")
        (kwargs.__setitem__(a.name, v) if a.kwarg_only else args.append(v))
    return args, kwargs


def binds(schema, values, optional=None) -> bool:
    """Whether :func:`bind` can call ``schema`` with these names (the values are not used)."""
    if schema is None:
        return False
    try:
        bind(schema, dict.fromkeys(values), dict.fromkeys(optional or ()))
    except TypeError:
        return False
    return True


def call(name: str, values: Dict[str, Any], optional: Optional[Dict[str, Any]] = None):
    """``torch.ops.aten.name(...)`` bound by argument name (:func:`bind`)."""
    args, kwargs = bind(schema_of(name), values, optional)
    return getattr(torch.ops.aten, name)(*args, **kwargs)
