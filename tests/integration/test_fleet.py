"""The sandbox pool's scheduling (rollout/fleet.py) with a fake provider on a simulated clock: limits, back-pressure,
fair sharing, retries with backoff, removal and re-admission of hosts; and the wire codec of the sandbox server."""

from __future__ import annotations

import gc
import threading
import weakref
from collections import Counter

import pytest

from composer.rollout.sandbox.fleet import Failure, Provider, SandboxPool, SimulatedClock
from composer.rollout.sandbox.results import AssertionTests, SandboxResult
from composer.rollout.sandbox.wire import RunRequest

OK = SandboxResult(1.0, 1, 1, "ok", "", "", "", 0.1)
INFRA = SandboxResult(0.0, 0, 0, "infra", "the host starved the run", "", "", 0.1, infra_failure=True)


def request(i: int = 0) -> RunRequest:
    return RunRequest(f"def f():\n    return {i}\n", AssertionTests(entry_point="f", setup="", cases=(f"assert candidate() == {i}",)))


class FakeProvider(Provider):
    """A fake transport (for these tests only): each host answers `seconds` after a start, on the simulated clock,
    with what its `behaviour` returns (None: never answers); probes answer from `healthy`."""

    def __init__(self, clock: SimulatedClock, behaviour: dict, seconds: float = 1.0):
        self.clock, self.behaviour, self.seconds = clock, behaviour, seconds
        self.healthy = {host: True for host in behaviour}
        self.running: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.most_overall = 0
        self.starts: list[tuple[float, str, RunRequest]] = []
        self.probes: list[tuple[float, str]] = []

    def start(self, host, number, request, started, done):
        self.starts.append((self.clock.now(), host, request))
        self.running[host] += 1
        self.most[host] = max(self.most[host], self.running[host])
        self.most_overall = max(self.most_overall, sum(self.running.values()))
        started()
        outcome = self.behaviour[host](request)
        if outcome is None:
            return

        def finish():
            self.running[host] -= 1
            done(outcome)

        self.clock.call_at(self.clock.now() + self.seconds, finish)

    def cancel(self, host, number):
        self.running[host] -= 1

    def probe(self, host, done):
        self.probes.append((self.clock.now(), host))
        self.clock.call_at(self.clock.now() + 0.1, lambda: done(None if self.healthy[host] else Failure("probe_failed", "fake")))


def always(outcome):
    return lambda request: outcome


def pool_of(provider, capacities, **options) -> SandboxPool:
    return SandboxPool(provider, capacities, provider.clock, **options)


def submit_all(pool: SandboxPool, count: int, task_set: str = "a") -> list[SandboxResult]:
    results: list = [None] * count
    for i in range(count):
        assert pool.submit(request(i), task_set, lambda r, i=i: results.__setitem__(i, r))
    return results


def test_per_host_and_global_limits_hold_and_the_burst_drains_at_capacity():
    clock = SimulatedClock()
    provider = FakeProvider(clock, {"a": always(OK), "b": always(OK), "c": always(OK)})
    pool = pool_of(provider, {"a": 2, "b": 3, "c": 1}, max_concurrent=4)
    results = submit_all(pool, 100)
    clock.run()
    assert results == [OK] * 100
    assert provider.most_overall == 4 and all(provider.most[h] <= cap for h, cap in {"a": 2, "b": 3, "c": 1}.items())
    assert clock.now() == pytest.approx(25.0)  # 100 runs of 1 s on 4 slots
    figures = pool.snapshot()
    assert figures["sandbox_completed"] == 100 and sum(figures["sandbox_host_runs"].values()) == 100
    assert figures["sandbox_queue_wait_p50"] == pytest.approx(12.0) and figures["sandbox_queue_wait_p99"] == pytest.approx(24.0)


def test_a_full_queue_refuses_or_blocks_the_submitter_until_there_is_room():
    clock = SimulatedClock()
    pool = pool_of(FakeProvider(clock, {"a": always(OK)}), {"a": 1}, max_queued=5)
    done = []
    for i in range(6):  # one runs, five wait
        assert pool.submit(request(i), "a", done.append, wait=False)
    assert not pool.submit(request(6), "a", done.append, wait=False)
    assert pool.metrics.refused == 1

    submitted = threading.Event()
    blocked = threading.Thread(target=lambda: (pool.submit(request(7), "a", done.append), submitted.set()))
    blocked.start()
    assert not submitted.wait(0.3)  # back-pressure: the submitter waits while the queue is full
    clock.run(until=1.0)  # the first run ends, the next one starts: room for one
    assert submitted.wait(5)
    blocked.join()
    clock.run()
    assert len(done) == 7


