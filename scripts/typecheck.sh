#!/usr/bin/env bash
# mypy on the packages below rl/ (trainer, data, rollout, sync, cluster, runtime, recipes), as `composer.*`.
# mypy does not follow the editable install's import hook, so it reads the folders through a tree of links named as
# they install: <tmp>/composer/<folder> -> the folder at the top of this repository.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/composer"
ln -s "$repo/composer/__init__.py" "$tree/composer/__init__.py"
for folder in cli rl rollout trainer sync data runtime cluster recipes; do
    ln -s "$repo/$folder" "$tree/composer/$folder"
done
cd "$tree"
packages=()
for folder in trainer data rollout sync cluster runtime recipes; do packages+=(-p "composer.$folder"); done
"$repo/.venv/bin/mypy" --config-file "$repo/pyproject.toml" --cache-dir "$repo/.mypy_cache" "${packages[@]}"
