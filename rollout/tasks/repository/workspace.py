"""A repository task's workspace: the episode's copy-on-write view of its project, and the guarded grading of it.

A project is kept twice per build (`rollout.tasks.repository.build`): an *episode base* (files 0666,
directories 0777: every command of an episode runs as another uid, so the agent's view must be writable by any)
and a *grading base* (root's 0644/0755: nothing a sandboxed run does can change it). As root an episode gets an
overlayfs view, its task's changed file and the episode base as read-only lower layers and an upper layer of its
own; else a plain copy. Grading never trusts the episode's files: it takes from them only what the task asks for
(`rollout.tasks.repository.grading_policy`: source only, the task's functions, no tests or test configuration) and
runs it across the grading boundary (`run_tests_across`): pytest in the sandbox over a fresh read-only view of the
grading base with the task's functions as proxies, through `rollout.tasks.repository.pytest_report`, which streams its
report over a channel no file of the run holds, each line HMAC-chained under a per-run key, among trusted sentinel
tests that must pass and fail (`read_report` believes nothing else); the proxies' calls answered by the episode's
version in a sandboxed process of its own. (`run_tests_guarded` alone, pytest over the trusted package with changes
in its own process, is for the build's runs of the project's and the task's own code.)
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import os
import random
import re
import secrets
import shlex
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from composer.rollout.sandbox.results import CommandResult, RewardMode, RunEnvironment, SandboxResult, reward_for
from composer.rollout.sandbox.runs import CALL_FD, CHANNEL_FD, Sandbox
from composer.rollout.sandbox.session import InfraError
from composer.rollout.sandbox.trees import remove_tree, walk_files
from composer.rollout.tasks.repository.boundary import crosses, crossing_text, module_name, proxied
from composer.rollout.tasks.repository.grading_policy import NOT_A_FILE, Scope, is_protected, keep_change, package_sources
from composer.rollout.tasks.workspace import (
    Workspace,
    is_full,
    mount_capped,
    mount_overlay,
    overlay_supported,
    owned_dir,
    reclaim,
    unmount,
)

PassToPass = Literal["required", "scored"]
_PYTEST_REPORT = Path(__file__).with_name("pytest_report.py")


@dataclass(frozen=True)
class RepoTestPlan:
    """A repository task's tests and how to score them: the same on every host (it crosses to a sandbox host as it
    is, inside a `shipping.ShippedTask`)."""

    packages: tuple[str, ...]
    """The project's packages, relative to the project root (`networkx`; `src/mylib`, `lib/other`): only changes in
    them are graded, and the directory holding each is on the runs' sys.path."""
    test_files: tuple[str, ...]
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    pytest_args: tuple[str, ...]
    timeout_s: float
    pass_to_pass_policy: PassToPass = "required"
    scope: tuple[Scope, ...] = ()
    """The functions the task asks to change, per file: the only part of an episode's change that grading takes
    (`grading_policy.keep_change`), each run across the grading boundary (`run_tests_across`)."""


@dataclass(frozen=True, kw_only=True)
class RepoTests(RepoTestPlan):
    """What a repository task's workspace needs: its tests (`RepoTestPlan`), and where its bases, its changed file and
    its environment are on this host."""

    layer: Path
    """The task's changed file, at its path in the project (the episode's top lower layer)."""
    episode_base: Path
    grading_base: Path
    hidden: tuple[str, ...]
    """Installed copies of the project, unreadable in the sandbox."""
    environment: RunEnvironment | None = None
    """The project's own virtual environment (a user's project); None: the sandbox's interpreter."""

    @property
    def plan(self) -> RepoTestPlan:
        """The tests alone (what a sandbox host is sent)."""
        return RepoTestPlan(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RepoTestPlan)})

    @classmethod
    def of_plan(cls, plan: RepoTestPlan, **trees) -> RepoTests:
        """`plan`'s tests with `trees` (layer, episode_base, grading_base, hidden, environment) of this host."""
        return cls(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(RepoTestPlan)}, **trees)

    def run_environment(self, root: str) -> RunEnvironment | None:
        """The environment of a command run whose project root is `root` (relative to the work directory)."""
        return packages_environment(self.environment, self.packages, root)