def test_task_sets_share_the_sandboxes_by_weight():
    clock = SimulatedClock()
    provider = FakeProvider(clock, {"a": always(OK)})
    pool = pool_of(provider, {"a": 1}, weights={"humaneval": 3.0, "codeio": 1.0}, max_queued=1000)
    submit_all(pool, 400, "codeio")  # the flood arrives first
    submit_all(pool, 400, "humaneval")
    clock.run(until=100.5)
    dispatched = pool.dispatched_by_task_set()
    assert dispatched["codeio"] + dispatched["humaneval"] == 101
    # the first codeio run started at once; then three humaneval runs for each codeio one
    assert dispatched == {"codeio": 26, "humaneval": 75}
    clock.run()
    assert pool.dispatched_by_task_set() == {"codeio": 400, "humaneval": 400}


def test_a_failing_host_is_probed_removed_and_readmitted_after_its_cool_down_while_its_runs_go_elsewhere():
    clock = SimulatedClock()
    provider = FakeProvider(clock, {"bad": always(Failure("server_error", "fake")), "good": always(OK)})
    provider.healthy["bad"] = False
    pool = pool_of(provider, {"bad": 2, "good": 2}, retries=3, backoff_seconds=0.5, probe_after_failures=2, readmit_seconds=30.0, seed=1)
    results = submit_all(pool, 20)
    clock.run(until=20.0)
    assert results == [OK] * 20  # every run retried on the good host: no infra failure
    figures = pool.snapshot()
    bad_starts = sum(1 for _, host, _ in provider.starts if host == "bad")
    assert figures["sandbox_hosts_up"] == 1 and figures["sandbox_failures"]["server_error"] == bad_starts <= 4
    assert figures["sandbox_failures"]["probe_failed"] == 1 and figures["sandbox_infra_failures"] == 0
    assert pool.hosts["bad"].removed == 1
    assert [host for _, host in provider.probes] == ["bad"]

    # the host recovers: the next probe after the cool-down re-admits it and it takes runs again
    provider.healthy["bad"] = True
    provider.behaviour["bad"] = always(OK)
    clock.run(until=40.0)
    assert [host for _, host in provider.probes] == ["bad", "bad"]
    assert provider.probes[1][0] == pytest.approx(provider.probes[0][0] + 0.1 + 30.0)
    assert pool.snapshot()["sandbox_hosts_up"] == 2 and pool.hosts["bad"].readmitted == 1
    before = pool.hosts["bad"].runs
    later = submit_all(pool, 8)
    clock.run()
    assert later == [OK] * 8 and pool.hosts["bad"].runs == before + 4


def test_a_run_failing_everywhere_ends_as_infra_failure_after_backed_off_retries():
    clock = SimulatedClock()
    provider = FakeProvider(clock, {"a": always(INFRA)}, seconds=0.0)
    pool = pool_of(provider, {"a": 1}, retries=4, backoff_seconds=1.0, probe_after_failures=100, seed=3)
    results = submit_all(pool, 1)
    clock.run()
    [result] = results
    assert result is not None and result.infra_failure and result.reward == 0.0
    times = [t for t, _, _ in provider.starts]
    assert len(times) == 5  # the first attempt and four retries
    for k, (before, after) in enumerate(zip(times, times[1:])):
        assert 0.5 * 2**k <= after - before <= 1.5 * 2**k  # exponential, with jitter
    assert len({round((b - a) / 2**k, 6) for k, (a, b) in enumerate(zip(times, times[1:]))}) > 1  # jittered
    assert pool.metrics.infra_failures == 1 and pool.metrics.failures["sandbox_infra"] == 5


