#!/usr/bin/env bash
# Build the MegatronDPP image without Docker or a container registry: a Debian root filesystem from
# Debian's packages (debootstrap), the Python dependencies from the package index, this package with
# its C++ extension, squashed into the enroot image format that Pyxis runs (IMAGE=... / --image).
# This is the CPU image of the local test cluster; real GPU clusters use containers/Dockerfile
# (NGC base) and containers/build.sh.
#
#   containers/build-offline.sh [OUTPUT.sqsh]          default: build/megatron-dpp-cpu.sqsh
#
# Settings (environment):
#   SUITE=bookworm            Debian release of the root filesystem (its Python must match the host's
#                             minor version: the wheels, the extension included, are built on the host)
#   MIRROR=<from apt>         Debian mirror; default: the first URI of the host's apt sources
#   TORCH_SPEC=torch==2.13.0  the torch requirement (2.13.0 is the CPU wheel on these machines)
#   WORK_DIR=build/image      root filesystem, wheelhouse and stamps (kept: a second run resumes)
#   GIT_REV=<commit>          take the package's sources from that commit (default: the working
#                             tree's tracked files, uncommitted edits included)
#   REBUILD=1                 start again from an empty WORK_DIR
#
# Run as root. The host tools it needs and lacks (debootstrap, mksquashfs, g++) are installed first
# with apt-get. Steps, each skipped when its stamp in WORK_DIR says it was done from the same inputs:
#   1. debootstrap --variant=minbase SUITE with python3, venv, the C/C++ runtime torch needs, iproute2
#      (workflows.netinfo runs `ip` inside the image) and procps
#   2. on the host, `pip wheel`: this package (the extension compiled here, against the same Debian
#      ABI) and every dependency, TORCH_SPEC for torch, into one wheelhouse
#   3. in the root filesystem (chroot): a venv at /opt/venv, the dependencies installed from the
#      wheelhouse only (--no-index: nothing is fetched from inside), then the package's sources at
#      /workspace/megatron-dpp (the sbatch files' CONTAINER_WORKDIR) with the compiled extension and a
#      .pth file that puts them on the venv's path: what the Dockerfile's `pip install -e .` gives,
#      without a compiler in the image
#   4. the enroot image configuration (/etc/environment: PATH with the venv; /etc/rc: the working
#      directory and the command) and `mksquashfs` with the options `enroot import` uses
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD

OUTPUT=$(realpath -m "${1:-build/megatron-dpp-cpu.sqsh}")
SUITE=${SUITE:-bookworm}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
WORK_DIR=$(realpath -m "${WORK_DIR:-build/image}")
PYTHON=${PYTHON:-python3}
WORKDIR_IN_IMAGE=/workspace/megatron-dpp   # workflows/jobs.py CONTAINER_WORKDIR
VENV=/opt/venv
ROOTFS=$WORK_DIR/rootfs
WHEELS=$WORK_DIR/wheels
# What the Dockerfile copies into the image (COPY lines), and nothing else of the checkout.
PACKAGE_PATHS=(pyproject.toml setup.py README.md csrc trainer workflows datasets sbatch)

log() { echo "build-offline: $*" >&2; }
die() { echo "build-offline: error: $*" >&2; exit 2; }

default_mirror() {
    local uri
    uri=$(grep -hoE '^(URIs:|deb) +https?://[^ ]+' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
          | grep -v -- '-security' | head -n1 | awk '{print $2}')
    echo "${uri:-http://deb.debian.org/debian}"
}
MIRROR=${MIRROR:-$(default_mirror)}

(( $(id -u) == 0 )) || die "run as root (debootstrap and chroot need it)"
# The host tools this build runs, each with the Debian package that brings it: a fresh machine has
# none of the first two, so they are installed here (apt-get, like scripts/setup.sh) rather than
# asked of the user.
declare -A TOOL_PACKAGE=([debootstrap]=debootstrap [mksquashfs]=squashfs-tools [unshare]=util-linux
                         [chroot]=coreutils [g++]=g++)
missing=()
for tool in "${!TOOL_PACKAGE[@]}"; do
    command -v "$tool" >/dev/null || missing+=("${TOOL_PACKAGE[$tool]}")
