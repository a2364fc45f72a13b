"""A one-module package `toy` with its tests, as a trusted grading base (read-only to runs: 0755/0644)."""

from __future__ import annotations

import os
from pathlib import Path


def toy_package(root: Path, core: str, tests: dict[str, str]) -> Path:
    """`root/toy/core.py` holding `core` and `root/toy/tests/<name>` for each test file; `root`."""
    (root / "toy" / "tests").mkdir(parents=True)
    (root / "toy" / "__init__.py").write_text("")
    (root / "toy" / "core.py").write_text(core)
    (root / "toy" / "tests" / "__init__.py").write_text("")
    for name, text in tests.items():
        (root / "toy" / "tests" / name).write_text(text)
    for path in [root, *root.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return root
