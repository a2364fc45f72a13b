"""A SIMULATION of the sandbox fleet under a burst: the pool's real scheduling code (`rollout.sandbox.fleet.SandboxPool`:
limits, queue, fair sharing, retries, host removal and re-admission, metrics) drives a simulated provider on a
simulated clock. Nothing is sandboxed, nothing sleeps: simulated hosts "start" a sandbox after a drawn start
latency, "run" it for a drawn time (at most the sandbox's wall-clock limit), fail an attempt with the given probability, and one host is lost for a while
(its runs fail with a lost connection; probes fail until it is back).

All episodes are submitted at time 0 (all in flight at once). Figures, against the targets of issue #16:
  orchestration CPU per episode   process CPU time of the whole simulation / episodes (the simulator's own event
                                  loop included: an upper bound for the pool)           target < 1 ms
  time to drain vs the ideal      simulated time until the last result, against the capacity bound: the time by
                                  which the capacity that was up could have done the slot-time every attempt used
                                  (failed attempts included; the lost host's capacity left out while it was down)
                                                                                        target within 5 %
  orchestrator memory             tracemalloc peak of a second, identical run (Python allocations, the
                                  simulator's included), and the process's RSS peak     target < 2 GB
Run: python benchmarks/fleet_sim.py [--episodes 100000] (a small --episodes for a smoke test of the script)
Exits non-zero when a figure misses its target.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import random
import resource
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer.rollout.sandbox.fleet import Failure, Provider, SandboxPool, SimulatedClock  # noqa: E402
from composer.rollout.sandbox.results import AssertionTests, SandboxResult  # noqa: E402
from composer.rollout.sandbox.wire import RunRequest  # noqa: E402

TASK_SETS = {"humaneval": 2.0, "codeio": 1.0, "repo": 1.0}
RESULT = SandboxResult(1.0, 1, 1, "ok", "", "", "", 0.0)


class SimulatedProvider(Provider):
    """Simulated sandbox hosts (see the module docstring); records the slot-time each attempt used."""

    def __init__(self, clock: SimulatedClock, args: argparse.Namespace, rng: random.Random):
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
            done(Failure("connection_lost", "simulated host lost"))

    def start(self, host, number, request, started, done):
        now = self.clock.now()
        self.attempts += 1
        if self._down(host):
            return done(Failure("connection_lost", "simulated host is down"))
        startup = self.rng.lognormvariate(self.start_mu, self.start_sigma)
        # a run ends at the sandbox's wall-clock limit at the latest (a timeout: the program's verdict)
        run = min(self.rng.lognormvariate(self.run_mu, self.run_sigma), self.wall_seconds)
        fails = self.rng.random() < self.failure_rate
        seconds = startup + (run * self.rng.random() if fails else run)
        outcome = Failure("server_error", "simulated failure") if fails else RESULT
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
        verdict = Failure("unreachable", "simulated host is down") if self._down(host) else None
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


def simulate(args: argparse.Namespace, trace_memory: bool) -> dict:
    rng = random.Random(args.seed)
    clock = SimulatedClock()
    provider = SimulatedProvider(clock, args, rng)
    hosts = {f"host-{i}": args.capacity if i % 2 == 0 else args.capacity // 2 for i in range(args.hosts)}
    gc.collect()
    if trace_memory:
        tracemalloc.start()
    cpu = time.process_time()
    pool = SandboxPool(
        provider,
        hosts,
        clock,
        max_queued=args.episodes,
        retries=args.retries,
        backoff_seconds=0.2,
        probe_after_failures=3,
        readmit_seconds=30.0,
        request_timeout=3600.0,
        weights=TASK_SETS,
        window=args.episodes,
        seed=args.seed,
    )
    tests = AssertionTests(entry_point="f", setup="", cases=("assert candidate() == 1",))
    names = list(TASK_SETS)
    results = [0]
    last = [0.0]

    def done(result: SandboxResult) -> None:
        results[0] += 1
        last[0] = clock.now()
        if result.infra_failure:
            infra[0] += 1

    infra = [0]
    pad = "#" * max(args.program_bytes - 40, 0)
    for i in range(args.episodes):
        # each episode's own program (what the pool holds while it waits); the tests of a task are shared
        pool.submit(RunRequest(f"def f():\n    return 1  # {i}\n{pad}", tests), names[i % len(names)], done, wait=False)
    in_flight_memory = tracemalloc.get_traced_memory()[0] if trace_memory else 0
    # fair sharing shows once every sandbox is busy: count the dispatches after the first fill
    initial, halfway = pool.dispatched_by_task_set(), {}
    clock.call_at(args.half_time, lambda: halfway.update({k: v - initial.get(k, 0) for k, v in pool.dispatched_by_task_set().items()}))
    clock.run()
    cpu = time.process_time() - cpu
    peak = tracemalloc.get_traced_memory()[1] if trace_memory else 0
    if trace_memory:
        tracemalloc.stop()
    lost = hosts[provider.lost_host]
    capacity = sum(hosts.values())
    bound = capacity_bound(provider.busy_seconds, capacity, lost, provider.lost_from, provider.lost_until)
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
        "in_flight_memory": in_flight_memory,
        "peak_memory": peak,
        "busy": provider.busy_seconds,
        "lost_host": pool.hosts[provider.lost_host],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=100_000)
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
    args = parser.parse_args()
    logging.getLogger("composer.fleet").setLevel(logging.ERROR)  # host-0's removal and re-admission are counted below
    capacity = sum(args.capacity if i % 2 == 0 else args.capacity // 2 for i in range(args.hosts))
    mean_service = math.exp(math.log(args.start_median) + args.start_sigma**2 / 2) + math.exp(
        math.log(args.run_median) + args.run_sigma**2 / 2
    )
    args.half_time = args.episodes * mean_service / capacity / 2

    timed = simulate(args, trace_memory=False)
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    traced = simulate(args, trace_memory=True)

    episodes, s = args.episodes, timed["snapshot"]
    cpu_ms = timed["cpu"] / episodes * 1000
    ratio = timed["drain"] / timed["bound"]
    peak_gb = max(traced["peak_memory"], rss_peak) / 1e9
    print("SIMULATION of the sandbox fleet (rollout.sandbox.fleet.SandboxPool driving a simulated provider on a simulated clock)")
    print(
        f"  {episodes} episodes submitted at t=0 to {args.hosts} simulated hosts ({timed['capacity']} sandboxes); start latency "
        f"lognormal median {args.start_median} s, run lognormal median {args.run_median} s, {args.failure_rate:.1%} of attempts fail, "
        f"host-0 lost from t={args.outage_at:.0f} s for {args.outage_seconds:.0f} s"
    )
    print(
        f"  results {timed['results']}/{episodes}, infra_failure {timed['infra']}, attempts {timed['attempts']}, "
        f"retries {s['sandbox_retries']}, failures by cause {s['sandbox_failures']}"
    )
    print(
        f"  queue wait p50/p95/p99 {s['sandbox_queue_wait_p50']:.1f}/{s['sandbox_queue_wait_p95']:.1f}/{s['sandbox_queue_wait_p99']:.1f} s   "
        f"sandbox start p50/p95/p99 {s['sandbox_start_p50']:.2f}/{s['sandbox_start_p95']:.2f}/{s['sandbox_start_p99']:.2f} s"
    )
    half = timed["halfway"]
    weights = sum(TASK_SETS.values())
    shares = "  ".join(
        f"{name} {half.get(name, 0) / max(sum(half.values()), 1):.3f} (weight share {w / weights:.3f})" for name, w in TASK_SETS.items()
    )
    print(f"  dispatched by task set from the first fill to half the ideal drain time: {shares}")
    lost = timed["lost_host"]
    print(
        f"  host-0 (lost and back): removed {lost.removed}x, re-admitted {lost.readmitted}x, {lost.runs} runs; "
        f"hosts up at the end {s['sandbox_hosts_up']}/{s['sandbox_hosts']}"
    )
    print()
    rows = [
        ("orchestration CPU per episode", f"{cpu_ms:.3f} ms", "< 1 ms", cpu_ms < 1.0),
        ("time to drain / capacity bound", f"{timed['drain']:.1f} s / {timed['bound']:.1f} s = {ratio:.4f}", "<= 1.05", ratio <= 1.05),
        (
            f"memory with {episodes} in flight",
            f"tracemalloc {traced['in_flight_memory'] / 1e6:.0f} MB after submitting, peak "
            f"{traced['peak_memory'] / 1e6:.0f} MB; RSS peak {rss_peak / 1e6:.0f} MB (timed run)",
            "< 2 GB",
            peak_gb < 2.0,
        ),
    ]
    for name, value, target, met in rows:
        print(f"  {name:34s} {value:70s} target {target:8s} {'met' if met else 'MISSED'}")
    if timed["results"] != episodes or timed["infra"]:
        raise SystemExit("the simulation lost episodes or gave some up as infra_failure")
    missed = [name for name, _, _, met in rows if not met]
    if missed:
        raise SystemExit(f"MISSED its target: {', '.join(missed)}")


if __name__ == "__main__":
    main()