def packages_environment(environment: RunEnvironment | None, packages: tuple[str, ...], root: str) -> RunEnvironment | None:
    """`environment` with the directories holding `packages` on PYTHONPATH, for a run whose project root is `root`
    (relative to its work directory; the root itself is pytest's, on sys.path already)."""
    sources = [s for s in package_sources(packages) if s]
    if environment is None and not sources:
        return None
    return dataclasses.replace(environment or RunEnvironment(), pythonpath=tuple(str(PurePosixPath(root) / s) for s in sources))


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    except OSError:
        return False


def _files_under(base: Path, relative: str) -> list[str]:
    top = base / relative
    if not top.is_dir() or top.is_symlink():
        return [relative] if top.is_file() or top.is_symlink() else []
    return [str(Path(d, f).relative_to(base)) for d, _, files in os.walk(top) for f in files]


def _read_entry(root: Path, relative: str) -> bytes | None | object:
    """A regular file's bytes, None when absent, NOT_A_FILE when the path is a symlink, goes through one, or is
    something other than a regular file (a FIFO, a device): the grader runs on the host as root, and a symlink an
    episode planted would point it anywhere, a FIFO would block it."""
    path, parts = root, PurePosixPath(relative).parts
    for depth, part in enumerate(parts, 1):
        path = path / part
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            return NOT_A_FILE
        if depth < len(parts) and not stat.S_ISDIR(st.st_mode):
            return None
        if depth == len(parts) and not stat.S_ISREG(st.st_mode):
            return None if stat.S_ISDIR(st.st_mode) else NOT_A_FILE
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        return f.read()


# --- grading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TestReport:
    """The outcomes of one guarded pytest run (`run_tests_guarded`)."""

    outcomes: dict[str, str]
    """Test id -> passed / failed / error / skipped / xfailed, as the trusted plugin reported them."""
    complete: bool
    """The report is whole and trusted: it ended with its end line (pytest finished, the program did not end the
    process), holds only the plugin's lines, and pytest's reporting was not patched."""
    flags: tuple[str, ...]
    detail: str
    output: str
    status: str
    wall_seconds: float
    cpu_seconds: float
    infra_failure: bool = False
    refused: dict[str, int] = dataclasses.field(default_factory=dict)
    """Calls that could not cross the grading boundary, by reason (`crossing.refusals`)."""


def _write_layer(layer: Path, changes: dict[str, bytes | None]) -> None:
    """A read-only lower layer with `changes` (root-owned, 0644/0755; a deletion is an overlay whiteout)."""
    for relative, content in changes.items():
        path = layer / relative
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        if content is None:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(0, 0))
        else:
            path.write_bytes(content)
            os.chmod(path, 0o644)


def _apply_to_copy(root: Path, changes: dict[str, bytes | None]) -> None:
    for relative, content in changes.items():
        path = root / relative
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            remove_tree(path, ignore_errors=False)
        if content is None:
            continue
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        path.write_bytes(content)
        os.chmod(path, 0o644)


def _open_view(repo: Path, layer: Path, grading_base: Path, changes: dict[str, bytes | None]) -> bool:
    """A fresh read-only view of `grading_base` with `changes` at `repo`: an overlay (True: to unmount) where the
    area allows one, else a copy."""
    repo.mkdir(mode=0o755)
    if overlay_supported(repo.parent):
        layer.mkdir(mode=0o755)
        _write_layer(layer, changes)
        mount_overlay(repo, [layer, grading_base])
        return True
    shutil.copytree(grading_base, repo, symlinks=True, dirs_exist_ok=True)
    _apply_to_copy(repo, changes)
    return False


# Words sentinel tests are named with, besides the test file's own.
_SENTINEL_WORDS = ("basic", "values", "order", "empty", "small", "cases", "edges", "nodes", "simple", "result")


