#!/usr/bin/env bash
# Build and install enroot and the Pyxis SPANK plugin from source folders you point to, and register
# Pyxis with the project's local Slurm cluster (scripts/cluster.sh). Run `make setup` first (Slurm).
# Neither is a Debian package nor on PyPI, and their sources are never copied into this repository:
# get the two source folders yourself, e.g.
#
#   git clone --recursive https://github.com/NVIDIA/enroot  ~/src/enroot
#   git clone https://github.com/NVIDIA/pyxis               ~/src/pyxis
#   scripts/install-enroot-pyxis.sh --enroot-src ~/src/enroot --pyxis-src ~/src/pyxis
#   (or ENROOT_SRC=... PYXIS_SRC=... scripts/install-enroot-pyxis.sh)
#
# A machine that cannot reach that code host needs the folders brought to it: a release tarball, or
# `git archive --prefix=enroot/ v4.1.2 | tar -x` of a mirror, works as well as a clone (no .git used).
#
# What it does, each part skipped when already done (run it again at will):
#   - Debian packages: the build tools, libslurm-dev (spank.h of the installed Slurm: Slurm refuses a
#     plugin built against another release), and what enroot runs (squashfs-tools, squashfuse,
#     fuse-overlayfs, jq, parallel, pigz, zstd, curl)
#   - enroot: `make install` into PREFIX (default /usr/local) from a scratch copy of the source
#     folder (the folder itself is never written). A checkout without its git submodules (deps/musl,
#     deps/makeself, deps/linux-headers) is built against glibc instead of a static musl
#     (FORCE_GLIBC=1), with Debian's makeself, the system's kernel headers and libbsd's strlcpy.
#     Skipped when `enroot version` already equals the source's version.
#   - Pyxis: `make install` into PREFIX: PREFIX/lib/slurm/spank_pyxis.so; skipped when it was built
#     from the same sources for the same Slurm (PREFIX/share/pyxis/mdpp-build records both).
#   - enroot's configuration for the local cluster's two nodes on one host: ENROOT_RUNTIME_PATH,
#     ENROOT_CACHE_PATH and ENROOT_DATA_PATH per user (PREFIX/etc/enroot/enroot.conf.d/50-mdpp.conf)
#   - registration: scripts/cluster.sh writes the cluster's plugstack.conf (beside its slurm.conf)
#     naming PREFIX/lib/slurm/spank_pyxis.so whenever that file exists; this script runs its
#     `plugstack` command, so a running cluster picks Pyxis up with the next srun.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

PREFIX=${PREFIX:-/usr/local}
ENROOT_SRC=${ENROOT_SRC:-}
PYXIS_SRC=${PYXIS_SRC:-}
BUILD_ROOT=${BUILD_ROOT:-}

log() { echo "install-enroot-pyxis: $*" >&2; }
die() { echo "install-enroot-pyxis: error: $*" >&2; exit 2; }
usage() {
    sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

while (($#)); do
    case $1 in
        --enroot-src) ENROOT_SRC=${2:?--enroot-src needs a folder}; shift 2 ;;
        --pyxis-src) PYXIS_SRC=${2:?--pyxis-src needs a folder}; shift 2 ;;
        --prefix) PREFIX=${2:?--prefix needs a folder}; shift 2 ;;
        -h|--help) usage ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done

problems=()
if [[ -z $ENROOT_SRC || -z $PYXIS_SRC ]]; then
    problems+=("both sources must be given: --enroot-src DIR (NVIDIA/enroot's sources: a clone, a release tarball unpacked, or a git archive of a mirror) and --pyxis-src DIR (NVIDIA/pyxis's, likewise), or ENROOT_SRC/PYXIS_SRC; nothing is downloaded by this script, and no package registry has them")
