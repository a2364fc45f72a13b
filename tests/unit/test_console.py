"""What a run shows on its terminal: library output kept in the run's logs, the RL live view and its plain lines."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap

import pytest
from rich.console import Console

from composer.rl.console import RLConsole, alarms
from composer.runtime import progress
from composer.runtime.run_dir import MetricsWriter
from tests.conftest import REPO

SCRIPT = textwrap.dedent("""
    import atexit, logging, os, subprocess, sys
    from pathlib import Path
    from composer.runtime.processes import output_to_log

    atexit.register(lambda: os.write(2, b"nanobind: leaked 3 functions!\\n"))  # as a library's teardown does, last
    log = Path(sys.argv[1])
    with output_to_log(log) as terminal:
        terminal.write("composer: step 1/2\\n")
        print("library print")
        logging.getLogger("vllm").warning("library warning")
        os.write(2, b"C library stderr\\n")
        subprocess.run(["sh", "-c", "echo child process"], check=True)
        terminal.write("composer: step 2/2\\n")
    print("composer: done")
    if len(sys.argv) > 2:
        raise SystemExit("error: the run failed; see " + str(log))
""")


def run_script(tmp_path, *extra):
    log = tmp_path / "logs" / "driver.log"
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(log), *extra], cwd=REPO, capture_output=True, text=True, timeout=60)
    return result, log.read_text()


def test_library_output_goes_to_the_log_and_composer_lines_to_the_terminal(tmp_path):
    result, log = run_script(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "composer: step 1/2\ncomposer: step 2/2\ncomposer: done\n"
    assert result.stderr == ""  # the exit report of the library is not shown...
    for line in ("library print", "library warning", "C library stderr", "child process", "nanobind: leaked 3 functions!"):
        assert line in log  # ...but kept, as is everything the libraries said


def test_an_error_after_the_run_still_reaches_the_terminal(tmp_path):
    result, log = run_script(tmp_path, "fail")
    assert result.returncode == 1
    assert result.stderr.startswith("error: the run failed; see ")
    assert "leaked" not in result.stderr and "leaked" in log


def write_steps(path, steps, **extra):
    with MetricsWriter(path) as metrics:
        for step in steps:
            metrics.write(
                step,
                loss=0.1,
                grad_norm=1.0,
                reward_mean=0.25 * step,
                pass_rate=0.1,
                staleness_mean=0.5,
                staleness_max=1,
                trained_tokens_per_s=2000.0,
                sync_ratio=40.0,
                sync_seconds=0.3,
                wait_seconds=1.0,
                dropped_stale=0,
                is_clip_fraction=0.0,
                groups="g0000000",
                **extra,
            )


def test_plain_lines_off_a_terminal_say_step_eta_and_figures_without_control_codes(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    out = io.StringIO()
    view = RLConsole(Console(file=out, width=200), "smoke-rl", steps=4, metrics=metrics, verbose=False)
    with view:
        view.note("starting embedded engines")
        view.group(
            "g0000000",
            {
                "engine": 0,
                "host": "localhost",
                "policy_version": 0,
                "reward_mean": 0.5,
                "generated_tokens_per_s": 100.0,
                "group_seconds": 2.0,
            },
        )
        write_steps(metrics, [1])
        view.poll()
        write_steps(metrics, [2, 3])
        view.poll()  # within PLAIN_EVERY_SECONDS of the last line: nothing printed
        monkeypatch.setattr(progress, "PLAIN_EVERY_SECONDS", 0.0)
        write_steps(metrics, [4])
        view.poll()
    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue()
    assert lines[0] == "rl: starting embedded engines"
    assert [line.split()[2] for line in lines[1:]] == ["1/4", "4/4"]
    assert "reward 0.250 pass rate 0.100" in lines[1] and "eta 0:00:00" in lines[2] and "reward 1.000" in lines[2]
    assert "ratio 40.0x 0.30 s" in lines[2] and "trained 2000" in lines[2] and "alarms none" in lines[2]
    assert "g0000000" not in out.getvalue()  # group lines only with --verbose


def test_a_sync_that_stored_nothing_says_so_rather_than_a_ratio_over_one_byte(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_steps(metrics, [1], sync_bytes=0)
    with RLConsole(Console(file=io.StringIO(), width=200), "smoke-rl", steps=1, metrics=metrics, verbose=False) as view:
        assert dict(view.figures())["last sync"] == "v1   nothing changed   0.30 s"


def test_live_view_on_a_terminal_and_group_lines_with_verbose(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_steps(metrics, [1, 2, 3])  # a resumed run: the steps done count from the start
    out = io.StringIO()
    view = RLConsole(Console(file=out, width=120, force_terminal=True), "smoke-rl", steps=10, metrics=metrics, verbose=True)
    with view:
        view.group(
            "g0000003",
            {
                "engine": 1,
                "host": "localhost",
                "policy_version": 3,
                "reward_mean": 0.5,
                "generated_tokens_per_s": 100.0,
                "group_seconds": 2.0,
            },
        )
        write_steps(metrics, [4], eval_pass_at_1=0.4)
        print("a library's line")  # stays on stdout (the log, in a run), never shown above the view
        text = Console(width=120, file=io.StringIO(), record=True)
        text.print(view.render())
        screen = text.export_text()
    assert "rl smoke-rl  step 4/10" in screen and "eta" in screen
    assert "held-out" in screen and "pass_at_1 0.400" in screen
    assert "g0000003\x1b[0m engine 1 (localhost)  policy v3" in out.getvalue()
    assert "a library's line" not in out.getvalue()


def test_alarms_name_what_needs_a_look():
    assert alarms({"loss": 1.0, "grad_norm": 1.0}) == []
    assert alarms({"loss": "nan", "grad_norm": 1.0, "dropped_stale": 2, "is_clip_fraction": 0.5, "alarm_ratio_error": 1}) == [
        "loss or grad norm not finite",
        "2 stale group(s) dropped",
        "importance-sampling clip fraction 0.50",
        "ratio_error",
    ]


def test_tensorboard_gets_every_numeric_value_of_a_record(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = progress.TensorBoard(tmp_path / "tb", first_step=0)
    board.write(1, {"reward_mean": 0.5, "groups": "g0,g1", "loss": float("nan"), "sync_ratio": 40})
    board.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["reward_mean", "sync_ratio"]
    assert json.loads(json.dumps(events.Scalars("reward_mean")[0].value)) == 0.5


def test_a_driver_crash_ends_in_its_cause_and_the_log_that_holds_the_traceback(tmp_path, capsys):
    from composer.recipes.errors import RunFailed
    from composer.rl.driver import crash_explained

    log = tmp_path / "driver.log"
    with pytest.raises(RunFailed) as failed:
        with crash_explained(log):
            raise RuntimeError("engine died")
    assert str(failed.value) == f"the driver failed: RuntimeError: engine died\ntraceback in {log}" and failed.value.exit_code == 1
    assert "Traceback" in capsys.readouterr().err  # stderr is the log while the driver runs


def test_the_view_follows_a_metrics_file_the_resuming_learner_replaced(tmp_path):
    from composer.rl.console import MetricsTail
    from composer.runtime.run_dir import drop_records_after

    metrics = tmp_path / "metrics.jsonl"
    write_steps(metrics, [1, 2, 3])
    tail = MetricsTail(metrics)
    assert [r["step"] for r in tail.new_records()] == [1, 2, 3]
    drop_records_after(metrics, 1)  # atomically replaced: steps 2 and 3 are trained again
    write_steps(metrics, [2])
    assert [r["step"] for r in tail.new_records()] == [1, 2] and tail.restarted
    with metrics.open("a") as f:
        f.write('{"step": 3, "loss"')  # being written
    assert tail.new_records() == [] and not tail.restarted
    with metrics.open("a") as f:
        f.write(": 0.1}\n")
    assert [r["step"] for r in tail.new_records()] == [3]