def sentinel_tests(test_file: str, source: str, rng: random.Random) -> tuple[str, dict[str, str]]:
    """Trusted tests for one run of `test_file`, appended to it: two that must pass and two that must fail, named
    like the file's own tests and drawn anew each run. A run whose report has a must-fail test passing (asserts
    skipped or stripped, outcomes rewritten) or, while real tests of the file pass, a sentinel missing or with
    another outcome (the module swapped, tests replaced), is not believed. Returns (source, test id -> outcome)."""
    taken = set(re.findall(r"def (test_\w+)", source))
    words = sorted({w for name in taken for w in name.split("_")[1:] if w.isalpha() and len(w) > 2} | set(_SENTINEL_WORDS))
    blocks, expected = [], {}
    for outcome in rng.sample(["passed", "passed", "failed", "failed"], 4):
        name = "test_" + "_".join(rng.sample(words, rng.randint(2, 3)))
        while name in taken:
            name += f"_{rng.choice(words)}"
        taken.add(name)
        values = rng.sample(range(2, 99), 3)
        smallest = min(values) if outcome == "passed" else max(values)
        # The assertion that decides is not the last statement: a tracer that jumps over asserts can reach it.
        blocks.append(f"def {name}():\n    values = {values!r}\n    assert sorted(values)[0] == {smallest}\n    assert len(values) == 3\n")
        expected[f"{test_file}::{name}"] = outcome
    return "\n\n" + "\n\n".join(blocks), expected


def run_tests_guarded(
    sandbox: Sandbox,
    grading_base: Path,
    changes: dict[str, bytes | None],
    test_files: tuple[str, ...],
    pytest_args: tuple[str, ...],
    timeout_s: float,
    hidden: tuple[str, ...],
    area: Path,
    environment: RunEnvironment | None = None,
    calls: Callable[[bytes], bytes | None] | None = None,
    shared_tmp: Path | None = None,
) -> TestReport:
    """Run pytest on `test_files` (with sentinel tests) in the sandbox over a fresh read-only view of
    `grading_base` with `changes` (trusted tests and configuration: the caller passes only changes it grades), and
    read the trusted plugin's report from the run's channel; `environment`: the project's own; `calls`: the
    answers to the proxies' calls (`run_tests_across`), `shared_tmp` the directory both processes see, where pytest's
    temporary directories go. Alone: the build's runs of the project's and the task's own
    code (surveys, a candidate's change); with `calls`: every grade and the build's checks across the boundary."""
    area.mkdir(parents=True, exist_ok=True)
    reclaim(area)
    work = owned_dir("grade-", area)
    repo, secret_dir, config_dir, layer = work / "repo", work / "secret", work / "config", work / "layer"
    rng = random.Random(secrets.token_bytes(16))
    sentinels: dict[str, str] = {}
    with_sentinels = dict(changes)
    for test_file in test_files:
        text, expected = sentinel_tests(test_file, (grading_base / test_file).read_text(errors="replace"), rng)
        with_sentinels[test_file] = (grading_base / test_file).read_bytes() + text.encode()
        sentinels.update(expected)
    mounted = capped = False
    try:
        if overlay_supported(area):
            # What the run writes during grading (its work directory is `work`, made the run's uid's) goes to a
            # tmpfs of the run's write cap, not to the host's disk; removed after.
            mount_capped(work, sandbox.config.max_write_mb << 20, sandbox.config.max_inodes)
            capped = True
        os.chmod(work, 0o755)
        config_dir.mkdir(mode=0o755)
        # The run deletes the key file once it has read it, before any code of the repository runs.
        secret_dir.mkdir()
        os.chmod(secret_dir, 0o733)
        mounted = _open_view(repo, layer, grading_base, with_sentinels)
        key = secrets.token_bytes(32)
        (secret_dir / "key").write_text(key.hex())
        os.chmod(secret_dir / "key", 0o644)
        (config_dir / "pytest.ini").write_text("[pytest]\n")
        os.chmod(config_dir / "pytest.ini", 0o644)
        crossing = []
        if calls is not None:
            (config_dir / "crossing.py").write_text(crossing_text())
            os.chmod(config_dir / "crossing.py", 0o644)
            crossing = [f"--crossing=config/crossing.py:{CALL_FD}", *([f"--shared-tmp={shared_tmp}"] if shared_tmp else [])]
        command = " ".join(
            shlex.quote(a)
            for a in [
                "python",
                "-s",
                "-P",
                "-B",
                "-c",
                _PYTEST_REPORT.read_text(),
                "repo",
                "secret/key",
                str(CHANNEL_FD),
                *crossing,
                "-c",
                "../config/pytest.ini",
                "--rootdir=.",
                "--confcutdir=.",
                "-p",
                "no:cacheprovider",
                "-q",
                "--tb=short",
                "-W",
                "ignore::pytest.PytestUnknownMarkWarning",
                *pytest_args,
                *test_files,
            ]
        )
        result = sandbox.run_command(
            command, work, timeout_s=timeout_s, hidden=hidden, channel=True, environment=environment, calls=calls, owned=True
        )
        if capped and is_full(work):
            result = dataclasses.replace(result, flags=tuple(sorted({*result.flags, "write_limit"})))
        return read_report(result, key, sentinels)
    finally:
        if mounted:
            unmount(repo)
        if capped:
            unmount(work)
        remove_tree(work)


