"""MkDocs hook: the recipe reference page, rendered at build time from the recipe schema itself.

Every section of `composer.recipes.schema.Recipe` (and every section nested in it, lists of sections included) becomes
a heading with a table of its keys: name, type (with its range or pattern), default and description. Descriptions
are the fields' docstrings (pydantic's `use_attribute_docstrings`), so the page says what `composer recipe schema`
says and cannot drift from the code. The page's Markdown holds the marker below where the reference goes.
"""

from __future__ import annotations

import enum
import json
import re
import types
import typing

from mkdocs.exceptions import PluginError

MARKER = "<!-- recipe-reference -->"
PAGE = "recipes-reference.md"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"{PAGE}: the marker {MARKER} is missing")
    try:
        from composer.recipes.schema import Recipe
    except ImportError as e:
        raise PluginError(f"{PAGE}: cannot import composer.recipes.schema ({e}); install composer first (bash scripts/setup.sh)") from None
    return markdown.replace(MARKER, render(Recipe))


def render(root) -> str:
    out = []
    for path, model, description in sections(root):
        out.append(f"## `{path}` {{#{anchor(path)}}}" if path else "## The recipe {#recipe}")
        intro = [text for text in (description, doc(model)) if text]
        out.extend(["", *dict.fromkeys(intro)] if intro else [])
        out += ["", "| key | type | default | description |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            key = f"{path}.{name}" if path else name
            out.append(
                f"| `{name}` | {cell(type_text(field.annotation, key))}{cell(constraints(field))} "
                f"| {cell(default_text(field))} | {cell(flat(field.description or ''))} |"
            )
        out.append("")
    return "\n".join(out)


def sections(root) -> list[tuple[str, type, str]]:
    """(dotted path, section class, its description in the parent) of every section, depth first; `[]` marks a list."""
    found: list[tuple[str, type, str]] = []

    def visit(path: str, model, description: str) -> None:
        found.append((path, model, description))
        for name, field in model.model_fields.items():
            for child, suffix in nested(field.annotation):
                key = f"{path}.{name}" if path else name
                visit(key + suffix, child, flat(field.description or ""))

    visit("", root, flat(root.__doc__ or ""))
    return found


def nested(annotation, suffix: str = "") -> list[tuple[type, str]]:
    """The section classes inside an annotation (`X`, `X | None`, `list[X]`, `list[Literal[...] | X]`)."""
    if is_section(annotation):
        return [(annotation, suffix)]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, tuple):
        suffix += "[]"
    return [found for arg in args for found in nested(arg, suffix)]


def is_section(annotation) -> bool:
    from pydantic import BaseModel

    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def anchor(path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def type_text(annotation, key: str = "") -> str:
    """A reader's spelling of an annotation; a section type links to its own table."""
    if annotation is type(None):
        return "null"
    if is_section(annotation):
        return f"[section](#{anchor(key)})" if key else "section"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " or ".join(f"`{value!r}`" if not isinstance(value, str) else f'`"{value}"`' for value in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_text(arg, key) for arg in args)
    if origin is list:
        return f"list of {type_text(args[0], key + '[]')}"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"tuple of {type_text(args[0], key)}"
        return "(" + ", ".join(type_text(arg, key) for arg in args) + ")"
    if origin is dict:
        return f"mapping of {type_text(args[0])} to {type_text(args[1])}"
    if isinstance(annotation, type):
        return f"`{annotation.__name__}`"
    return f"`{annotation}`"


BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "min_length": "length >=", "max_length": "length <="}


def constraints(field) -> str:
    said = []
    for item in field.metadata:
        for attribute, sign in BOUNDS.items():
            value = getattr(item, attribute, None)
            if value is not None:
                said.append(f"{sign} {value}")
        pattern = getattr(item, "pattern", None)
        if pattern is not None:
            said.append(f"matching `{pattern}`")
    return f" ({', '.join(said)})" if said else ""


def default_text(field) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if is_section(type(value)):
        return "its defaults"
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "unset"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, (list, tuple, dict)) and not value:
        return "empty"
    try:
        return f"`{json.dumps(list(value) if isinstance(value, tuple) else value)}`"  # as YAML reads it
    except TypeError:
        return f"`{value!r}`"


def doc(model) -> str:
    text = model.__doc__ or ""
    from pydantic import BaseModel

    inherited = {base.__doc__ for base in model.__mro__[1:] if base.__doc__} | {BaseModel.__doc__}
    return "" if text in inherited else flat(text)


def flat(text: str) -> str:
    return " ".join(text.split())


def cell(text: str) -> str:
    # A pipe would end the table cell, even inside backticks.
    return text.replace("|", "\\|")