def test_a_lost_connection_removes_the_host_at_once_and_a_silent_host_times_out():
    clock = SimulatedClock()
    provider = FakeProvider(
        clock, {"lost": always(Failure("connection_lost", "fake")), "silent": always(None), "good": always(OK)}, seconds=0.5
    )
    provider.healthy["lost"] = False
    pool = pool_of(
        provider, {"lost": 1, "silent": 1, "good": 1}, request_timeout=10.0, probe_after_failures=1, retries=5, readmit_seconds=30.0
    )
    results = submit_all(pool, 9)
    clock.run(until=25.0)
    assert results == [OK] * 9
    # removed without a probe; probed again only after its cool-down
    assert pool.hosts["lost"].state == "down" and "lost" not in [h for _, h in provider.probes]
    assert sum(1 for _, host, _ in provider.starts if host == "lost") == 1
    assert pool.metrics.failures["timeout"] >= 1 and ("silent" in [h for _, h in provider.probes])
    clock.run(until=35.0)
    assert [t for t, h in provider.probes if h == "lost"] == [pytest.approx(0.5 + 30.0)] and pool.hosts["lost"].state == "down"


def test_a_host_that_joins_later_takes_the_queued_runs_and_widens_the_limit():
    clock = SimulatedClock()
    provider = FakeProvider(clock, {"first": always(OK), "later": always(OK)})
    pool = pool_of(provider, {"first": 2})
    results = submit_all(pool, 12)
    clock.run(until=0.5)
    assert pool.snapshot()["sandbox_running"] == 2 and pool.queued == 10
    pool.add_host("later", 4)  # a SLURM-started server that came up after the fleet opened
    assert pool.snapshot()["sandbox_running"] == 6 and pool.max_concurrent == 6
    clock.run()
    assert results == [OK] * 12 and pool.snapshot()["sandbox_host_runs"] == {"first": 4, "later": 8}
    assert clock.now() == pytest.approx(2.5)  # without it: 6.0 (12 runs of 1 s, 2 at a time)


def test_a_host_lost_between_runs_is_removed_at_once_and_probed_after_its_cool_down():
    clock = SimulatedClock()
    provider = FakeProvider(clock, {"a": always(OK), "b": always(OK)})
    pool = pool_of(provider, {"a": 1, "b": 1}, readmit_seconds=5.0)
    pool.host_lost("a", "its SLURM step ended")
    assert pool.hosts["a"].state == "down" and pool.snapshot()["sandbox_failures"] == {"connection_lost": 1}
    results = submit_all(pool, 4)
    clock.run(until=4.0)
    assert results == [OK] * 4 and all(host == "b" for _, host, _ in provider.starts)  # nothing sent to the lost host
    clock.run(until=6.0)
    assert provider.probes == [(5.0, "a")] and pool.hosts["a"].state == "up"  # the probe that starts it again passed
    pool.close()
    pool.host_lost("b", "the fleet closed")  # after close: nothing changes
    assert pool.hosts["b"].state == "up"


def test_a_finished_run_is_not_held_until_its_timeout():
    """A driver with 100k sandboxes finishes thousands of runs a second: what a finished run held (its callback,
    its program) must be freed then, not when its request timeout would have fired."""
    clock = SimulatedClock()
    pool = pool_of(FakeProvider(clock, {"a": always(OK)}, seconds=1.0), {"a": 4}, request_timeout=3600.0)
    results = []

    class Done:
        def __call__(self, result):
            results.append(result)

    callbacks = [Done() for _ in range(40)]
    for i, callback in enumerate(callbacks):
        assert pool.submit(request(i), "a", callback)
    held = [weakref.ref(callback) for callback in callbacks]
    del callbacks, callback
    clock.run(until=60.0)  # every run done (10 rounds of 4), the timeout an hour away
    gc.collect()
    assert results == [OK] * 40
    assert [ref for ref in held if ref() is not None] == []


def test_with_no_host_up_queued_runs_end_as_infra_failure():
    clock = SimulatedClock()
    provider = FakeProvider(clock, {"only": always(Failure("connection_lost", "fake"))}, seconds=0.1)
    provider.healthy["only"] = False
    pool = pool_of(provider, {"only": 1}, retries=2, readmit_seconds=5.0)
    results = submit_all(pool, 5)
    clock.run(until=3.0)
    assert all(r is not None and r.infra_failure for r in results)
    assert "no sandbox host is up" in results[-1].detail and "connection_lost" in results[-1].detail


# --- the wire codec -------------------------------------------------------------------------------


