"""Trajectories (`rollout.agent.trajectory`: one episode each) as the RL run hands them from rollouts to the learner,
stored durably and compactly, and the stages a group passes through (their meaning: `rl.protocol`).

A group (the samples of one prompt) is the unit of storage: one zstd-compressed file, written with
temp + fsync + rename and verified by a checksum on read. Its first line after the magic is a small JSON
header (the policy version that made the group), so staleness is decided without decompressing the group.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np
import zstandard

from composer.recipes.errors import UserError
from composer.rollout.agent.trajectory import Segment, Trajectory
from composer.rollout.sandbox.graders import FLAGS
from composer.runtime.run_dir import atomic_write_bytes, fsync_dir

_MAGIC = b"CTRJ2\n"
_HEADER_LIMIT = 4096


def encode_group(trajectories: list[Trajectory], level: int = 3) -> bytes:
    arrays: dict[str, np.ndarray] = {}
    meta = []
    for t, traj in enumerate(trajectories):
        segs = []
        for s, seg in enumerate(traj.segments):
            key = f"{t}.{s}"
            arrays[f"{key}.tokens"] = seg.token_ids
            arrays[f"{key}.mask"] = seg.loss_mask
            arrays[f"{key}.logprobs"] = seg.logprobs
            if seg.routed_experts is not None:
                arrays[f"{key}.routes"] = seg.routed_experts
            segs.append(key)
        meta.append(
            {
                "id": traj.id,
                "group_id": traj.group_id,
                "task_id": traj.task_id,
                "policy_version": traj.policy_version,
                "reward": traj.reward,
                "info": traj.info,
                "segments": segs,
            }
        )
    buffer = io.BytesIO()
    np.savez(buffer, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    header = json.dumps({"policy_version": min(t.policy_version for t in trajectories)}).encode() + b"\n"
    body = header + zstandard.ZstdCompressor(level=level).compress(buffer.getvalue())
    return _MAGIC + hashlib.blake2b(body, digest_size=16).hexdigest().encode() + b"\n" + body


def _split(data: bytes, source: str) -> tuple[str, bytes, bytes]:
    """(checksum, header line, compressed arrays) of a group file's bytes (the first bytes suffice for the header)."""
    digest_end = data.find(b"\n", len(_MAGIC))
    header_end = data.find(b"\n", digest_end + 1) if digest_end > 0 else -1
    if not data.startswith(_MAGIC) or header_end < 0:
        raise UserError(f"{source}: not a composer trajectory file")
    return data[len(_MAGIC) : digest_end].decode(errors="replace"), data[digest_end + 1 : header_end + 1], data[header_end + 1 :]


def group_policy_version(path: Path) -> int:
    """The policy version that made a stored group, read from its header alone."""
    with path.open("rb") as f:
        _, header, _ = _split(f.read(_HEADER_LIMIT), str(path))
    try:
        return int(json.loads(header)["policy_version"])
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{path}: damaged trajectory header") from None


def decode_group(data: bytes, source: str = "trajectory file") -> list[Trajectory]:
    digest, header, arrays_part = _split(data, source)
    if hashlib.blake2b(header + arrays_part, digest_size=16).hexdigest() != digest:
        raise UserError(f"{source}: checksum mismatch (corrupt or truncated)")
    with np.load(io.BytesIO(zstandard.ZstdDecompressor().decompress(arrays_part))) as z:
        arrays = {k: z[k] for k in z.files}
    trajectories = []
    for m in json.loads(arrays.pop("__meta__").tobytes()):
        segments = [
            Segment(arrays[f"{k}.tokens"], arrays[f"{k}.mask"], arrays[f"{k}.logprobs"], arrays.get(f"{k}.routes"))
            for k in m.pop("segments")
        ]
        trajectories.append(Trajectory(segments=segments, **m))
    return trajectories