def _without_tests(grading_base: Path, packages: tuple[str, ...], test_files: tuple[str, ...]) -> dict[str, None]:
    """Deletions that keep the tests out of the episode's process: the test files and their directories, every test
    directory, test module and conftest.py of the packages."""
    gone: dict[str, None] = {}
    for test_file in test_files:
        parent = PurePosixPath(test_file).parent
        gone[str(parent) if str(parent) not in (".", *packages) else test_file] = None
    for directory, dirs, files in (step for package in packages for step in os.walk(grading_base / package)):
        here = Path(directory).relative_to(grading_base)
        test_dirs = [d for d in dirs if d in ("tests", "testing")]
        for name in [*test_dirs, *files]:
            if name in test_dirs or is_protected(str(here / name)):
                gone[str(here / name)] = None
        dirs[:] = [d for d in dirs if d not in test_dirs]
    return {path: None for path in gone if not any(str(parent) in gone for parent in PurePosixPath(path).parents)}


def run_tests_across(sandbox: Sandbox, tests: RepoTests, episode: dict[str, bytes | None], area: Path) -> TestReport:
    """The task's tests in the grader's process (`run_tests_guarded`) over the trusted package (the grading base)
    with the task's functions as proxies (`boundary.proxied`); their calls answered by a sandboxed process of its own
    that holds the package with `episode` (the kept change) and no tests (`crossing.serve`)."""
    if not crosses(tests.scope):
        raise ValueError(f"a repository task's scope must name its functions: {tests.scope}")
    grader = {}
    for scope in tests.scope:
        text = (tests.grading_base / scope.path).read_text()
        grader[scope.path] = proxied(text, scope.functions, module_name(scope.path, tests.packages)).encode()
    area.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="episode-", dir=area))
    mounted = capped = False
    try:
        os.chmod(work, 0o755)
        # The tests' temporary directories (pytest's `tmp_path`), at one path in both processes: a test writes a
        # file there and gives the function its path. A tmpfs of the write cap, the episode's writes counted.
        shared_tmp = work / "tmp"
        shared_tmp.mkdir()
        if overlay_supported(area):
            mount_capped(shared_tmp, sandbox.config.max_write_mb << 20, sandbox.config.max_inodes)
            capped = True
        os.chmod(shared_tmp, 0o1777)
        environment = tests.run_environment("repo") or RunEnvironment()
        environment = dataclasses.replace(environment, writable=(*environment.writable, str(shared_tmp)))
        changes = {**episode, **_without_tests(tests.grading_base, tests.packages, tests.test_files)}
        mounted = _open_view(work / "repo", work / "layer", tests.grading_base, changes)
        roots = [str(PurePosixPath("repo") / source) for source in package_sources(tests.packages)]
        command = shlex.join(["python", "-s", "-P", "-B", "-c", crossing_text(), *roots])
        try:
            with sandbox.serving(command, work, tests.timeout_s, tests.hidden, environment) as server:

                def answer(line: bytes) -> bytes:
                    reply = server.exchange(line)
                    return reply if reply is not None else b'{"raise":"RuntimeError","message":"the episode process ended"}'

                return run_tests_guarded(
                    sandbox,
                    tests.grading_base,
                    grader,
                    tests.test_files,
                    tests.pytest_args,
                    tests.timeout_s,
                    tests.hidden,
                    area,
                    environment,
                    calls=answer,
                    shared_tmp=shared_tmp,
                )
        except InfraError as e:
            return TestReport({}, False, (), str(e), "", "infra", 0.0, 0.0, infra_failure=True)
    finally:
        if mounted:
            unmount(work / "repo")
        if capped:
            unmount(shared_tmp)
        remove_tree(work)  # the episode's process wrote here: at any depth, never following a link


