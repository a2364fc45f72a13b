"""Trackers users already run: a W&B offline run directory and an MLflow file store receive the same series, at the
same steps, as the run's metrics.jsonl (and TensorBoard as before); a resumed run logs into the same runs."""

import json

import pytest

from composer.runtime.progress import Trackers
from composer.runtime.run_dir import MetricsWriter, read_metrics

RECORDS = [
    {"loss": 4.0 / step, "reward_mean": step / 10, "sync_ratio": 20.0 + step, "groups": "g1,g2", "alarm": False} for step in range(1, 7)
]


def log_steps(run, steps):
    trackers = Trackers(run, "tracked", first_step=steps[0] - 1)
    with MetricsWriter(run / "metrics.jsonl") as metrics:
        for step in steps:
            metrics.write(step, **RECORDS[step - 1])
            trackers.write(step, RECORDS[step - 1])
    trackers.close()


def expected(run):
    series = {}
    for record in read_metrics(run / "metrics.jsonl"):
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, float):
                series.setdefault(key, []).append((record["step"], value))
    return series


def wandb_records(path):
    """The records of an offline run's .wandb file: a 7-byte header, then LevelDB-log blocks of 32 KiB whose records
    are checksum (4 bytes), length (2, little-endian), type (1: whole, 2/3/4: first, middle, last piece), data."""
    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        piece, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield piece
        elif kind in (2, 3):
            pending = (pending if kind == 3 else b"") + piece
        elif kind == 4:
            yield pending + piece


def wandb_series(run):
    from wandb.proto import wandb_internal_pb2

    series = {}
    for path in sorted((run / "wandb").glob("offline-run-*/run-*.wandb")):
        for data in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        series.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
    return series


def mlflow_series(store):
    series = {}
    for metric in store.glob("*/*/metrics/*"):
        for line in metric.read_text().splitlines():
            _, value, step = line.split()
            series.setdefault(metric.name, []).append((int(step), float(value)))
    return {k: sorted(v) for k, v in series.items()}


def test_wandb_offline_and_mlflow_file_store_get_the_metrics_series(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores behind this switch
    run = tmp_path / "run"
    run.mkdir()
    log_steps(run, [1, 2, 3])
    log_steps(run, [4, 5, 6])  # resumed: the same W&B run id, the same MLflow run
    want = expected(run)
    assert sorted(want) == ["loss", "reward_mean", "sync_ratio"] and len(want["loss"]) == 6
    assert mlflow_series(tmp_path / "mlruns") == want
    assert len(list((tmp_path / "mlruns").glob("*/*/metrics"))) == 1  # one MLflow run across the resume
    ids = json.loads((run / "trackers.json").read_text())
    assert {p.name.rsplit("-", 1)[1] for p in (run / "wandb").glob("offline-run-*")} == {ids["wandb"]}
    assert wandb_series(run) == want
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_without_configuration_only_tensorboard_is_written(tmp_path, monkeypatch):
    for variable in ("WANDB_MODE", "WANDB_API_KEY", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(variable, raising=False)
    log_steps(tmp_path, [1, 2])
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "trackers.json").exists()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
