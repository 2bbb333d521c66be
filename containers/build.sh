#!/usr/bin/env bash
# Build the MegatronDPP image and import it as an enroot squashfs for Pyxis (IMAGE=... / --image).
#
#   containers/build.sh [NAME] [OUTPUT.sqsh]        default: megatron-dpp, ./megatron-dpp.sqsh
#   BASE_IMAGE=nvcr.io/nvidia/pytorch:25.03-py3 containers/build.sh
#
# Then: python -m workflows.submit gpt --nodes 2 --gpus-per-node 4 --image "$PWD/megatron-dpp.sqsh"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

NAME=${1:-megatron-dpp}
OUTPUT=${2:-$NAME.sqsh}
BASE_IMAGE=${BASE_IMAGE:-nvcr.io/nvidia/pytorch:25.03-py3}

die() { echo "build.sh: error: $*" >&2; exit 2; }
command -v docker >/dev/null || die "docker not found: build on a machine with the Docker engine"
command -v enroot >/dev/null || die "enroot not found: import on a Slurm node with enroot (https://github.com/NVIDIA/enroot)"

docker build --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$NAME:latest" -f containers/Dockerfile .
# enroot refuses to overwrite an existing file; a stale image would be worse than none.
rm -f "$OUTPUT"
enroot import -o "$OUTPUT" "dockerd://$NAME:latest"
echo "build.sh: wrote $OUTPUT (use it as IMAGE=$(realpath "$OUTPUT"))"