def read_report(result: CommandResult, key: bytes, sentinels: dict[str, str]) -> TestReport:
    """The trusted plugin's report, from the run's channel: lines `MAC JSON` whose HMACs (under the run's key, each
    chained to the line before) hold, up to the end line. Anything else (a line added, changed, dropped or moved,
    anything after the end), a report whose reporting was tampered with, or sentinel tests not reported as written
    make it untrusted: then no test counts."""
    flags = set(result.flags)
    outcomes: dict[str, str] = {}
    end = None
    late = 0
    chain = b""
    for line in result.channel.split(b"\n"):
        if not line.strip():
            continue
        if end is not None:
            late += 1
            continue
        mac, _, body = line.partition(b" ")
        record = None
        if hmac.compare_digest(mac, hmac.digest(key, chain + body, "sha256").hex().encode()):
            chain = mac
            try:
                record = json.loads(body)
            except ValueError:
                record = None
        if not isinstance(record, dict):
            flags.add("forged_records")
            continue
        if record.get("end"):
            end = record
        elif "id" in record and isinstance(record["id"], str):
            # A test reported twice keeps its worst outcome.
            previous = outcomes.get(record["id"])
            outcomes[record["id"]] = str(record.get("outcome")) if previous in (None, "passed") else previous
    if late:
        flags.add("forged_records")
    tripped = _tripped_sentinels(outcomes, sentinels) if end is not None else []
    if tripped:
        flags.add("sentinel_tripped")
    detail = ""
    if end is None:
        if result.status == "ok":
            flags.add("early_exit")
            detail = "the test run ended without its report's end (the process was ended early)"
        else:
            detail = f"the test run did not finish ({result.status})"
    elif end.get("tampered"):
        flags.add("harness_touched")
        detail = "pytest's reporting was tampered with: " + ", ".join(map(str, end["tampered"]))[:300]
    elif late:
        detail = f"{late} line(s) came after the report's end"
    elif "forged_records" in flags:
        detail = "the report holds lines the trusted plugin did not write"
    elif tripped:
        detail = "sentinel tests were not reported as written: " + "; ".join(tripped)[:300]
    # A report the program wrote into or whose reporting it patched proves nothing: every test counts as failed.
    trusted = end is not None and not end.get("tampered") and "forged_records" not in flags and not tripped
    outcomes = {i: o for i, o in outcomes.items() if i not in sentinels}
    refused = end.get("refused") if end is not None else None
    return TestReport(
        outcomes,
        trusted,
        tuple(sorted(flags)),
        detail,
        result.output,
        result.status,
        result.wall_seconds,
        result.cpu_seconds,
        result.infra_failure,
        {str(k): int(v) for k, v in refused.items()} if isinstance(refused, dict) else {},
    )


