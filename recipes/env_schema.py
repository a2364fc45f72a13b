"""The recipe's `env` section: the task sets an RL run and `composer eval` draw from (functions, recall, the
user's repositories), the sandbox that runs model-written code, and what a flagged episode earns.
Part of the recipe schema (`recipes.schema` holds the other sections and the whole `Recipe`).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from composer.recipes.section import Section

READY_MADE_PROJECTS = ("networkx", "sympy")


class ProjectSettings(Section):
    """A project of the user's own (a directory or a git checkout on the driver) whose test suite makes tasks."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """The project's name in task ids and tables (not `networkx` or `sympy`: those are the ready-made entries)."""
    path: str
    """The project's directory on the driver; a git checkout is read at `commit` (its working tree is not used).
    Relative: to the directory of the recipe file that names it (a `--set` value: to the working directory)."""
    commit: str | None = None
    """The commit of a git checkout (required there; a branch or tag is resolved once and pinned by its hash)."""
    package: str | None = None
    """The importable package, relative to the project root: `mylib`, or `src/mylib` (its parent goes on sys.path)."""
    packages: list[str] | None = None
    """Several importable packages of one repository instead of `package` (exactly one of the two): each entry as
    `package` (`mylib`, `src/mylib`, `lib/other`); tasks come from all of them, and each one's parent goes on sys.path."""
    install: str = "pip install . pytest"
    """Shell command run in the sandbox, in a copy of the project at `commit`, with the project's fresh virtual
    environment first on PATH and the machine's package index (pip's configuration): it installs the dependencies
    and pytest; the project's own distribution is then removed from the environment (episodes import their copy)."""
    dependency_groups: list[str] = Field(default_factory=list)
    """Dependency groups (PEP 735, `[dependency-groups]` of the pinned pyproject.toml, `include-group` followed)
    installed after `install` (`[test]`): composer reads them itself, so they install with any pip."""
    python: str | None = None
    """Interpreter the project's virtual environment is made from; the driver's when unset."""
    test_paths: list[str] = Field(default_factory=lambda: ["tests"], min_length=1)
    """Directories (relative to the project root) holding the test files `test_<module>.py`."""
    pytest_args: list[str] = Field(default_factory=list)
    """Extra pytest arguments of every test run."""
    exclude_markers: list[str] = Field(default_factory=list)
    """Tests with these markers are left out (`-m "not slow and not network"`)."""
    install_seconds: float = Field(default=900.0, gt=0)
    """Wall-clock limit of the install command."""

    @field_validator("name")
    @classmethod
    def _not_ready_made(cls, value: str) -> str:
        if value in READY_MADE_PROJECTS:
            raise ValueError(f"{value} is a ready-made project: list it by name (`- {value}`), not as a mapping")
        return value

    @field_validator("packages")
    @classmethod
    def _one_package_key(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        # a field validator (`package` comes first, and defaults are validated): the error sits at `packages`
        name = info.data.get("name", "?")
        if (info.data.get("package") is None) == (value is None):
            given = "both" if value is not None else "neither"
            raise ValueError(f"project {name}: give `package` (one package) or `packages` (a list), not {given}")
        if value is None:
            return value
        if not value:
            raise ValueError(f"project {name}: `packages` is empty; list the packages, or give `package`")
        normal = [PurePosixPath(p) for p in value]
        for i, one in enumerate(normal):
            for other in normal[:i]:
                if one.is_relative_to(other) or other.is_relative_to(one):
                    what = "lists {one} twice" if one == other else f"holds {other} and {one}, one inside the other"
                    raise ValueError(
                        f"project {name}: `packages` {what.format(one=one)}; list each package once (its subpackages come with it)"
                    )
                if one.name == other.name:
                    raise ValueError(
                        f"project {name}: `packages` {other} and {one} are both imported as `{one.name}`: "
                        "only one of them could be imported; list one"
                    )
        return value

    @property
    def package_paths(self) -> list[str]:
        """The packages tasks change (`packages`, or `package` alone)."""
        return list(self.packages) if self.packages is not None else [self.package]


ProjectEntry = Annotated[
    Annotated[Literal["networkx", "sympy"], Tag("name")] | Annotated[ProjectSettings, Tag("ProjectSettings")],
    Discriminator(lambda value: "ProjectSettings" if isinstance(value, (dict, ProjectSettings)) else "name"),
]
"""A ready-made project by name, or a mapping of the user's own (each checked as what it is: a mapping's error is
never also reported as an unknown name)."""


class RepoTaskSettings(Section):
    projects: list[ProjectEntry] = Field(default_factory=lambda: ["networkx", "sympy"], min_length=1)
    """Projects whose own test suites make the tasks: `networkx`, `sympy` (installed packages: their version is part
    of the cache key), or a project of your own (a mapping: name, path, commit, package or packages, install, ...)."""
    kinds: list[Literal["bug", "feature", "history", "multi"]] = Field(default_factory=lambda: ["bug", "feature"], min_length=1)
    """`bug`: a seeded mutation of a function (comparison, boundary, operator, negated condition, removed branch,
    constant) that some of its tests catch; `feature`: a function's body removed, signature and docstring kept;
    `history` (git projects): a commit of the project's log that changed source and tests together, its source change
    taken out and its tests kept; `multi`: several seeded bugs in different functions or files at once."""
    num_tasks: int = Field(default=500, gt=0)
    """Validated tasks to build (`composer env build`): the first ones in the seeded candidate order."""
    seed: int = 0
    """Seed of the candidate order."""
    include: list[str] = Field(default_factory=list)
    """Glob patterns of the modules that may be changed, relative to the project root (`networkx/algorithms/*`); all
    when empty."""
    max_test_seconds: float = Field(default=5.0, gt=0)
    """Test files whose run on the original needs more CPU time than this (in the sandbox, pytest's start included)
    make no tasks."""
    history_commits: int = Field(default=200, gt=0)
    """`history`: how many commits of the first-parent log before `commit` are looked at."""
    multi_changes: tuple[int, int] = (2, 3)
    """`multi`: the least and most seeded bugs of one task."""
    pass_to_pass: Literal["required", "scored"] = "required"
    """`required`: reward = fraction of fail-to-pass tests passing, 0 when any pass-to-pass test breaks; `scored`:
    every expected test counts alike (reward = passed / all)."""
    cache_dir: str = ".cache/composer/repo-tasks"
    """Project copies and environments, test surveys, verdicts and built sets (keyed by the settings above and the
    projects' versions, commits and install commands)."""

    @field_validator("kinds")
    @classmethod
    def _no_repeats(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"{value}: each at most once")
        return value

    @field_validator("projects")
    @classmethod
    def _projects_once(cls, value: list) -> list:
        names = [p if isinstance(p, str) else p.name for p in value]
        if len(set(names)) != len(names):
            raise ValueError(f"{names}: each at most once")
        return value

    @field_validator("multi_changes")
    @classmethod
    def _a_range(cls, value: tuple[int, int]) -> tuple[int, int]:
        if not 2 <= value[0] <= value[1]:
            raise ValueError("multi_changes needs 2 <= least <= most, e.g. [2, 3]")
        return value

    def project_names(self) -> list[str]:
        return [p if isinstance(p, str) else p.name for p in self.projects]


class RecallSettings(Section):
    parts: int = Field(default=6, gt=0, le=100)
    """Files of each task, one code each: all needed for the answer."""
    filler_lines: int = Field(default=4, ge=0, le=400)
    """Log lines around the code in each file (a file's tokens, and so how soon the context fills)."""
    layout: Literal["notes", "repository"] = "notes"
    """Where the codes are: log files `notes/part_K.txt` (a line `CODE of part K: N` among log lines), or source modules
    `app/part_K.py` the agent reads first (`PART_K_CODE = N` among functions and constants)."""
    decoys: int = Field(default=0, ge=0, le=20)
    """Lines in each file that name another number for the part (`revoked code of part K: N`): a reader, and a
    summary, must keep the part's CODE and not these. With `parts` (how many facts, and turns before the answer) and
    `filler_lines` (tokens a turn, so how many turns a context holds), the family's difficulty knobs."""


TaskSetName = Literal["humaneval", "codeio", "rgym", "smoke", "repo", "recall"]


class TaskSet(Section):
    name: TaskSetName
    """Task family: HumanEval, CodeI/O, reasoning-gym problems answered by a program, the small learnable smoke
    family, repository tasks (`repo`), or the long-horizon `recall` family (codes spread over files, read one per
    turn, all needed for the answer; needs rollout.harness: tools)."""
    weight: float = Field(default=1.0, gt=0)
    """Sampling weight among task sets."""
    limit: int | None = Field(default=None, gt=0)
    """Use at most this many tasks of the set."""
    held_out: int = Field(default=0, ge=0)
    """Tasks of the set held out for `rl.eval`: a fixed choice (seeded by the set's name) among its tasks in use,
    never drawn for training."""
    repo: RepoTaskSettings | None = None
    """name: repo only: which repository tasks (built by `composer env build`); the defaults when unset."""
    recall: RecallSettings | None = None
    """name: recall only: the shape of its tasks; the defaults when unset."""

    @model_validator(mode="after")
    def _settings_of_their_own_set_only(self) -> TaskSet:
        for name, kind in (("repo", RepoTaskSettings), ("recall", RecallSettings)):
            if getattr(self, name) is not None and self.name != name:
                raise ValueError(f"`{name}` settings belong to the {name} task set, not to {self.name}")
            if self.name == name and getattr(self, name) is None:
                setattr(self, name, kind())
        return self


class SandboxServersOnSlurm(Section):
    """Sandbox servers that composer starts itself as SLURM job steps (srun), one per node while nodes last."""

    servers: int = Field(gt=0)
    """Sandbox servers to keep running, named `slurm-0`, `slurm-1`, ... in the fleet. Inside a SLURM job (the driver
    sees SLURM_JOB_ID) they are steps of that job on its nodes; otherwise of a job of their own (`nodes` nodes)."""
    nodes: int | None = Field(default=None, gt=0)
    """Nodes of the job of their own (outside a SLURM job); `servers` when unset. Unused inside a SLURM job."""
    cpus_per_server: int | None = Field(default=None, gt=0)
    """CPUs of each server's step (srun --cpus-per-task); SLURM's default for a step when unset. Set it where the
    cluster binds steps to their CPUs, or the sandboxes share one core."""
    partition: str | None = None
    """Partition of the job of their own; the cluster's default when unset."""
    account: str | None = None
    """Account of the job of their own; the user's default when unset."""
    time_limit: str | None = None
    """Wall-clock limit of the job of their own (salloc --time, e.g. 2-00:00:00); the partition's default when unset."""


class SandboxSection(Section):
    cpu_seconds: int = Field(default=10, gt=0)
    """CPU time limit per execution: per process, and (as root, where the host has cgroups) for all its processes together."""
    wall_seconds: float = Field(default=20.0, gt=0)
    """Wall-clock limit per execution."""
    memory_mb: int = Field(default=1024, gt=0)
    """Address-space limit per process; as root, where the host has cgroups, also the run's memory limit for
    everything it holds (with max_write_mb and 16 MB of /dev/shm; a command also workspace_max_write_mb): memfds,
    tmpfs and shared memory included, a hit flagged `memory_limit`."""
    max_processes: int = Field(default=64, gt=0)
    """Process-count limit."""
    max_file_mb: int = Field(default=16, gt=0)
    """Largest file the code may write."""
    max_output_kb: int = Field(default=64, gt=0)
    """Captured stdout/stderr kept per execution."""
    max_write_mb: int = Field(default=256, gt=0)
    """Total size of the files one run may write (its work directory and /tmp together; a command's /tmp): a tmpfs
    of this size, refused past it and flagged `write_limit` (as root; otherwise only max_file_mb bounds a file)."""
    max_inodes: int = Field(default=16384, gt=0)
    """Files and directories one run may create (same tmpfs)."""
    workspace_max_write_mb: int = Field(default=512, gt=0)
    """Total size of what an episode's workspace may hold beyond its task's files (the copy-on-write upper layer or
    solution.py's directory, a tmpfs of this size, as root); a command that fills it is flagged `write_limit`."""
    workspace_max_inodes: int = Field(default=65536, gt=0)
    """Files and directories an episode's workspace may create."""
    network: bool = False
    """Allow network access (off: a fresh network namespace when root)."""
    infra_retries: int = Field(default=2, ge=0)
    """Retries of a run that failed because of the sandbox or the host, not the program (with backoff, on any
    host of the fleet); after them the run is marked infra_failure, never scored."""
    # --- the sandbox fleet (rollout/sandbox/fleet.py) ---
    hosts: list[str] = Field(default_factory=lambda: ["localhost"])
    """Sandbox hosts: `localhost` runs sandboxes here; any other host is reached over SSH (cluster.ssh, host keys
    checked) and runs one sandbox server (its composer, `remote_python`) that grades there. Every host must be
    reachable at start. May be empty when `slurm` starts the servers."""
    slurm: SandboxServersOnSlurm | None = None
    """Sandbox servers started by SLURM as job steps, in the fleet beside `hosts`: each joins once it is ready, and
    one that is lost (its step or node gone) is started again on another node of the job."""
    sandboxes_per_host: int | None = Field(default=None, gt=0)
    """Sandboxes each host runs at once; the host's CPU count when unset."""
    max_concurrent: int | None = Field(default=None, gt=0)
    """Sandboxes running at once over all hosts; the sum of the hosts' when unset."""
    max_queued: int = Field(default=4096, gt=0)
    """Runs waiting for a sandbox; beyond this a submitter waits (back-pressure)."""
    retry_backoff_seconds: float = Field(default=0.2, gt=0)
    """First retry delay after a host failure; doubled on each retry (with jitter), capped at 30 s."""
    probe_after_failures: int = Field(default=3, gt=0)
    """Consecutive failures of a host before its health is probed; a failed probe (or a lost connection) removes it."""
    readmit_seconds: float = Field(default=30.0, gt=0)
    """Cool-down of a removed host before a probe may re-admit it."""
    remote_python: str | None = None
    """Python of the composer installation on remote sandbox hosts; the driver's own interpreter path when unset."""

    @model_validator(mode="after")
    def _hosts_once(self) -> SandboxSection:
        if repeated := sorted({h for h in self.hosts if self.hosts.count(h) > 1}):
            raise ValueError(f"hosts: {', '.join(repeated)} listed more than once (sandboxes_per_host sets how many each runs)")
        if not self.hosts and self.slurm is None:
            raise ValueError("hosts: empty, and no slurm servers: nothing would run the sandboxes")
        if self.slurm is not None and (taken := [h for h in self.hosts if h in slurm_server_names(self.slurm.servers)]):
            raise ValueError(f"hosts: {', '.join(taken)} is the name of a sandbox server that slurm starts")
        return self


def slurm_server_names(servers: int) -> list[str]:
    """The fleet's names of the sandbox servers that `env.sandbox.slurm` starts."""
    return [f"slurm-{index}" for index in range(servers)]


class GuardsSection(Section):
    flags: list[
        Literal[
            "harness_touched",
            "early_exit",
            "forged_records",
            "non_plain",
            "writes_outside",
            "stray_processes",
            "timeout",
            "output_limit",
            "write_limit",
            "memory_limit",
            "canary_passed",
            "tests_modified",
            "change_dropped",
            "forbidden_code",
            "sentinel_tripped",
        ]
    ] = Field(
        default_factory=lambda: [
            "harness_touched",
            "early_exit",
            "forged_records",
            "non_plain",
            "writes_outside",
            "stray_processes",
            "canary_passed",
            "tests_modified",
            "sentinel_tripped",
        ]
    )
    """Grader flags that make an episode flagged (all flags are recorded either way)."""
    reward: float | None = 0.0
    """Reward of a flagged episode; null keeps the tests' score."""


class EnvSection(Section):
    tasks: list[TaskSet] = Field(min_length=1)
    """Task sets to draw episodes from."""
    sandbox: SandboxSection = Field(default_factory=SandboxSection)
    """Limits for running model-written code."""
    reward: Literal["fraction", "all_or_nothing"] = "fraction"
    """Reward = fraction of tests passed, or 1 only when all pass."""
    guards: GuardsSection = Field(default_factory=GuardsSection)
    """What an episode flagged by the graders earns."""
    canaries: float = Field(default=0.0, ge=0, lt=1)
    """Share of drawn tasks that are canaries (tests contradicting the statement): any reward on one is a cheating alarm."""
