"""Which modules of a user's project make bug and feature tasks: those whose functions a test file of the project
names, found by the module's name (a private module `_parser.py` as well, whose tests are usually `test_parser.py`)."""

from __future__ import annotations

from composer.recipes.env_schema import RepoTaskSettings
from composer.rollout.tasks.repository.candidates import candidates
from composer.rollout.tasks.repository.projects import resolve_projects

MODULE = '''def to_hex(value):
    """The value as #rrggbb."""
    red, green, blue = value
    if red > 255:
        raise ValueError("red out of range")
    return f"#{red:02x}{green:02x}{blue:02x}"
'''
TEST = "from colors._conversion import to_hex\n\n\ndef test_to_hex():\n    assert to_hex((1, 2, 3)) == '#010203'\n"


def test_a_private_module_makes_tasks_from_the_test_file_named_after_it(tmp_path):
    root = tmp_path / "bases" / "grading"  # the build reads a project's files from its grading base
    (root / "src" / "colors").mkdir(parents=True)
    (root / "src" / "colors" / "__init__.py").write_text("")
    (root / "src" / "colors" / "_conversion.py").write_text(MODULE)
    (root / "src" / "colors" / "_untested.py").write_text(MODULE.replace("to_hex", "untested"))
    (root / "tests").mkdir()
    (root / "tests" / "test_conversion.py").write_text(TEST)
    project = {"name": "colors", "path": str(root), "package": "src/colors"}
    settings = RepoTaskSettings(projects=[project], kinds=["bug", "feature"], cache_dir=str(tmp_path / "cache"))
    found = list(candidates(settings, {"colors": root.parent}, resolve_projects(settings)))
    assert {c.kind for c in found} == {"bug", "feature"}
    assert {(e.path, c.test_files) for c in found for e in c.edits} == {("src/colors/_conversion.py", ("tests/test_conversion.py",))}
    assert all(c.function == "to_hex" for c in found)