fi
[[ -z $ENROOT_SRC || -f $ENROOT_SRC/enroot.in ]] || problems+=("--enroot-src $ENROOT_SRC: no enroot.in there, not an enroot source folder")
[[ -z $PYXIS_SRC || -f $PYXIS_SRC/pyxis_slurmstepd.c ]] || problems+=("--pyxis-src $PYXIS_SRC: no pyxis_slurmstepd.c there, not a Pyxis source folder")
if ((${#problems[@]})); then
    for p in "${problems[@]}"; do echo "install-enroot-pyxis: error: $p" >&2; done
    exit 2
fi
ENROOT_SRC=$(realpath "$ENROOT_SRC")
PYXIS_SRC=$(realpath "$PYXIS_SRC")
case "$ENROOT_SRC/" in "$REPO"/*) die "--enroot-src $ENROOT_SRC is inside this repository: keep third-party sources outside it" ;; esac
case "$PYXIS_SRC/" in "$REPO"/*) die "--pyxis-src $PYXIS_SRC is inside this repository: keep third-party sources outside it" ;; esac

SUDO=""; (( $(id -u) == 0 )) || SUDO=sudo
# Pyxis is built against the installed Slurm's headers (below): Slurm must be there first.
dpkg -s slurmd >/dev/null 2>&1 || die "slurmd is not installed: run \`make setup\` first (Pyxis is built for the installed Slurm)"

# ---- Debian packages
APT_PACKAGES=(build-essential libbsd-dev libslurm-dev makeself linux-libc-dev squashfs-tools squashfuse
              fuse-overlayfs jq parallel pigz zstd curl gawk)
missing=()
for p in "${APT_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
slurm_headers=$(dpkg-query -W -f '${Version}' libslurm-dev)
slurm_daemon=$(dpkg-query -W -f '${Version}' slurmd 2>/dev/null || echo "not installed")
[[ $slurm_headers == "$slurm_daemon" ]] \
    || die "libslurm-dev $slurm_headers differs from slurmd $slurm_daemon: Slurm would refuse the plugin ('Incompatible plugin version')"

BUILD_ROOT=${BUILD_ROOT:-$(mktemp -d /tmp/mdpp-enroot-pyxis.XXXXXX)}
trap 'rm -rf "$BUILD_ROOT"' EXIT
# A scratch copy: the user's folder stays untouched (no objects, no stamps written into it).
scratch_copy() { rm -rf "$BUILD_ROOT/$2" && cp -a "$1" "$BUILD_ROOT/$2" && echo "$BUILD_ROOT/$2"; }

# ---- enroot
enroot_version=$(sed -n 's/^VERSION *:= *//p' "$ENROOT_SRC/Makefile")
[[ -n $enroot_version ]] || die "$ENROOT_SRC/Makefile names no VERSION"
installed=$("$PREFIX/bin/enroot" version 2>/dev/null || true)
if [[ $installed == "$enroot_version" ]]; then
    log "enroot $enroot_version already installed in $PREFIX: skipped"
else
    build=$(scratch_copy "$ENROOT_SRC" enroot)
    make_args=(prefix="$PREFIX")
    if [[ -f $build/deps/musl/configure && -f $build/deps/makeself/makeself.sh && -f $build/deps/linux-headers/Makefile ]]; then
        log "building enroot $enroot_version (static musl helpers, its submodules)"
    else
        log "building enroot $enroot_version against glibc: $ENROOT_SRC has no git submodules (clone with --recursive for the static build)"
        install -D -m 755 "$(command -v makeself)" "$build/deps/dist/makeself/bin/enroot-makeself"
        touch "$build/deps/makeself/.stamp" "$build/deps/linux-headers/.stamp"
        # deps/dist/libbsd/libbsd.a holds only a few of libbsd's functions; strlcpy/strlcat (in musl,
        # not in glibc 2.36) come from Debian's libbsd. -l:libbsd.so, since -lbsd would find the
        # partial static archive first.
        make_args+=(FORCE_GLIBC=1 "LDLIBS=-l:libbsd.a -l:libbsd.so")
    fi
    make -C "$build" -j"$(nproc)" "${make_args[@]}" >"$BUILD_ROOT/enroot-build.log" 2>&1 \
        || { grep -v warning "$BUILD_ROOT/enroot-build.log" | tail -n 20 >&2; die "enroot build failed"; }
    $SUDO make -C "$build" install "${make_args[@]}" >"$BUILD_ROOT/enroot-install.log" 2>&1 \
        || { tail -n 20 "$BUILD_ROOT/enroot-install.log" >&2; die "enroot install failed"; }
    log "installed enroot $("$PREFIX/bin/enroot" version) in $PREFIX"
fi

# Two Slurm nodes of the local cluster share this host: per-user paths keep their containers apart
# from other users'; Pyxis names containers per job and step, and starts .sqsh images straight from
# squashfuse (use_squashfuse in plugstack.conf), so no node writes another's container.
conf_dir=$PREFIX/etc/enroot/enroot.conf.d
$SUDO mkdir -p "$conf_dir"
$SUDO tee "$conf_dir/50-mdpp.conf" >/dev/null <<'EOF'
# Written by MegatronDPP's scripts/install-enroot-pyxis.sh.
ENROOT_RUNTIME_PATH /run/enroot/user-$(id -u)
ENROOT_CACHE_PATH   /var/tmp/enroot-cache/user-$(id -u)
ENROOT_DATA_PATH    /var/tmp/enroot-data/user-$(id -u)
EOF

# ---- Pyxis
# What the installed plugin was built from: its sources' checksum and the Slurm headers' version.
plugin=$PREFIX/lib/slurm/spank_pyxis.so
stamp=$PREFIX/share/pyxis/mdpp-build
wanted="sources $(cd "$PYXIS_SRC" && find . -path ./.git -prune -o -type f -print0 | sort -z \
                  | xargs -0 sha256sum | sha256sum | cut -d' ' -f1) slurm $slurm_headers"
if [[ -f $plugin && "$(cat "$stamp" 2>/dev/null)" == "$wanted" ]]; then
    log "Pyxis already installed from these sources for Slurm $slurm_headers ($plugin): skipped"
else
    build=$(scratch_copy "$PYXIS_SRC" pyxis)
    make -C "$build" -j"$(nproc)" prefix="$PREFIX" >"$BUILD_ROOT/pyxis-build.log" 2>&1 \
        || { tail -n 20 "$BUILD_ROOT/pyxis-build.log" >&2; die "Pyxis build failed (against libslurm-dev $slurm_headers)"; }
    $SUDO make -C "$build" install prefix="$PREFIX" >"$BUILD_ROOT/pyxis-install.log" 2>&1 \
        || { tail -n 20 "$BUILD_ROOT/pyxis-install.log" >&2; die "Pyxis install failed"; }
    echo "$wanted" | $SUDO tee "$stamp" >/dev/null
    log "installed Pyxis in $plugin (built against Slurm $slurm_headers)"
fi

# ---- registration with the local cluster
PYXIS_PLUGIN=$plugin "$REPO/scripts/cluster.sh" plugstack
log "done: enroot $("$PREFIX/bin/enroot" version), Pyxis $plugin; build an image with containers/build-offline.sh"