done
if ((${#missing[@]})); then
    log "installing ${missing[*]} (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed (see above)"
fi
for tool in "${!TOOL_PACKAGE[@]}"; do
    command -v "$tool" >/dev/null || die "$tool still not found after installing ${TOOL_PACKAGE[$tool]}"
done
[[ -z "${REBUILD:-}" ]] || { log "REBUILD=1: removing $WORK_DIR"; rm -rf "$WORK_DIR"; }
mkdir -p "$WORK_DIR" "$WHEELS" "$(dirname "$OUTPUT")"
# A step is done when its stamp holds the key of what it was built from: a changed input (the C++
# extension's sources, the dependencies, TORCH_SPEC, SUITE) redoes that step and every later one.
step_key() {
    case $1 in
        debootstrap) echo "$SUITE $MIRROR" ;;
        wheels) echo "$(step_key debootstrap) $TORCH_SPEC $(cd "$REPO" && cat pyproject.toml setup.py csrc/* | sha256sum | cut -c1-16)" ;;
        python) step_key wheels ;;
    esac
}
done_step() { [[ "$(cat "$WORK_DIR/.done-$1" 2>/dev/null)" == "$(step_key "$1")" ]]; }
mark_done() { step_key "$1" >"$WORK_DIR/.done-$1"; }

# Commands inside the root filesystem: a private mount namespace, so that the bind mounts vanish with
# the command (also when it fails) and never show on the host.
in_rootfs() {
    unshare --mount --fork -- bash -euo pipefail -c '
        rootfs=$1 wheels=$2; shift 2
        mount --make-rprivate /
        mount -t proc proc "$rootfs/proc"
        mount --bind /dev "$rootfs/dev"
        mkdir -p "$rootfs/wheels" && mount --bind -o ro "$wheels" "$rootfs/wheels"
        cp -L /etc/resolv.conf "$rootfs/etc/resolv.conf" 2>/dev/null || true
        exec chroot "$rootfs" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 "$@"
    ' in_rootfs "$ROOTFS" "$WHEELS" "$@"
}

# 1. Debian root filesystem
if ! done_step debootstrap; then
    rm -rf "$ROOTFS"
    log "debootstrap $SUITE from $MIRROR into $ROOTFS"
    debootstrap --variant=minbase \
        --include=python3,python3-venv,libstdc++6,libgomp1,iproute2,procps,ca-certificates,xz-utils \
        "$SUITE" "$ROOTFS" "$MIRROR" >"$WORK_DIR/debootstrap.log" 2>&1 \
        || { tail -n 20 "$WORK_DIR/debootstrap.log" >&2; die "debootstrap failed (log: $WORK_DIR/debootstrap.log)"; }
    in_rootfs apt-get clean
    mark_done debootstrap
fi

