"""A user project's own pytest configuration, as arguments of composer's test runs.

Composer runs a project's tests with a configuration of its own (`-c`: the files an episode could change are never
read), so the settings of the project's configuration file that decide which tests exist and how they pass are
carried over as `-o name=value` overrides, read from the pinned files: the first of `pytest.ini` ([pytest]),
`pyproject.toml` ([tool.pytest.ini_options]), `tox.ini` ([pytest]) and `setup.cfg` ([tool:pytest]) that has the
section, as pytest itself chooses. `-p` plugins of its `addopts` are carried too; its other options are not (they
are often options of plugins composer does not load: `--cov`, `-n`), and neither are `testpaths` (composer names
the test files) or `pythonpath` (composer puts the package's directory on sys.path).
"""

from __future__ import annotations

import configparser
import shlex
import tomllib
from collections.abc import Callable

CARRIED = (
    "python_files",
    "python_classes",
    "python_functions",
    "markers",
    "filterwarnings",
    "xfail_strict",
    "usefixtures",
    "doctest_optionflags",
    "empty_parameter_set_mark",
)
"""The settings that decide which tests exist and how they pass."""
FILES = (("pytest.ini", "pytest"), ("pyproject.toml", None), ("tox.ini", "pytest"), ("setup.cfg", "tool:pytest"))


def _section(name: str, section: str | None, text: str) -> dict[str, str | list] | None:
    """The file's pytest settings, None when it has no pytest section (or cannot be read as its kind)."""
    if section is None:
        try:
            found = tomllib.loads(text).get("tool", {}).get("pytest", {}).get("ini_options")
        except tomllib.TOMLDecodeError:
            return None
        return found if isinstance(found, dict) else None
    parser = configparser.RawConfigParser()
    try:
        parser.read_string(text, source=name)
    except configparser.Error:
        return None
    return dict(parser[section]) if parser.has_section(section) else None


def project_config(read: Callable[[str], str | None]) -> tuple[str, dict[str, str | list]] | None:
    """(file name, settings) of the project's pytest configuration; `read` gives a root file's text or None."""
    for name, section in FILES:
        text = read(name)
        if text is not None and (found := _section(name, section, text)) is not None:
            return name, found
    return None


def _ini_value(value: str | list | bool | int) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value).strip()


def config_args(settings: dict[str, str | list]) -> list[str]:
    """The settings composer's runs take from the project's configuration, as pytest arguments."""
    args = []
    addopts = settings.get("addopts", "")
    words = addopts if isinstance(addopts, list) else shlex.split(str(addopts))
    for i, word in enumerate(words):
        if word == "-p" and i + 1 < len(words):
            args += ["-p", words[i + 1]]
        elif word.startswith("-p") and len(word) > 2:
            args += ["-p", word[2:]]
    for key in CARRIED:
        if key in settings:
            args += ["-o", f"{key}={_ini_value(settings[key])}"]
    return args
