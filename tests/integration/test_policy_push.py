"""The RL learner's per-step push from memory (`export_hf_tensors` + `TensorPusher`: no safetensors written or read)
publishes the versions that exporting the policy and pushing the files publishes, on the real tiny MoE."""

import pytest

from tests.conftest import run_ranks
from tests.unit.test_sync_tensor_push import store_files

pytestmark = [pytest.mark.engines, pytest.mark.slow]  # 40-60 s each on the busy 2-core machine


@pytest.mark.parametrize("fmt", ["bfloat16", "fp8"])
def test_the_learner_pushes_from_memory_what_it_would_push_from_an_export(init, tmp_path, fmt):
    result = run_ranks(1, "tests.helpers.workers.policy_push", str(tmp_path), str(init), fmt)
    assert result.returncode == 0, result.stderr[-3000:]
    memory, export = store_files(tmp_path / "memory-store"), store_files(tmp_path / "export-store")
    assert sum(name.startswith("manifests/") for name in memory) == 3
    assert memory == export
    assert not list((tmp_path / "memory-2").glob("*.safetensors"))  # only the small files were written