def episode_stats(trajectories: list[Trajectory], max_context: int) -> dict[str, float]:
    """Self-summarization health (how often, how long, how far past the context, the reward with and without; the
    compaction error where tasks know their facts),
    tool use (calls per episode, the share that were errors), grader flags (`flag_<name>_rate`), infrastructure failures and canaries (passes are cheating alarms)."""
    summaries = [t.info["summaries"] for t in trajectories]
    lengths = [n for t in trajectories for n in t.info["summary_tokens"]]
    stats = {
        "summaries_per_episode": sum(summaries) / len(trajectories),
        "episode_tokens_over_context": sum(t.num_tokens for t in trajectories) / len(trajectories) / max_context,
    }
    if lengths:
        stats["summary_tokens_mean"] = sum(lengths) / len(lengths)
    compactions = [t.info.get("compactions", t.info["summaries"]) for t in trajectories]
    if any(compactions):
        stats["compactions_per_episode"] = sum(compactions) / len(trajectories)
    errors = [x for t in trajectories for x in t.info.get("compaction_errors", ())]
    if errors:  # tasks that know their facts (recall): the share of facts still needed that a compaction dropped
        stats["compaction_error_mean"] = sum(errors) / len(errors)
    for label, chosen in (
        ("reward_with_summaries", [t for t in trajectories if t.info["summaries"]]),
        ("reward_without_summaries", [t for t in trajectories if not t.info["summaries"]]),
    ):
        if chosen:
            stats[label] = sum(t.reward for t in chosen) / len(chosen)
    calls = sum(t.info.get("tool_calls", 0) for t in trajectories)
    errors = sum(t.info.get("tool_errors", 0) for t in trajectories)
    if calls or errors:  # the tools harness: how much the policy calls tools, and how often it gets a call wrong
        stats["tool_calls_per_episode"] = calls / len(trajectories)
        stats["tool_error_rate"] = errors / max(calls, errors, 1)
    flags = [set(t.info.get("flags", ())) for t in trajectories]
    for name in FLAGS:
        stats[f"flag_{name}_rate"] = sum(name in f for f in flags) / len(trajectories)
    stats["infra_failure_rate"] = sum(bool(t.info.get("infra_failure")) for t in trajectories) / len(trajectories)
    canaries = [t for t in trajectories if t.info.get("canary")]
    stats["canary_episodes"] = float(len(canaries))
    stats["canary_passes"] = float(sum("canary_passed" in t.info.get("flags", ()) for t in canaries))
    if canaries:
        stats["canary_pass_rate"] = stats["canary_passes"] / len(canaries)
    return stats


class TrajectoryStore:
    """Groups by stage, each stage a directory; a group moves between them by atomic rename, so a crash at any
    point neither loses nor duplicates one. What the stages mean and when a group moves is the RL run protocol's
    (rl/protocol.py): ready (waiting for the learner), trained (by a step no checkpoint covers yet), consumed,
    dropped (too stale).
    """

    STAGES = ("ready", "trained", "consumed", "dropped")

    def __init__(self, root: Path):
        self.root = root
        for stage in self.STAGES:
            (root / stage).mkdir(parents=True, exist_ok=True)

    def _path(self, stage: str, group_id: str) -> Path:
        return self.root / stage / f"{group_id}.traj"

    def put(self, group_id: str, trajectories: list[Trajectory]) -> Path:
        path = self._path("ready", group_id)
        atomic_write_bytes(path, encode_group(trajectories))
        return path

    def groups(self, stage: str) -> list[str]:
        return sorted(p.stem for p in (self.root / stage).glob("*.traj"))

    def ready_groups(self) -> list[str]:
        return self.groups("ready")

    def policy_version(self, group_id: str, stage: str = "ready") -> int:
        return group_policy_version(self._path(stage, group_id))

    def load(self, group_id: str, stage: str = "ready") -> list[Trajectory]:
        path = self._path(stage, group_id)
        return decode_group(path.read_bytes(), str(path))

    def move(self, group_ids: list[str], source: str, dest: str) -> None:
        for group_id in group_ids:
            os.replace(self._path(source, group_id), self._path(dest, group_id))
        fsync_dir(self.root / source)
        fsync_dir(self.root / dest)

    def stage_of(self, group_id: str) -> str:
        for stage in self.STAGES:
            if self._path(stage, group_id).is_file():
                return stage
        raise UserError(f"{self.root}: no trajectory group {group_id}")

    def known_groups(self) -> set[str]:
        """Every group ever written, whatever its stage (a resumed run must not generate these again)."""
        return {g for stage in self.STAGES for g in self.groups(stage)}
