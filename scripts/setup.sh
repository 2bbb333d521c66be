#!/usr/bin/env bash
# One-time (idempotent) set-up of a fresh machine: system packages for the local Slurm cluster,
# torch (CPU build where one is on disk), this package with its C++ extension, test tools.
# Called by `make demo` and `make test`; safe to run again (it skips what is present).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# Checkouts on one host share dpkg and the Python environment (pip's editable install of this package
# is one .pth file): two set-ups at once -- two clones' `make test` started together -- broke pip's
# install ("No such file or directory: .../__editable__.megatron_dpp-0.1.0.pth"). One at a time: the
# other waits for this host-wide lock, at most MDPP_SETUP_LOCK_WAIT_S seconds.
LOCK=${MDPP_SETUP_LOCK:-${TMPDIR:-/tmp}/megatron-dpp-setup.lock}
WAIT_S=${MDPP_SETUP_LOCK_WAIT_S:-1800}
exec 9>>"$LOCK"
if ! flock -w "$WAIT_S" 9; then
    echo "setup: another checkout's set-up held $LOCK for $WAIT_S s; not waiting longer (run make setup again)" >&2
    exit 1
fi

APT_PACKAGES=(munge slurm-wlm slurmdbd mariadb-server mariadb-client procps iproute2)
missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
    $SUDO apt-get update -qq
    # --no-install-recommends keeps the image small; daemons are started by scripts/cluster.sh,
    # never by the package's own service scripts.
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# torch first, pinned to the CPU wheel on disk on Python 3.11 machines, so that the unpinned
# `torch>=...` in pyproject installs nothing more (an unpinned resolve pulls GBs of CUDA wheels).
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    "$PYTHON" -m pip install -q torch==2.13.0
fi
if ! "$PYTHON" -c "import trainer.transport._shm_ring, trainer.transport._cuda_hop, megatron.core, pytest_timeout, submitit, tensorboard, psutil" 2>/dev/null \
   || [[ setup.py -nt .setup-done || csrc/shm_ring.cpp -nt .setup-done || csrc/cuda_hop.cpp -nt .setup-done || pyproject.toml -nt .setup-done ]]; then
    "$PYTHON" -m pip install -q -e '.[dev]'
fi
touch .setup-done
echo "setup: ok ($("$PYTHON" -c 'import torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)'))"