def test_requests_and_results_cross_the_wire_unchanged_and_nothing_else_does():
    from composer.rollout.sandbox.results import Call, CallTests, CaseResult, CaseTests, GeneratedCalls, ScriptRun, Statement
    from composer.rollout.sandbox.wire import SANDBOX_TYPES, ProtocolError, from_wire, to_wire

    values = [
        RunRequest("x = 1\n", ScriptRun()),
        RunRequest("p", CallTests("f", ('{"a": 1}',), ("2",), 7), "all_or_nothing"),
        RunRequest("p", GeneratedCalls("f", "g", 3, 9)),
        RunRequest(
            "p",
            CaseTests(
                "f",
                (
                    Call((1, (2, 3)), (("k", {1, 2}),), expected={"x": (1.5, None)}, compare="close", tolerance=0.1),
                    Statement("assert candidate(1)", "a loop"),
                ),
                setup="import math",
                seed=4,
            ),
        ),
        SandboxResult(
            0.5,
            1,
            2,
            "crash",
            "d",
            "out",
            "err",
            1.25,
            1900000001,
            (CaseResult(True), CaseResult(False, "e", "i", "o")),
            ("early_exit",),
            ("early_exit: why",),
        ),
    ]
    import json

    for value in values:
        assert from_wire(json.loads(json.dumps(to_wire(value, SANDBOX_TYPES))), SANDBOX_TYPES) == value
    for forged in (
        {"$dc": "Popen", "fields": {}},
        {"$dc": "RunRequest", "fields": {"program": {"$v": '"p"'}, "shell": {"$v": "1"}}},
        {"$pickle": "..."},
        {"$v": '{"$object": "os.system"}'},
        {"$v": '"p"', "$dc": "RunRequest"},
        {"$v": 3},
    ):
        with pytest.raises((ProtocolError, ValueError)):
            from_wire(forged, SANDBOX_TYPES)


def test_a_repository_task_crosses_the_wire_only_where_its_types_are_spoken():
    import json

    from composer.rollout.sandbox.wire import SANDBOX_TYPES, ProtocolError, from_wire, to_wire
    from composer.rollout.tasks.repository.grading_policy import Scope
    from composer.rollout.tasks.repository.shipping import WIRE_TYPES, ShippedTask, ShippedTrees
    from composer.rollout.tasks.repository.workspace import RepoTestPlan

    plan = RepoTestPlan(
        ("pkg", "src/other"),
        ("tests/test_a.py",),
        ("tests/test_a.py::t1",),
        (),
        ("-q",),
        60.0,
        "scored",
        (Scope("pkg/a.py", ("f", "C.g")), Scope("src/other/b.py")),
    )
    task = ShippedTask(plan, ShippedTrees("pkg", False, "a" * 64, "b" * 64, ("/usr",)), "c" * 64, "all_or_nothing")
    wire = json.loads(json.dumps(to_wire(task, WIRE_TYPES)))
    assert from_wire(wire, WIRE_TYPES) == task
    with pytest.raises(ProtocolError):
        from_wire(wire, SANDBOX_TYPES)  # the sandbox's side alone does not speak repository tasks


def test_a_real_local_fleet_runs_programs_concurrently_up_to_its_limit(tmp_path):
    from composer.recipes.env_schema import SandboxSection
    from composer.recipes.schema import SSHSection
    from composer.rollout.sandbox.hosts import SandboxFleet
    from composer.rollout.sandbox.results import ScriptRun

    fleet = SandboxFleet(SandboxSection(sandboxes_per_host=3, max_concurrent=2, wall_seconds=30), SSHSection(), root=tmp_path)
    try:
        program = "import time\nprint(time.time())\ntime.sleep(1.0)\nprint(time.time())\n"
        futures = [fleet.submit(RunRequest(program, ScriptRun())) for _ in range(4)]
        spans = [tuple(map(float, f.result().stdout_tail.split())) for f in futures]
        assert fleet.metrics()["sandbox_host_runs"] == {"localhost": 4}
    finally:
        fleet.close()

    def overlapping(at: float) -> int:
        return sum(start <= at < end for start, end in spans)

    # two at a time (the global limit, below the host's three), never more
    assert max(overlapping(start) for start, _ in spans) == 2