def _tripped_sentinels(outcomes: dict[str, str], sentinels: dict[str, str]) -> list[str]:
    """Sentinels not reported as written: a must-fail test passing always; any other outcome (or none) only where a
    real test of the same file passed (a file that fails to import, or is skipped whole, runs no sentinel)."""
    tripped = []
    for test_id, expected in sentinels.items():
        test_file = test_id.split("::")[0]
        ran = any(o == "passed" for i, o in outcomes.items() if i.startswith(test_file + "::") and i not in sentinels)
        got = outcomes.get(test_id)
        if (got == "passed" and expected == "failed") or (ran and got != expected):
            tripped.append(f"{test_id.split('::')[-1]} (must {'pass' if expected == 'passed' else 'fail'}) {got or 'not reported'}")
    return tripped


def score(report: TestReport, tests: RepoTests, reward: RewardMode) -> SandboxResult:
    """Reward of a test run: the fraction of fail-to-pass tests passing (`reward` all_or_nothing: all of them),
    0 when any pass-to-pass test broke (`pass_to_pass` required) or counting them as tests too (`scored`). Every
    expected id must be reported passed: a missing test fails; a report without its end fails them all."""

    def passed(ids: tuple[str, ...]) -> int:
        return sum(report.complete and report.outcomes.get(i) == "passed" for i in ids)

    f2p, p2p = passed(tests.fail_to_pass), passed(tests.pass_to_pass)
    total = len(tests.fail_to_pass) + len(tests.pass_to_pass)
    if tests.pass_to_pass_policy == "scored":
        value = reward_for(f2p + p2p, total, reward)
    else:
        value = reward_for(f2p, len(tests.fail_to_pass), reward) if p2p == len(tests.pass_to_pass) else 0.0
    missing = [i for i in (*tests.fail_to_pass, *tests.pass_to_pass) if i not in report.outcomes]
    detail = report.detail or (f"{len(missing)} expected test(s) not reported, e.g. {missing[0]}" if missing and report.complete else "")
    status = report.status if report.status != "ok" or report.complete else "crash"
    return SandboxResult(
        reward=0.0 if report.infra_failure else value,
        passed=f2p + p2p,
        total=total,
        status=status,
        detail=detail,
        stdout_tail=report.output,
        stderr_tail="",
        wall_seconds=report.wall_seconds,
        flags=report.flags,
        flag_details=tuple(f"{f}: {report.detail}" for f in report.flags if report.detail),
        infra_failure=report.infra_failure,
    )


# --- an episode's view of a repository task ----------------------------------------------------


