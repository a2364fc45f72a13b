"""The long-context stage pair (recipes/long-context-stage1.yaml, long-context-stage2.yaml), as Composer 2 extended
its context: a short stage, then a stage at a longer data.seq_length with the RoPE base raised (model.rescale_rope),
document attention and context parallelism, continued from the first stage's export.

- The export of a rescaled stage says the RoPE base and length it was trained with (not its source's).
- Both stages end to end on CPU (shortened), the second stage's eval loss on long documents beside the first's
  (`composer report --compare`).
"""

from __future__ import annotations

import pytest

from composer.recipes.loader import load_recipe
from composer.runtime.run_dir import read_metrics
from composer.trainer.checkpoint_init import init_hf_checkpoint
from composer.trainer.hf_config import model_section_from_hf
from tests.conftest import RECIPES, run_composer


def test_a_rescaled_stage_exports_its_own_rope(tmp_path):
    short = load_recipe(RECIPES / "long-context-stage1.yaml", ["model.vocab_size=512"]).model
    source = init_hf_checkpoint(short, tmp_path / "stage1", tokenizer_bytes=2**18)
    from composer.trainer.weights import convert_hf

    long = load_recipe(RECIPES / "long-context-stage2.yaml", ["model.vocab_size=512", f"model.checkpoint={source}"]).model
    out = convert_hf(long, tmp_path / "stage2")
    exported = model_section_from_hf(out)  # what a next stage, or vLLM, reads
    assert (exported.rope_theta, exported.max_position_embeddings) == (100000.0, 2048)
    assert (model_section_from_hf(source).rope_theta, model_section_from_hf(source).max_position_embeddings) == (10000.0, 1024)


def sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def eval_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "eval_loss" in r}


@pytest.mark.engines
@pytest.mark.slow
def test_the_long_context_stages_run_end_to_end(tmp_path):
    """Stage 1 at 128 tokens, then stage 2 at 512 from stage 1's export (RoPE base 10x, document attention, cp 2),
    both shortened and on a part of the standard library."""
    runs, cache = tmp_path / "runs", tmp_path / "cache"
    corpus = ['data.sources.0.paths=["{stdlib}/email/**/*.py"]', "data.split=[90,10,0]", f"data.cache_dir={cache}", f"run.dir={runs}"]
    init = tmp_path / "init"
    result = run_composer("model", "init", str(init), "--recipe", str(RECIPES / "long-context-stage1.yaml"))
    assert result.returncode == 0, result.stderr[-2000:]
    stage1 = ["train.steps=40", "train.eval_every=20", "train.checkpoint_every=20", f"model.checkpoint={init}"]
    result = run_composer("train", "midtrain", str(RECIPES / "long-context-stage1.yaml"), *sets(*corpus, *stage1))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    stage2 = [
        "train.steps=20",
        "train.eval_every=10",
        "train.checkpoint_every=10",
        f"model.checkpoint={runs / 'long-context-stage1' / 'export'}",
    ]
    result = run_composer("train", "midtrain", str(RECIPES / "long-context-stage2.yaml"), *sets(*corpus, *stage2))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]

    short, long = eval_losses(runs / "long-context-stage1"), eval_losses(runs / "long-context-stage2")
    assert sorted(short) == [0, 20, 40] and sorted(long) == [0, 10, 20]
    assert long[0] < short[0] - 1.0  # stage 2 starts from stage 1's weights, not from a fresh model
    assert long[20] < long[0]  # and learns the long samples
    exported = model_section_from_hf(runs / "long-context-stage2" / "export")
    assert (exported.rope_theta, exported.max_position_embeddings) == (100000.0, 2048)

    result = run_composer("report", "--compare", str(runs / "long-context-stage1"), str(runs / "long-context-stage2"))
    assert result.returncode == 0, result.stderr[-2000:]
    print(result.stdout)  # the two stages' eval losses side by side, shown with pytest -s
    rows = [" ".join(line.replace("│", " ").split()) for line in result.stdout.splitlines()]
    for name, losses in (("long-context-stage1", short), ("long-context-stage2", long)):
        assert any(row.startswith(f"eval_loss {name} 3 {losses[0]:.4g} {losses[max(losses)]:.4g}") for row in rows), (name, result.stdout)
