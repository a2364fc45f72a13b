"""Files an RL run hands between its roles (all under the run directory, all written atomically).

    trajectories/           groups of episodes by stage (rollout.trajectories.TrajectoryStore)
    driver.heartbeat        touched by the driver while it runs rollouts
    policy.json             the newest policy: {"version": learner steps, "store_version": id in the sync store}
    receiver/               the rollout host's copy of the newest policy, pulled from the store
    export/                 the learner's HF export being pushed
    checkpoints/            learner checkpoints
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from recipes.runs import atomic_write_text
from recipes.schema import Recipe, SyncSection


@dataclass(frozen=True)
class Policy:
    version: int
    store_version: str


class RLRunFiles:
    def __init__(self, root: Path):
        self.root = root
        self.trajectories = root / "trajectories"
        self.policy_file = root / "policy.json"
        self.receiver = root / "receiver"
        self.export = root / "export"
        self.checkpoints = root / "checkpoints"
        self.heartbeat = root / "driver.heartbeat"

    def beat(self) -> None:
        self.heartbeat.touch()

    def driver_silent_for(self) -> float:
        return time.time() - self.heartbeat.stat().st_mtime if self.heartbeat.exists() else 0.0

    def policy(self) -> Policy | None:
        if not self.policy_file.is_file():
            return None
        data = json.loads(self.policy_file.read_text())
        return Policy(data["version"], data["store_version"])

    def publish_policy(self, policy: Policy) -> None:
        atomic_write_text(self.policy_file, json.dumps({"version": policy.version, "store_version": policy.store_version}))


def sync_section(recipe: Recipe, files: RLRunFiles) -> SyncSection:
    """The recipe's sync section, or a store inside the run directory when the recipe names none."""
    return recipe.sync or SyncSection(store=str(files.root / "weights"))
