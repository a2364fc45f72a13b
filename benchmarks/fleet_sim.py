"""A SIMULATION of the sandbox fleet under a burst: the pool's real scheduling code (`rollout.sandbox.fleet.SandboxPool`:
limits, queue, fair sharing, retries, host removal and re-admission, metrics) drives a simulated provider on a
simulated clock. Nothing is sandboxed, nothing sleeps: simulated hosts "start" a sandbox after a drawn start
latency, "run" it for a drawn time (at most the sandbox's wall-clock limit), fail an attempt with the given probability, and one host is lost for a while
(its runs fail with a lost connection; probes fail until it is back).

All episodes are submitted at time 0 (all in flight at once), or with `--burst N` in bursts of N: the first at
time 0, each next one as soon as the one before has left the queue (every run of it is on a host or done), the way
a driver keeps a fleet of N sandboxes busy; the pool's queue holds at most one burst. Figures, against the targets
of issue #16:
  orchestration CPU per episode   process CPU time of the whole simulation / episodes (the simulator's own event
                                  loop included: an upper bound for the pool)           target < 1 ms
  time to drain vs the ideal      simulated time until the last result, against the capacity bound: the time by
                                  which the capacity that was up could have done the slot-time every attempt used
                                  (failed attempts included; the lost host's capacity left out while it was down)
                                                                                        target within 5 %
  orchestrator memory             tracemalloc peak of a second, identical run (Python allocations, the
                                  simulator's included), and the process's RSS peak     target < 2 GB
Run: python benchmarks/fleet_sim.py [--episodes 100000] (a small --episodes for a smoke test of the script)
     python benchmarks/fleet_sim.py --episodes 1000000 --burst 100000 --hosts 1250 --capacity 107 --before REV
       (1M episodes in bursts of 100k on 100k sandboxes; --before REV also runs the pool of rollout/sandbox/fleet.py
       at git revision REV on the same simulation and prints both, each measured in a process of its own)
Exits non-zero when a figure (of this tree's pool) misses its target.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import math
import random
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from composer.rollout.sandbox import fleet as this_fleet  # noqa: E402
from composer.rollout.sandbox.results import AssertionTests, SandboxResult  # noqa: E402
from composer.rollout.sandbox.wire import RunRequest  # noqa: E402

TASK_SETS = {"humaneval": 2.0, "codeio": 1.0, "repo": 1.0}
RESULT = SandboxResult(1.0, 1, 1, "ok", "", "", "", 0.0)


class SimulatedProvider(this_fleet.Provider):
    """Simulated sandbox hosts (see the module docstring); records the slot-time each attempt used."""

    def __init__(self, fleet: ModuleType, clock, args: argparse.Namespace, rng: random.Random):
        self.failure = fleet.Failure  # the pool under test knows failures by its own class
        self.clock, self.rng = clock, rng
        self.start_mu, self.start_sigma = math.log(args.start_median), args.start_sigma
        self.run_mu, self.run_sigma = math.log(args.run_median), args.run_sigma
        self.failure_rate, self.wall_seconds = args.failure_rate, args.wall_seconds
        self.lost_host, self.lost_from, self.lost_until = "host-0", args.outage_at, args.outage_at + args.outage_seconds
        self.in_flight: dict[int, tuple[float, object]] = {}
        """Runs on the lost host: start time and their `done`, failed when it goes."""
        self.busy_seconds = 0.0
        self.attempts = 0
        clock.call_at(self.lost_from, self._lose_host)

    def _down(self, host: str) -> bool:
        return host == self.lost_host and self.lost_from <= self.clock.now() < self.lost_until

    def _lose_host(self) -> None:
        now = self.clock.now()
        lost, self.in_flight = self.in_flight, {}
        for started_at, done in lost.values():
            self.busy_seconds += now - started_at
            done(self.failure("connection_lost", "simulated host lost"))

    def start(self, host, number, request, started, done):
        now = self.clock.now()
        self.attempts += 1
        if self._down(host):
            return done(self.failure("connection_lost", "simulated host is down"))
        startup = self.rng.lognormvariate(self.start_mu, self.start_sigma)
        # a run ends at the sandbox's wall-clock limit at the latest (a timeout: the program's verdict)
        run = min(self.rng.lognormvariate(self.run_mu, self.run_sigma), self.wall_seconds)
        fails = self.rng.random() < self.failure_rate
        seconds = startup + (run * self.rng.random() if fails else run)
        outcome = self.failure("server_error", "simulated failure") if fails else RESULT
        if host == self.lost_host:
            self.in_flight[number] = (now, done)
        self.clock.call_at(now + startup, started)
        self.clock.call_at(now + seconds, lambda: self._finish(host, number, now, seconds, done, outcome))

    def _finish(self, host, number, started_at, seconds, done, outcome) -> None:
        if host == self.lost_host and self.in_flight.pop(number, None) is None:
            return  # failed with its host already
        self.busy_seconds += seconds
        done(outcome)

    def cancel(self, host, number):
        self.in_flight.pop(number, None)

    def probe(self, host, done):
        verdict = self.failure("unreachable", "simulated host is down") if self._down(host) else None
        self.clock.call_at(self.clock.now() + 0.5, lambda: done(verdict))


def capacity_bound(busy_seconds: float, capacity: int, lost: int, lost_from: float, lost_until: float) -> float:
    """The earliest time by which the capacity that was up can have done `busy_seconds` of slot-time."""
    before = capacity * lost_from
    if busy_seconds <= before:
        return busy_seconds / capacity
    during = (capacity - lost) * (lost_until - lost_from)
    if busy_seconds <= before + during:
        return lost_from + (busy_seconds - before) / (capacity - lost)
    return lost_until + (busy_seconds - before - during) / capacity


def simulate(fleet: ModuleType, args: argparse.Namespace, trace_memory: bool) -> dict:
    rng = random.Random(args.seed)
    clock = fleet.SimulatedClock()
    provider = SimulatedProvider(fleet, clock, args, rng)
    hosts = {f"host-{i}": args.capacity if i % 2 == 0 else args.capacity // 2 for i in range(args.hosts)}
    burst = args.burst or args.episodes
    gc.collect()
    if trace_memory:
        tracemalloc.start()
    cpu = time.process_time()
    pool = fleet.SandboxPool(
        provider,
        hosts,
        clock,
        max_queued=burst,
        retries=args.retries,
        backoff_seconds=0.2,
        probe_after_failures=3,
        readmit_seconds=30.0,
        request_timeout=3 * args.wall_seconds + 60,  # what rollout.sandbox.hosts gives the pool
        weights=TASK_SETS,
        window=args.episodes,
        seed=args.seed,
    )
    tests = AssertionTests(entry_point="f", setup="", cases=("assert candidate() == 1",))
    names = list(TASK_SETS)
    results = [0]
    last = [0.0]
    infra = [0]

    def done(result: SandboxResult) -> None:
        results[0] += 1
        last[0] = clock.now()
        if result.infra_failure:
            infra[0] += 1

    pad = "#" * max(args.program_bytes - 40, 0)
    submitted = [0]
    in_flight_memory = [0]

    def submit_burst() -> None:
        # each episode's own program (what the pool holds while it waits); the tests of a task are shared
        for i in range(submitted[0], min(submitted[0] + burst, args.episodes)):
            accepted = pool.submit(RunRequest(f"def f():\n    return 1  # {i}\n{pad}", tests), names[i % len(names)], done, wait=False)
            assert accepted, "the queue refused a burst it had room for"
        submitted[0] = min(submitted[0] + burst, args.episodes)
        if trace_memory:
            in_flight_memory[0] = max(in_flight_memory[0], tracemalloc.get_traced_memory()[0])

    def feed() -> None:
        """The next burst once the queue is empty (checked every 0.1 s of simulated time)."""
        if queued(pool) == 0:
            submit_burst()
        if submitted[0] < args.episodes:
            clock.call_at(clock.now() + 0.1, feed)

    submit_burst()
    if submitted[0] < args.episodes:
        clock.call_at(0.0, feed)
    # fair sharing shows once every sandbox is busy: count the dispatches after the first fill
    initial, halfway = pool.dispatched_by_task_set(), {}
    clock.call_at(args.half_time, lambda: halfway.update({k: v - initial.get(k, 0) for k, v in pool.dispatched_by_task_set().items()}))
    clock.run()
    cpu = time.process_time() - cpu
    peak = tracemalloc.get_traced_memory()[1] if trace_memory else 0
    if trace_memory:
        tracemalloc.stop()
    lost = pool.hosts[provider.lost_host]
    capacity = sum(hosts.values())
    bound = capacity_bound(provider.busy_seconds, capacity, hosts[provider.lost_host], provider.lost_from, provider.lost_until)
    return {
        "cpu": cpu,
        "drain": last[0],
        "bound": bound,
        "results": results[0],
        "infra": infra[0],
        "capacity": capacity,
        "attempts": provider.attempts,
        "snapshot": pool.snapshot(),
        "halfway": halfway,
        "in_flight_memory": in_flight_memory[0],
        "peak_memory": peak,
        "busy": provider.busy_seconds,
        "lost_host": {"removed": lost.removed, "readmitted": lost.readmitted, "runs": lost.runs},
    }


def queued(pool) -> int:
    # a pool from before `SandboxPool.queued` (--before REV) is read by its counter
    return pool.queued if hasattr(type(pool), "queued") else pool._queued


def measure(fleet: ModuleType, args: argparse.Namespace) -> dict:
    """One pool's figures: a timed run (its CPU, and the process's RSS peak), then an identical run under tracemalloc."""
    timed = simulate(fleet, args, trace_memory=False)
    timed["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    traced = simulate(fleet, args, trace_memory=True)
    timed["in_flight_memory"], timed["peak_memory"] = traced["in_flight_memory"], traced["peak_memory"]
    return timed


def load_fleet(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("fleet_under_test", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def measure_in_child(argv: list[str], fleet_file: Path | None) -> dict:
    """`measure` in a fresh process (its own RSS peak and heap), with this tree's pool or the one in `fleet_file`."""
    more = ["--fleet-file", str(fleet_file)] if fleet_file else []
    done = subprocess.run([sys.executable, __file__, *argv, *more, "--measure-only"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the simulation of {fleet_file or 'this tree'} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def report(label: str, args: argparse.Namespace, timed: dict) -> list[tuple[str, str, str, bool]]:
    episodes, s = args.episodes, timed["snapshot"]
    print(
        f"  {label}results {timed['results']}/{episodes}, infra_failure {timed['infra']}, attempts {timed['attempts']}, "
        f"retries {s['sandbox_retries']}, failures by cause {s['sandbox_failures']}"
    )
    print(
        f"  {label}queue wait p50/p95/p99 {s['sandbox_queue_wait_p50']:.1f}/{s['sandbox_queue_wait_p95']:.1f}/"
        f"{s['sandbox_queue_wait_p99']:.1f} s   sandbox start p50/p95/p99 {s['sandbox_start_p50']:.2f}/{s['sandbox_start_p95']:.2f}/"
        f"{s['sandbox_start_p99']:.2f} s"
    )
    if not args.burst:  # (a burst holds the task sets in equal numbers: a set's share reaches its weight only while it has runs queued)
        half = timed["halfway"]
        weights = sum(TASK_SETS.values())
        shares = "  ".join(
            f"{name} {half.get(name, 0) / max(sum(half.values()), 1):.3f} (weight share {w / weights:.3f})" for name, w in TASK_SETS.items()
        )
        print(f"  {label}dispatched by task set from the first fill to half the ideal drain time: {shares}")
    lost = timed["lost_host"]
    print(
        f"  {label}host-0 (lost and back): removed {lost['removed']}x, re-admitted {lost['readmitted']}x, {lost['runs']} runs; "
        f"hosts up at the end {s['sandbox_hosts_up']}/{s['sandbox_hosts']}"
    )
    cpu_ms = timed["cpu"] / episodes * 1000
    ratio = timed["drain"] / timed["bound"]
    peak_gb = max(timed["peak_memory"], timed["rss_peak"]) / 1e9
    in_flight = f"bursts of {args.burst}" if args.burst else f"{episodes} in flight"
    return [
        (f"{label}orchestration CPU per episode", f"{cpu_ms:.3f} ms", "< 1 ms", cpu_ms < 1.0),
        (
            f"{label}time to drain / capacity bound",
            f"{timed['drain']:.1f} s / {timed['bound']:.1f} s = {ratio:.4f}",
            "<= 1.05",
            ratio <= 1.05,
        ),
        (
            f"{label}memory with {in_flight}",
            f"tracemalloc {timed['in_flight_memory'] / 1e6:.0f} MB after submitting, peak "
            f"{timed['peak_memory'] / 1e6:.0f} MB; RSS peak {timed['rss_peak'] / 1e6:.0f} MB (timed run)",
            "< 2 GB",
            peak_gb < 2.0,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=100_000)
    parser.add_argument("--burst", type=int, default=0, help="submit the episodes in bursts of this many (0: all at time 0)")
    parser.add_argument("--hosts", type=int, default=40, help="simulated hosts; even ones run --capacity sandboxes, odd ones half")
    parser.add_argument("--capacity", type=int, default=64)
    parser.add_argument("--start-median", type=float, default=0.5, help="sandbox start latency, lognormal (seconds)")
    parser.add_argument("--start-sigma", type=float, default=0.6)
    parser.add_argument("--run-median", type=float, default=8.0, help="run time, lognormal (seconds)")
    parser.add_argument("--run-sigma", type=float, default=0.5)
    parser.add_argument("--wall-seconds", type=float, default=20.0, help="the sandbox's wall-clock limit (env.sandbox.wall_seconds)")
    parser.add_argument("--failure-rate", type=float, default=0.01, help="share of attempts a host fails")
    parser.add_argument("--retries", type=int, default=4)
    parser.add_argument("--outage-at", type=float, default=60.0, help="simulated time host-0 is lost at")
    parser.add_argument("--outage-seconds", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--program-bytes", type=int, default=2048, help="size of each episode's program")
    parser.add_argument("--before", metavar="REV", help="also simulate the pool of rollout/sandbox/fleet.py at this git revision")
    parser.add_argument("--fleet-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    args = parser.parse_args(argv)
    logging.getLogger("composer.fleet").setLevel(logging.ERROR)  # host-0's removal and re-admission are counted below
    capacity = sum(args.capacity if i % 2 == 0 else args.capacity // 2 for i in range(args.hosts))
    mean_service = math.exp(math.log(args.start_median) + args.start_sigma**2 / 2) + math.exp(
        math.log(args.run_median) + args.run_sigma**2 / 2
    )
    args.half_time = args.episodes * mean_service / capacity / 2
    if args.measure_only:
        print(json.dumps(measure(load_fleet(args.fleet_file) if args.fleet_file else this_fleet, args)))
        return

    before = None
    if args.before:
        with tempfile.TemporaryDirectory(prefix="fleet-before-") as tmp:
            old = Path(tmp) / "fleet.py"
            shown = subprocess.run(
                ["git", "-C", str(REPO), "show", f"{args.before}:rollout/sandbox/fleet.py"], capture_output=True, text=True
            )
            if shown.returncode != 0:
                raise SystemExit(f"--before {args.before}: {shown.stderr.strip()}")
            old.write_text(shown.stdout)
            before = measure_in_child([a for a in argv if a not in ("--before", args.before)], old)
    timed = measure_in_child([a for a in argv if a not in ("--before", args.before)], None)

    print("SIMULATION of the sandbox fleet (rollout.sandbox.fleet.SandboxPool driving a simulated provider on a simulated clock)")
    submitted = f"in bursts of {args.burst}" if args.burst else "submitted at t=0"
    print(
        f"  {args.episodes} episodes {submitted} to {args.hosts} simulated hosts ({timed['capacity']} sandboxes); start latency "
        f"lognormal median {args.start_median} s, run lognormal median {args.run_median} s, {args.failure_rate:.1%} of attempts fail, "
        f"host-0 lost from t={args.outage_at:.0f} s for {args.outage_seconds:.0f} s"
    )
    before_rows = report(f"before ({args.before}): ", args, before) if before else []
    rows = report("", args, timed)
    print()
    for name, value, target, met in [*before_rows, *rows]:
        print(f"  {name:34s} {value:70s} target {target:8s} {'met' if met else 'MISSED'}")
    if before:
        print(
            f"  this tree / {args.before}: CPU per episode {timed['cpu'] / before['cpu']:.2f}x, tracemalloc peak "
            f"{timed['peak_memory'] / before['peak_memory']:.2f}x, RSS peak {timed['rss_peak'] / before['rss_peak']:.2f}x"
        )
    if timed["results"] != args.episodes or timed["infra"]:
        raise SystemExit("the simulation lost episodes or gave some up as infra_failure")
    missed = [name for name, _, _, met in rows if not met]
    if missed:
        raise SystemExit(f"MISSED its target: {', '.join(missed)}")


if __name__ == "__main__":
    main()
