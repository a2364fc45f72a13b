"""The base of every recipe section: unknown keys are errors, field docstrings are the documentation, and a boolean
where a number belongs is refused."""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: object, info: ValidationInfo) -> object:
        # pydantic takes true/false as 1/0 for numbers; in a recipe that is always a slip (`steps: true`)
        if _boolean_where_number(value, cls.model_fields[info.field_name].annotation):
            raise ValueError("expected a number, not a boolean")
        return value


def _boolean_where_number(value: object, annotation: object) -> bool:
    if isinstance(value, bool):
        return _wants_number(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if isinstance(value, (list, tuple)) and origin in (list, tuple) and args:
        item_types = args if origin is tuple and Ellipsis not in args else (args[0],) * len(value)
        return any(_boolean_where_number(item, kind) for item, kind in zip(value, item_types))
    return False


def _wants_number(annotation: object) -> bool:
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        return bool not in options and any(_wants_number(option) for option in options)
    return False
