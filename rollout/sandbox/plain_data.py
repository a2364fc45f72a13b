"""Plain data across the sandbox boundary: JSON with a few tags, decoded strictly into built-in values.

What a sandboxed program returns reaches the grader only as text in this format, so no object of the
program's (custom `__eq__`, `__bool__`, `__hash__`...) ever exists on the trusted side:

  None, bool, int, str, list   as JSON
  float                        as JSON; {"$float": "nan" | "inf" | "-inf"} for the others
  tuple, set, frozenset        {"$tuple": [...]}, {"$set": [...]}, {"$frozenset": [...]}
  dict                         {"$dict": [[key, value], ...]} (keys of any plain hashable type)

`encode` accepts exactly these types, plus the float, int and str subclasses of numpy (converted by the
base type's own methods, never the object's), and raises `NotPlain` for anything else. `decode` builds
only built-in values and refuses every other shape. stdlib only: the sandbox harness imports it too.
"""

from __future__ import annotations

import json
import math

MAX_DEPTH = 100
_TAGS = ("$float", "$tuple", "$set", "$frozenset", "$dict")


class NotPlain(ValueError):
    """A value outside the plain-data format; `type_name` names the offending type."""

    def __init__(self, type_name: str):
        super().__init__(f"not plain data: {type_name}")
        self.type_name = type_name


_CONTAINERS = (list, tuple, set, frozenset, dict)


def _base(value):
    """The built-in value behind a scalar: exact types as they are; numpy scalars that subclass a built-in
    type converted to it; NotImplemented for anything else."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind.__module__ == "numpy":
        for base in (float, int, str):
            if isinstance(value, base):
                return base(value)
    return NotImplemented


def to_jsonable(value, depth: int = 0):
    if depth > MAX_DEPTH:
        raise NotPlain(f"nesting deeper than {MAX_DEPTH}")
    kind = type(value)
    if kind not in _CONTAINERS:
        base = _base(value)
        if base is NotImplemented:
            raise NotPlain(kind.__qualname__)
        value, kind = base, type(base)
    if kind is float and not math.isfinite(value):
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [to_jsonable(v, depth + 1) for v in value]
    if kind is dict:
        return {"$dict": [[to_jsonable(k, depth + 1), to_jsonable(v, depth + 1)] for k, v in value.items()]}
    tag = {tuple: "$tuple", set: "$set", frozenset: "$frozenset"}[kind]
    return {tag: [to_jsonable(v, depth + 1) for v in value]}


def encode(value) -> str:
    try:
        return json.dumps(to_jsonable(value), allow_nan=False, separators=(",", ":"))
    except RecursionError:
        raise NotPlain("recursive structure") from None


def _from_jsonable(node, depth: int):
    if depth > MAX_DEPTH:
        raise ValueError("nesting too deep")
    kind = type(node)
    if node is None or kind in (bool, int, str):
        return node
    if kind is float:
        if not math.isfinite(node):
            raise ValueError("bare non-finite float")
        return node
    if kind is list:
        return [_from_jsonable(v, depth + 1) for v in node]
    if kind is dict and len(node) == 1:
        ((tag, body),) = node.items()
        if tag == "$float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag in _TAGS and type(body) is list:
            if tag == "$dict":
                if not all(type(pair) is list and len(pair) == 2 for pair in body):
                    raise ValueError("malformed $dict")
                return {_from_jsonable(k, depth + 1): _from_jsonable(v, depth + 1) for k, v in body}
            items = [_from_jsonable(v, depth + 1) for v in body]
            return {"$tuple": tuple, "$set": set, "$frozenset": frozenset}[tag](items)
    raise ValueError(f"not plain data: {str(node)[:80]}")


def decode(text: str):
    """The built-in value `text` encodes; ValueError (or TypeError for unhashable keys) on anything else."""
    try:
        return _from_jsonable(json.loads(text, parse_constant=_refuse), 0)
    except RecursionError:
        raise ValueError("nesting too deep") from None


def _refuse(name: str):
    raise ValueError(f"bare {name}")
