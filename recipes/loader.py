"""Read a recipe: YAML files joined by `extends:`, `--set` overrides, strict validation.

All problems are collected and raised together as one `RecipeError`, each naming its YAML path.
"""

from __future__ import annotations

import copy
import difflib
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from composer.recipes.checks import Problem, check_recipe
from composer.recipes.errors import UserError
from composer.recipes.schema import Recipe

SHIPPED_DIR = Path(__file__).resolve().parent


class RecipeError(UserError):
    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        noun = "problem" if len(problems) == 1 else "problems"
        super().__init__(f"{source}: {len(problems)} {noun}\n{lines}")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of silently keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen[key] = loader.construct_object(value_node, deep=deep)
    return seen


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: no such recipe file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read recipe ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not a text recipe (the byte at offset {e.start} is not UTF-8)") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise UserError(f"{path}{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}")
    return data


def deep_merge(base: dict, override: dict) -> dict:
    """Mappings merge key by key; lists and scalars in `override` replace those in `base`."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _project_paths_from(data: dict, directory: Path) -> dict:
    """A repository project's relative `path` (env.tasks[].repo.projects[].path) made absolute against the directory
    of the recipe file that names it: the project sits beside the recipe, wherever composer runs. Every other
    relative path (`cache_dir`s, `run.dir`, `model.checkpoint`, which names a previous run's `runs/...` export or a
    hub id) is the working directory's, as are paths given by `--set`."""
    env = data.get("env")
    for task_set in env.get("tasks") or [] if isinstance(env, dict) and isinstance(env.get("tasks"), list) else []:
        repo = task_set.get("repo") if isinstance(task_set, dict) else None
        for project in repo.get("projects") or [] if isinstance(repo, dict) and isinstance(repo.get("projects"), list) else []:
            where = project.get("path") if isinstance(project, dict) else None
            if isinstance(where, str) and where and not where.startswith(("/", "~")):
                project["path"] = str(directory / where)
    return data


def resolve_extends(path: Path, _chain: tuple[Path, ...] = ()) -> dict:
    """The recipe at `path` with its `extends:` parents merged underneath it (paths relative to the file)."""
    path = path.resolve()
    if path in _chain:
        cycle = " -> ".join(p.name for p in (*_chain, path))
        raise UserError(f"{_chain[0]}: cyclic extends: {cycle}")
    data = _project_paths_from(read_yaml(path), path.parent)
    parents = data.pop("extends", None)
    if parents is None:
        return data
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise UserError(f"{path}: extends: expected a file name or a list of file names")
    merged: dict = {}
    for parent in parents:
        parent_path = path.parent / parent
        if not parent_path.is_file():
            raise UserError(f"{path}: extends: {parent!r} not found (looked for {parent_path})")
        merged = deep_merge(merged, resolve_extends(parent_path, (*_chain, path)))
    return deep_merge(merged, data)


def apply_overrides(data: dict, overrides: Iterable[str]) -> dict:
    """Apply `a.b.c=value` overrides; values are parsed as YAML (`3` is an int, `[1, 2]` a list)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise UserError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. --set train.steps=10")
        try:
            value = yaml.load(raw, Loader=_StrictLoader) if raw.strip() else None
        except yaml.YAMLError:
            raise UserError(f"--set {item!r}: the value is not valid YAML") from None
        data = _set_path(data, parts, value, item)
    return data


def _set_path(data: dict, parts: list[str], value: Any, item: str) -> dict:
    root = copy.deepcopy(data)
    node: Any = root
    for depth, part in enumerate(parts):
        here = ".".join(parts[:depth]) or "the recipe"
        if not isinstance(node, (dict, list)):
            raise UserError(f"--set {item!r}: {here} holds a value ({node!r}), not a section")
        if isinstance(node, list) and not (part.isdigit() and int(part) < len(node)):
            raise UserError(f"--set {item!r}: {here} is a list of {len(node)}; index it with 0..{len(node) - 1}")
        key = int(part) if isinstance(node, list) else part
        if depth == len(parts) - 1:
            node[key] = value
        else:
            if isinstance(node, dict) and node.get(key) is None:
                node[key] = {}
            node = node[key]
    return root


def format_loc(loc: tuple) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "(recipe)"


def _section_at(loc: tuple) -> type[BaseModel] | None:
    """The schema class that holds the last element of `loc`, for key suggestions."""
    cls: type[BaseModel] | None = Recipe
    for part in loc:
        if isinstance(part, int) or cls is None:
            continue
        field = cls.model_fields.get(part)
        cls = _model_in(field.annotation) if field else None
    return cls


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, tuple, dict):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found:
                return found
    return None


def _problems_from(error: ValidationError) -> list[Problem]:
    problems = []
    for item in error.errors():
        loc = tuple(item["loc"])
        if item["type"] == "extra_forbidden":
            section = _section_at(loc[:-1])
            valid = list(section.model_fields) if section else []
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else (f"; valid keys: {', '.join(valid)}" if valid else "")
            problems.append(Problem(format_loc(loc), f"unknown key{hint}"))
        elif item["type"] == "missing":
            problems.append(Problem(format_loc(loc), "required, but missing"))
        else:
            message = item["msg"].removeprefix("Value error, ")
            got = item.get("input")
            shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
            problems.append(Problem(format_loc(loc), f"{message}{shown}"))
    return problems


def validate_recipe(data: dict, source: str) -> Recipe:
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(source, _problems_from(e)) from None
    problems = check_recipe(recipe)
    if problems:
        raise RecipeError(source, problems)
    return recipe


def load_recipe(path: str | Path, overrides: Iterable[str] = ()) -> Recipe:
    """Read, merge, override and validate; raises `UserError` with every problem found."""
    path = Path(path)
    data = apply_overrides(resolve_extends(path), overrides)
    return validate_recipe(data, str(path))


def recipe_to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
