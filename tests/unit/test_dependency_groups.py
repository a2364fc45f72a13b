"""A project's PEP 735 dependency groups, read from its pinned pyproject.toml by composer (the environment's pip may
not know `--group`): the requirements in order, `include-group` followed, and every mistake one line naming the key."""

import pytest

from composer.recipes.errors import UserError
from composer.rollout.tasks.repository.projects import dependency_groups

PYPROJECT = """[project]
name = "mylib"

[dependency-groups]
test = ["pytest>=8", "hypothesis"]
Lint = ["ruff"]
dev = [{include-group = "test"}, {include-group = "lint"}, "pytest>=8", "ipython"]
loop = [{include-group = "cycle"}]
cycle = [{include-group = "loop"}]
odd = [3]
"""
WHERE = "env.tasks[].repo.projects[0].dependency_groups: project mylib"


def test_groups_resolve_in_order_with_includes_followed_and_repeats_dropped():
    assert dependency_groups(PYPROJECT, ["dev"], WHERE) == ("pytest>=8", "hypothesis", "ruff", "ipython")
    assert dependency_groups(PYPROJECT, ["test", "LINT"], WHERE) == ("pytest>=8", "hypothesis", "ruff")
    assert dependency_groups(None, [], WHERE) == ()  # no groups asked: the file is not read


@pytest.mark.parametrize(
    "pyproject, names, says",
    [
        (PYPROJECT, ["docs"], "no group 'docs' in its [dependency-groups] (it has: test, Lint, dev, loop, cycle, odd)"),
        (PYPROJECT, ["loop"], "group 'loop' includes itself (loop -> cycle -> loop)"),
        (PYPROJECT, ["odd"], "group 'odd' holds 3"),
        ('[project]\nname = "x"\n', ["test"], "has no [dependency-groups] table"),
        ("[dependency-groups\n", ["test"], "is not valid TOML"),
        (None, ["test"], "the pinned files have no pyproject.toml"),
    ],
)
def test_a_group_that_cannot_be_read_is_one_line_naming_the_key(pyproject, names, says):
    with pytest.raises(UserError) as raised:
        dependency_groups(pyproject, names, WHERE)
    assert str(raised.value).startswith(WHERE) and says in str(raised.value)
