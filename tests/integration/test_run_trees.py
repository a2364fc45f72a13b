"""Trees an episode makes in its workspace that once broke the host side (#37, #44): a 1,200-deep tree and 22 nested
255-character names (paths past PATH_MAX). Grading walks them iteratively and bounded: what is over the bounds is
dropped and named (`change_dropped`), the host side raises nothing, an honest fix in the same workspace still gets
1.0, and closing the workspace leaves nothing on the host."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from composer.recipes.env_schema import SandboxSection
from composer.rollout.sandbox.runs import Sandbox
from composer.rollout.tasks.repository.workspace import RepoTests, RepoWorkspace

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="workspaces are views mounted as root")

TESTS = "from toy.core import double\n\n\ndef test_double():\n    assert double(2) == 4\n"
DEEP = 'python -c \'import os\nfor _ in range({depth}): os.mkdir("{name}"); os.chdir("{name}")\nopen("x.py", "w").write("1")\''


def toy(tmp_path: Path) -> RepoTests:
    base, layer = tmp_path / "base", tmp_path / "layer"
    (base / "toy" / "tests").mkdir(parents=True)
    (base / "toy" / "__init__.py").write_text("")
    (base / "toy" / "core.py").write_text("def double(x):\n    return x + x + 1\n")
    (base / "toy" / "tests" / "__init__.py").write_text("")
    (base / "toy" / "tests" / "test_core.py").write_text(TESTS)
    for path in [base, *base.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    layer.mkdir()
    shutil.copytree(base, tmp_path / "episode")
    for path in [tmp_path / "episode", *(tmp_path / "episode").rglob("*")]:
        os.chmod(path, 0o777 if path.is_dir() else 0o666)
    return RepoTests(
        package="toy",
        test_files=("toy/tests/test_core.py",),
        fail_to_pass=("toy/tests/test_core.py::test_double",),
        pass_to_pass=(),
        pytest_args=(),
        layer=layer,
        episode_base=tmp_path / "episode",
        grading_base=base,
        hidden=(),
        timeout_s=60,
    )


@pytest.mark.parametrize("depth, name", [(1200, "d"), (22, "n" * 255)], ids=["1200-deep", "past-PATH_MAX"])
def test_a_deep_tree_in_a_workspace_is_dropped_and_an_honest_fix_still_passes(tmp_path, depth, name):
    sandbox = Sandbox(SandboxSection(cpu_seconds=60, wall_seconds=120, memory_mb=2048), root=tmp_path / "sandboxes")
    with RepoWorkspace(toy(tmp_path), sandbox, tmp_path / "workspaces") as ws:
        made = ws.shell("cd toy && " + DEEP.format(depth=depth, name=name), 60)
        assert made.exit_code == 0, made.output
        ws.shell("printf 'def double(x):\\n    return x + x\\n' > toy/core.py", 30)
        result = ws.grade()
        assert result.reward == 1.0 and not result.infra_failure, result.detail
        assert "change_dropped" in result.flags and f"toy/{name}/" in " ".join(result.flag_details), result.flag_details
    assert not ws.root.exists() and list((tmp_path / "workspaces").iterdir()) == []
