#!/usr/bin/env bash
# The main job on the embedded CPU default, in a fresh directory each time (or the one given):
# validate every shipped recipe, make the tiny MoE with its tokenizer, mid-train it on the Python standard
# library, then run asynchronous RL from the mid-trained export on the smoke tasks, and plot both runs.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-runs/main-$(date +%Y%m%d-%H%M%S)}
composer=.venv/bin/composer
$composer recipe validate recipes/*.yaml
$composer model init "$runs/tiny-moe-init"
$composer train midtrain recipes/smoke-midtrain.yaml --set run.dir="$runs" --set model.checkpoint="$runs/tiny-moe-init"
$composer train rl recipes/smoke-rl.yaml --set run.dir="$runs" --set model.checkpoint="$runs/smoke-midtrain/export"
$composer report "$runs/smoke-midtrain"
$composer report "$runs/smoke-rl"
