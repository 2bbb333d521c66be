#!/usr/bin/env bash
# Gathers, on a machine that can reach the package index (not the GPU machine), everything the
# Transformer Engine build on a GPU machine needs, into .te/ (ignored by git; nothing is vendored):
#
#   scripts/te/fetch.sh --te-git DIR --cutlass-git DIR
#       DIR: any git directory holding the pinned commits (scripts/te/pins.sh): a clone of
#       NVIDIA/TransformerEngine and of NVIDIA/cutlass, or a mirror of them copied onto this machine.
#       PyPI has no source of TE's core library (only transformer_engine_torch's sdist, the PyTorch
#       extension alone), so the sources must come from git.
#   scripts/te/fetch.sh --take-wheel DIR
#       after a build (docs/transformer_engine.md): reassembles the wheel that build.sh sent back in
#       parts (DIR holds te-wheel.name and te-wheel.part-*) into .te/wheel/, checking its sha256.
#
# Writes:
#   .te/build/te-src.tar.xz   TE at its tag (transformer_engine/, build_tools/, setup.py, ...) with
#                             CUTLASS's headers at 3rdparty/cutlass/ (about 2.5 MB)
#   .te/build/whl/            wheels needed to compile (nvidia-cudnn-frontend: cudnn_frontend.h)
#   .te/whl/                  wheels needed to import transformer_engine.pytorch (pydantic, ...)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
REPO=$PWD
# shellcheck source=pins.sh
source scripts/te/pins.sh

log() { echo "te-fetch: $*" >&2; }
die() { echo "te-fetch: error: $*" >&2; exit 2; }

TE_GIT="" CUTLASS_GIT="" TAKE=""
while (($#)); do
    case $1 in
        --te-git) TE_GIT=${2:?--te-git needs a git directory}; shift 2 ;;
        --cutlass-git) CUTLASS_GIT=${2:?--cutlass-git needs a git directory}; shift 2 ;;
        --take-wheel) TAKE=${2:?--take-wheel needs the folder the parts came back in}; shift 2 ;;
        -h|--help) sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done

if [[ -n $TAKE ]]; then
    [[ -f $TAKE/te-wheel.name ]] || die "--take-wheel $TAKE: no te-wheel.name there (what build.sh wait writes under \$OUT)"
    read -r name sum _ <"$TAKE/te-wheel.name"
    mkdir -p .te/wheel && rm -f .te/wheel/*
    cat "$TAKE"/te-wheel.part-* >".te/wheel/$name"
    cp "$TAKE/te-wheel.name" .te/wheel/
    got=$(sha256sum ".te/wheel/$name" | cut -d' ' -f1)
    [[ $got == "$sum" ]] || { rm -f ".te/wheel/$name"; die "reassembled $name has sha256 $got, te-wheel.name says $sum (a part is missing?)"; }
    log "wrote .te/wheel/$name ($(du -h ".te/wheel/$name" | cut -f1)); carry .te/whl and .te/wheel (docs/transformer_engine.md)"
    exit 0
fi

[[ -n $TE_GIT && -n $CUTLASS_GIT ]] || die "give --te-git DIR and --cutlass-git DIR (git directories holding $TE_TAG and CUTLASS $CUTLASS_COMMIT), or --take-wheel DIR"
git -C "$TE_GIT" cat-file -e "$TE_COMMIT^{commit}" 2>/dev/null \
    || die "--te-git $TE_GIT holds no commit $TE_COMMIT ($TE_TAG)"
tag_commit=$(git -C "$TE_GIT" rev-parse -q --verify "$TE_TAG^{commit}" 2>/dev/null || true)
[[ -z $tag_commit || $tag_commit == "$TE_COMMIT" ]] \
    || die "--te-git $TE_GIT: tag $TE_TAG names $tag_commit, not the pinned $TE_COMMIT"
pinned=$(git -C "$TE_GIT" ls-tree "$TE_COMMIT" 3rdparty/cutlass | awk '{print $3}')
[[ $pinned == "$CUTLASS_COMMIT" ]] \
    || die "$TE_TAG pins CUTLASS ${pinned:-<none>}, scripts/te/pins.sh says $CUTLASS_COMMIT: update the pin"
git -C "$CUTLASS_GIT" cat-file -e "$CUTLASS_COMMIT^{commit}" 2>/dev/null \
    || die "--cutlass-git $CUTLASS_GIT holds no commit $CUTLASS_COMMIT"

mkdir -p .te/build/whl .te/whl
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
log "TE $TE_TAG ($TE_COMMIT) and CUTLASS $CUTLASS_COMMIT headers -> .te/build/te-src.tar.xz"
git -C "$TE_GIT" archive --prefix=te/ "$TE_COMMIT" -- \
    transformer_engine build_tools setup.py pyproject.toml README.rst LICENSE MANIFEST.in | tar -x -C "$stage"
git -C "$CUTLASS_GIT" archive --prefix=te/3rdparty/cutlass/ "$CUTLASS_COMMIT" -- include tools/util/include LICENSE.txt \
    | tar -x -C "$stage"
echo "$TE_TAG $TE_COMMIT cutlass $CUTLASS_COMMIT" >"$stage/te/PINNED"
tar -C "$stage" -cJf .te/build/te-src.tar.xz te
sha256sum .te/build/te-src.tar.xz | tee .te/build/te-src.sha256 >&2

# The GPU machines run Python 3.12 on x86-64; --no-deps: each needed dependency is named in pins.sh.
download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$@"
}
log "wheels: ${TE_BUILD_WHEELS[*]} -> .te/build/whl; ${TE_RUN_WHEELS[*]} -> .te/whl"
download .te/build/whl "${TE_BUILD_WHEELS[@]}"
download .te/whl "${TE_RUN_WHEELS[@]}"
du -sh .te/build .te/whl >&2
log "done: run the build on a GPU machine with .te/build and .te/whl carried ($REPO/docs/transformer_engine.md)"