def test_the_fleet_simulation_script_runs_a_small_burst():
    import subprocess
    import sys

    from tests.conftest import REPO

    done = subprocess.run(
        [sys.executable, "benchmarks/fleet_sim.py", "--episodes", "3000", "--hosts", "4", "--capacity", "16"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == (1 if "MISSED" in done.stdout else 0), done.stderr  # CPU per episode is this machine's
    assert done.stdout.startswith("SIMULATION") and "results 3000/3000, infra_failure 0" in done.stdout
    for figure in ("orchestration CPU per episode", "time to drain / capacity bound", "memory with 3000 in flight"):
        assert figure in done.stdout

    # in bursts (the queue sized to one): every episode still gets its result
    done = subprocess.run(
        [sys.executable, "benchmarks/fleet_sim.py", "--episodes", "3000", "--burst", "1000", "--hosts", "4", "--capacity", "16"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == (1 if "MISSED" in done.stdout else 0), done.stderr
    assert "3000 episodes in bursts of 1000" in done.stdout and "results 3000/3000, infra_failure 0" in done.stdout
    assert "memory with bursts of 1000" in done.stdout


def test_the_fleet_simulation_exits_non_zero_when_it_misses_a_target():
    import subprocess
    import sys

    from tests.conftest import REPO

    # 60 episodes on 48 sandboxes: the slowest runs decide the drain, far above the capacity bound (simulated time)
    done = subprocess.run(
        [sys.executable, "benchmarks/fleet_sim.py", "--episodes", "60", "--hosts", "4", "--capacity", "16"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout
    missed = done.stderr.strip().splitlines()[-1]
    assert missed.startswith("MISSED its target: ") and "time to drain / capacity bound" in missed, done.stderr


def test_the_live_view_shows_the_fleet_in_one_row(tmp_path):
    import io

    from rich.console import Console

    from composer.rl.console import RLConsole

    clock = SimulatedClock()
    provider = FakeProvider(clock, {"a": always(OK), "b": always(Failure("connection_lost", "fake"))})
    pool = pool_of(provider, {"a": 1, "b": 1})
    submit_all(pool, 4)
    clock.run(until=10.0)
    view = RLConsole(Console(file=io.StringIO(), width=200), "smoke-rl", steps=4, metrics=tmp_path / "metrics.jsonl", verbose=False)
    with view:
        view.group(
            "g0000001",
            {
                "engine": 0,
                "host": "localhost",
                "policy_version": 0,
                "reward_mean": 0.5,
                "generated_tokens_per_s": 100.0,
                "group_seconds": 2.0,
                **pool.snapshot(),
            },
        )
        rows = dict(view.figures())
    assert rows["sandboxes"] == (
        "hosts 1/2 up   queue wait p95 3.00 s   start p95 0.000 s   retries 1   infra 0   failures connection_lost 1"
    )


def test_the_sandbox_server_grades_what_it_is_sent_and_refuses_what_is_not_a_request(tmp_path):
    """The server over plain pipes (what SSH gives it): a run, a forged request, then a frame too large to be one."""
    import subprocess
    import sys

    from composer.recipes.env_schema import SandboxSection
    from composer.rollout.sandbox.wire import SANDBOX_TYPES, SERVER_MODULE, frame_bytes, from_wire, read_frame, to_wire
    from composer.rollout.sandbox_host import MODULE
    from tests.conftest import REPO

    assert MODULE == SERVER_MODULE  # the name the fleet starts over SSH is the program's own
    server = subprocess.Popen(
        [sys.executable, "-m", MODULE], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:

        def send(message: dict) -> None:
            server.stdin.write(frame_bytes(message))
            server.stdin.flush()

        def receive() -> dict:
            return read_frame(server.stdout.read)

        send({"op": "hello", "sandbox": SandboxSection(wall_seconds=30).model_dump(), "threads": 2})
        ready = receive()
        assert ready["op"] == "ready" and ready["cpus"] >= 1 and set(ready["isolation"]) == {"dedicated_uid", "namespaces"}
        send({"op": "run", "id": 1, "request": to_wire(request(5), SANDBOX_TYPES)})
        send({"op": "run", "id": 2, "request": {"$dc": "Popen", "fields": {}}})
        replies = {}
        while len(replies) < 2:
            message = receive()
            if message["op"] != "started":
                replies[message["id"]] = message
        assert replies[2]["op"] == "failed" and "bad request" in replies[2]["error"]
        assert replies[1]["op"] == "result" and from_wire(replies[1]["result"], SANDBOX_TYPES).reward == 1.0
        server.stdin.write((1 << 31).to_bytes(4, "big"))  # a frame of 2 GiB: not the protocol's
        server.stdin.flush()
        assert receive() is None and server.wait(timeout=30) == 0  # it hangs up
        assert b"a frame of 2147483648 bytes" in server.stderr.read()
    finally:
        server.kill()
        server.wait()
