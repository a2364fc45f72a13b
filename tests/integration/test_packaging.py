"""composer installs under one import name: the built wheel, installed into a fresh virtual environment, puts only
`composer` into site-packages (no `cli`, `data`, `rl`... beside a user's own packages), and the installed `composer`
command works from outside the checkout."""

import csv
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO

PRODUCT_FOLDERS = ("cli", "rl", "rollout", "trainer", "sync", "data", "runtime", "cluster", "recipes")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding the wheel alone; its dependencies are read from this environment's site-packages."""
    work = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the checkout's files (tracked and new, not ignored): setuptools writes build/ and
    # *.egg-info beside the sources it builds, and the checkout must not keep them.
    source = work / "source"
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"], capture_output=True, check=True
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(work / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (work / "dist").glob("composer_train-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The dependencies (torch, vLLM, ...) come from this environment, as a path entry: its .pth files (the editable
    # install's import hook among them) are not run, so composer can only come from the wheel.
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    (site / "deps-from-test-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_the_wheel_installs_one_top_level_name(installed):
    site = next((installed / "lib").glob("python3.*/site-packages"))
    [record] = site.glob("composer_train-*.dist-info/RECORD")
    with record.open() as f:
        top = {Path(row[0]).parts[0] for row in csv.reader(f)}
    assert {t for t in top if not t.endswith(".dist-info") and t != "../../bin" and not t.startswith("..")} == {"composer"}
    for folder in PRODUCT_FOLDERS:  # every module of every product folder is in the wheel
        for source in (REPO / folder).rglob("*.py"):
            assert (site / "composer" / source.relative_to(REPO)).is_file(), source
    assert (site / "composer" / "recipes" / "smoke-rl.yaml").is_file()


def test_the_installed_command_works_outside_the_checkout(installed, tmp_path):
    composer = installed / "bin" / "composer"
    version = subprocess.run([str(composer), "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("composer "), version.stderr
    where = subprocess.run(
        [str(installed / "bin" / "python"), "-c", "import composer.cli.main as m; print(m.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.returncode == 0 and str(REPO) not in where.stdout and "site-packages/composer/cli/main.py" in where.stdout
    shipped = next((installed / "lib").glob("python3.*/site-packages")) / "composer" / "recipes" / "smoke-rl.yaml"
    validated = subprocess.run(
        [str(composer), "recipe", "validate", str(shipped)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert validated.returncode == 0, validated.stdout + validated.stderr
    for name in ("cli", "data", "rl", "trainer"):  # a user's own packages of these names are not shadowed
        shadow = subprocess.run([str(installed / "bin" / "python"), "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True)
        assert shadow.returncode != 0 and "No module named" in shadow.stderr