class RepoWorkspace(Workspace):
    """One episode's copy-on-write view of a repository task (see the module docstring)."""

    def __init__(self, tests: RepoTests, sandbox: Sandbox, area: Path, reward: RewardMode = "fraction", overlay: bool | None = None):
        """A view in `area`: overlayfs where it works (`overlay` None), else (or with `overlay` False) a copy."""
        self.tests = tests
        self.sandbox = sandbox
        self.reward = reward
        area.mkdir(parents=True, exist_ok=True)
        self._area = area
        reclaim(area)
        self._dir = owned_dir("ws-", area)
        self.root = self._dir / "root"
        self.overlay = overlay_supported(area) if overlay is None else overlay
        self._mounted = self._capped = False
        try:
            if self.overlay:
                config = sandbox.config
                mount_capped(self._dir, config.workspace_max_write_mb << 20, config.workspace_max_inodes)
                self._capped = True
            self.root.mkdir()
            if self.overlay:
                upper, work = self._dir / "upper", self._dir / "work"
                upper.mkdir()
                work.mkdir()
                mount_overlay(self.root, [tests.layer, tests.episode_base], upper, work)
                self._mounted = True
            else:
                shutil.copytree(tests.episode_base, self.root, symlinks=True, dirs_exist_ok=True)
                shutil.copytree(tests.layer, self.root, symlinks=True, dirs_exist_ok=True)
            os.chmod(self.root, 0o777)
        except BaseException:
            self.close()
            raise
        # The task's own state: what grading takes wherever the episode's change is not taken (the base's file is
        # the unchanged original: falling back to it would be the fix).
        self._task_files = {relative: _read_entry(tests.layer, relative) for relative in _files_under(tests.layer, "")}

    def shell(self, command: str, timeout_s: float) -> CommandResult:
        result = self.sandbox.run_command(
            command, self.root, timeout_s=timeout_s, hidden=self.tests.hidden, environment=self.tests.run_environment(".")
        )
        if self._capped and is_full(self._dir):
            result = dataclasses.replace(result, flags=tuple(sorted({*result.flags, "write_limit"})))
        return result

    def run_tests(self) -> CommandResult:
        command = " ".join(
            shlex.quote(a)
            for a in [
                "python",
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--tb=short",
                "-W",
                "ignore::pytest.PytestUnknownMarkWarning",
                *self.tests.pytest_args,
                *self.tests.test_files,
            ]
        )
        return self.shell(command, self.tests.timeout_s)

    def changed(self) -> dict[str, bytes | None | object]:
        """Every path whose content differs from the task's state (the base with the task's changed file): new
        bytes, None (gone), or NOT_A_FILE (a symlink, a path through one, a FIFO...: never read, never graded)."""
        candidates = set(_files_under(self.tests.layer, ""))
        # The episode's tree is walked iteratively and bounded (`walk_files`): a directory too deep or with too
        # long a path is not entered and counts as not a regular file (dropped, named in change_dropped).
        cut: list[str] = []
        if self.overlay:
            upper = self._dir / "upper"
            for relative, st in walk_files(upper, cut):
                if _is_whiteout(st) or (stat.S_ISDIR(st.st_mode) and _is_opaque(upper / relative)):
                    candidates.update(_files_under(self.tests.grading_base, relative))
                if not stat.S_ISDIR(st.st_mode):
                    candidates.add(relative)
        else:
            episode_base = self.tests.episode_base
            seen = set()
            for relative, mine in walk_files(self.root, cut):
                if stat.S_ISDIR(mine.st_mode):
                    continue
                seen.add(relative)
                try:
                    theirs = os.lstat(episode_base / relative)
                    # Copies keep size and mtime; the task's own files are always compared by content.
                    if (mine.st_size, mine.st_mtime_ns) == (theirs.st_size, theirs.st_mtime_ns) and relative not in candidates:
                        continue
                except FileNotFoundError:
                    pass
                candidates.add(relative)
            candidates.update(p for p in _files_under(episode_base, "") if p not in seen)
        changes: dict[str, bytes | None | object] = dict.fromkeys(cut, NOT_A_FILE)
        for relative in candidates:
            content = _read_entry(self.root, relative)
            task_state = self._task_files[relative] if relative in self._task_files else _read_entry(self.tests.grading_base, relative)
            if content != task_state:
                changes[relative] = content
        return changes

    def grade(self) -> SandboxResult:
        tests = self.tests
        kept = keep_change(self.changed(), self._task_files, tests.grading_base, tests.packages, tests.scope)
        result = score(run_tests_across(self.sandbox, tests, kept.files, self._area), tests, self.reward)
        for flag, found, why in (
            ("tests_modified", kept.protected, "ignored: graded with the trusted copies"),
            ("change_dropped", kept.dropped, "not graded"),
        ):
            if found:
                shown = "; ".join(found[:10]) + (f" and {len(found) - 10} more" if len(found) > 10 else "")
                result = _with_flag(result, flag, f"{shown} ({why})")
        return result

    def close(self) -> None:
        if self._mounted:
            unmount(self.root)
            self._mounted = False
        if self._capped:
            unmount(self._dir)
            self._capped = False
        remove_tree(self._dir)

    def __enter__(self) -> RepoWorkspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _with_flag(result: SandboxResult, flag: str, detail: str) -> SandboxResult:
    return dataclasses.replace(result, flags=tuple(sorted({*result.flags, flag})), flag_details=(*result.flag_details, f"{flag}: {detail}"))