host_minor=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
image_minor=$(in_rootfs python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
[[ "$host_minor" == "$image_minor" ]] \
    || die "the host's $PYTHON is $host_minor but $SUITE's python3 is $image_minor: the wheels built here would not fit (set SUITE or PYTHON)"

# 2. Wheelhouse, built on the host with its pip configuration (index, local wheels, constraints)
if ! done_step wheels; then
    rm -rf "${WHEELS:?}"/*
    log "pip wheel: this package, its dependencies and $TORCH_SPEC into $WHEELS"
    "$PYTHON" -m pip wheel -q -w "$WHEELS" "$TORCH_SPEC" "$REPO"
    mark_done wheels
fi
shopt -s nullglob
package_wheels=("$WHEELS"/megatron_dpp-*.whl)
shopt -u nullglob
(( ${#package_wheels[@]} == 1 )) || die "expected one megatron_dpp wheel in $WHEELS, found ${#package_wheels[@]} (REBUILD=1)"
package_wheel=${package_wheels[0]}

# 3. Python environment and the package
if ! done_step python; then
    log "venv $VENV with the dependencies from the wheelhouse"
    rm -rf "${ROOTFS:?}$VENV"
    in_rootfs python3 -m venv "$VENV"
    # The package's own wheel resolves the dependency set (torch pinned by the wheelhouse's one
    # file); the package itself then comes out again: its sources go to the workdir below.
    in_rootfs "$VENV/bin/pip" install -q --no-index --find-links /wheels --no-cache-dir \
        "/wheels/$(basename "$package_wheel")" "$TORCH_SPEC"
    in_rootfs "$VENV/bin/pip" uninstall -q -y megatron-dpp
    mark_done python
fi

log "package sources -> $WORKDIR_IN_IMAGE"
target=$ROOTFS$WORKDIR_IN_IMAGE
rm -rf "$target" && mkdir -p "$target"
if [[ -n "${GIT_REV:-}" ]]; then
    git -C "$REPO" archive "$GIT_REV" -- "${PACKAGE_PATHS[@]}" | tar -x -C "$target"
else
    # Tracked files of the working tree (uncommitted edits included, like a docker build context).
    git -C "$REPO" ls-files -z -- "${PACKAGE_PATHS[@]}" | (cd "$REPO" && xargs -0 cp --parents -t "$target")
fi
# The compiled extension, from the wheel built on the host.
"$PYTHON" - "$package_wheel" "$target" <<'EOF'
import sys, zipfile
wheel, target = sys.argv[1:]
with zipfile.ZipFile(wheel) as archive:
    names = [n for n in archive.namelist() if n.startswith("trainer/transport/_shm_ring") and n.endswith(".so")]
    if len(names) != 1:
        sys.exit(f"build-offline: error: {wheel} holds {names or 'no'} _shm_ring extension")
    archive.extract(names[0], target)
EOF
site=$(in_rootfs "$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$WORKDIR_IN_IMAGE" >"$ROOTFS$site/megatron_dpp.pth"
in_rootfs /bin/sh -c "cd $WORKDIR_IN_IMAGE && $VENV/bin/python -c 'import trainer.transport._shm_ring, megatron.core, torch, workflows.render'" \
    || die "the image's Python cannot import the package (see above)"

# 4. enroot configuration and squashfs
# Pyxis gives a container the image's PATH, but a bare `enroot start` keeps the caller's: python3
# in /usr/local/bin (ahead of Debian's /usr/bin on any usual PATH) is the venv's either way.
for name in python3 python; do
    printf '#!/bin/sh\nexec %s/bin/python3 "$@"\n' "$VENV" >"$ROOTFS/usr/local/bin/$name"
    chmod 755 "$ROOTFS/usr/local/bin/$name"
done
cat >"$ROOTFS/etc/environment" <<EOF
PATH=$VENV/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
LANG=C.UTF-8
EOF
: >"$ROOTFS/etc/fstab"
cat >"$ROOTFS/etc/rc" <<EOF
# enroot's entry script (what \`enroot import\` writes from a Docker image's WORKDIR and CMD)
mkdir -p "$WORKDIR_IN_IMAGE" 2> /dev/null
cd "$WORKDIR_IN_IMAGE" && unset OLDPWD || exit 1
if [ -s /etc/rc.local ]; then
    . /etc/rc.local
fi
if [ \$# -gt 0 ]; then
    exec "\$@"
else
    exec /bin/bash
fi
EOF
: >"$ROOTFS/etc/rc.local"
rm -f "$ROOTFS/etc/resolv.conf"  # enroot mounts the host's
rm -rf "$ROOTFS/wheels" "$ROOTFS"/root/.cache "$ROOTFS"/var/cache/apt/archives/*.deb

rm -f "$OUTPUT"
log "mksquashfs -> $OUTPUT"
# enroot's default ENROOT_SQUASH_OPTIONS: lzo, data blocks left uncompressed (quick to build and to mount)
mksquashfs "$ROOTFS" "$OUTPUT" -all-root -no-progress -comp lzo -noD -exit-on-error >"$WORK_DIR/mksquashfs.log" \
    || { tail -n 20 "$WORK_DIR/mksquashfs.log" >&2; die "mksquashfs failed"; }
log "wrote $OUTPUT ($(du -h "$OUTPUT" | cut -f1)); use it as IMAGE=$OUTPUT"
