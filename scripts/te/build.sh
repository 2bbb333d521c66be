#!/usr/bin/env bash
# Builds Transformer Engine (scripts/te/pins.sh: the PyTorch flavour, sm_90 only, without the MoE and
# NVFP4 kernels: scripts/te/lean.py) on a GPU machine, from the sources scripts/te/fetch.sh put in
# .te/build, and sends the wheel back in parts. Run from the repository root with .te/build and
# .te/whl carried (docs/transformer_engine.md gives the exact calls):
#
#   bash scripts/te/build.sh start [WAIT_S]  unpack, patch, start the build detached (setsid: it outlives
#                                            the command), then watch it for WAIT_S s (default 520)
#   bash scripts/te/build.sh wait [WAIT_S]   on the same machine, made within its warm window: wait for
#                                            the build (default 420 s), send the wheel back, smoke-test it;
#                                            again at once if it ended still building
#   bash scripts/te/build.sh run             the build itself, in the foreground (what start detaches)
#
# Under $OUT when the build has finished: te-wheel.part-* and te-wheel.name (reassemble here with
# scripts/te/fetch.sh --take-wheel DIR), te-build-report.txt (phase times, the slowest compiles of
# both ninja logs, the stubs), te-build.log.gz, te-smoke.txt.
set -uo pipefail
STATE=/tmp/te                      # on the GPU machine, outside the repository copy
SRC=$STATE/src/te
OUT=${OUT:-$STATE/out}
mkdir -p "$STATE" "$OUT"
log() { echo "[te-build $(date -u +%H:%M:%S)] $*"; }
die() { echo "te-build: error: $*" >&2; exit 2; }

progress() {  # the phase and ninja's last [done/total] of the detached build
    local step
    step=$(grep -aoE '^\[[0-9]+/[0-9]+\]' "$STATE/build.log" 2>/dev/null | tail -n1)
    echo "$(cat "$STATE/phase" 2>/dev/null || echo starting) ${step:-}"
}

wait_done() {  # wait_done LIMIT_S: 0 once the build has ended (its exit status in $STATE/rc)
    local limit=$1 t0=$SECONDS next=0
    while [[ ! -f $STATE/rc ]]; do
        (( SECONDS - t0 >= limit )) && { log "still building after ${limit}s: $(progress)"; return 1; }
        (( SECONDS - t0 >= next )) && { log "building: $(progress)"; next=$((next + 60)); }
        sleep 5
    done
    log "build ended, rc=$(cat "$STATE/rc"): $(progress)"
    return 0
}

collect() {  # the wheel (in parts: 16 MiB a file comes back), the report and the log, under $OUT
    local whl
    cp "$STATE/report.txt" "$OUT/te-build-report.txt" 2>/dev/null
    gzip -c "$STATE/build.log" >"$OUT/te-build.log.gz"
    whl=$(ls "$STATE"/dist/*.whl 2>/dev/null | head -n1)
    [[ -n $whl ]] || { log "no wheel (see te-build-report.txt and te-build.log.gz)"; return 1; }
    local torch_v; torch_v=$(python3 -c 'import torch; print(torch.__version__)')
    echo "$(basename "$whl") $(sha256sum "$whl" | cut -d' ' -f1) torch=$torch_v" >"$OUT/te-wheel.name"
    split -b 15M -a 2 "$whl" "$OUT/te-wheel.part-"
    local n; n=$(ls "$OUT"/te-wheel.part-* | wc -l)
    (( n <= 4 )) || log "warning: the wheel is $(du -h "$whl" | cut -f1), $n parts: with the four other files, more than 8 files under \$OUT will not all come back"
    log "wheel $(basename "$whl") ($(du -h "$whl" | cut -f1)) in $n parts under \$OUT"
}

smoke() {  # install the wheel with its run-time wheels, then scripts/te/smoke.py on the GPU
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .te/whl/*.whl "$STATE"/dist/*.whl || { log "installing the wheel failed"; return 1; }
    PYTHONPATH=/tmp/site:$PWD timeout -k 5 120 python3 scripts/te/smoke.py 2>&1 | tee "$OUT/te-smoke.txt"
}

phase() { echo "$1" >"$STATE/phase"; echo "$1 $((SECONDS - T0))" >>"$STATE/times.txt"; log "$1"; }

run_build() {
    T0=$SECONDS
    : >"$STATE/times.txt"
    phase "environment"
    local sp cudnn_h nccl_h h f
    export PYTHONPATH=$STATE/buildsite${PYTHONPATH:+:$PYTHONPATH}
    sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
    cudnn_h=$(find "$sp/nvidia" -name cudnn.h 2>/dev/null | head -n1)
    nccl_h=$(find "$sp/nvidia" -name nccl.h 2>/dev/null | head -n1)
    [[ -n $cudnn_h && -n $nccl_h ]] || die "cudnn.h ($cudnn_h) or nccl.h ($nccl_h) not found under $sp/nvidia"
    export CUDNN_PATH; CUDNN_PATH=$(dirname "$(dirname "$cudnn_h")"); export CUDNN_HOME=$CUDNN_PATH
    export CPATH="$CUDNN_PATH/include:$(dirname "$nccl_h")${CPATH:+:$CPATH}"
    # Headers the toolkit may lack are in torch's nvidia-* wheels (as the probe found).
    for h in cuda_runtime.h cublas_v2.h cublasLt.h cusparse.h cusolverDn.h curand.h nvrtc.h cudaTypedefs.h cuda_fp4.h nvtx3/nvToolsExt.h; do
        [[ -f /usr/local/cuda/include/$h ]] && continue
        f=$(find "$sp/nvidia" -path "*/include/$h" 2>/dev/null | head -n1)
        [[ -n $f ]] && export CPATH="$CPATH:${f%/"$h"}"
    done
    export NVTE_CMAKE_EXTRA_ARGS="-DNCCL_INCLUDE_DIR=$(dirname "$nccl_h")"
    export CUDA_HOME=/usr/local/cuda CUDACXX=/usr/local/cuda/bin/nvcc PATH=/usr/local/cuda/bin:$PATH
    # sm_90 only (H100/H200); no NCCL EP (MoE expert parallelism; it would build the NCCL submodule);
    # one compile per core, one nvcc thread each (one architecture: nothing to split).
    export NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 NVTE_WITH_NCCL_EP=0 MAX_JOBS=$(nproc)
    export NVTE_BUILD_THREADS_PER_JOB=1 NVTE_SKIP_SUBMODULE_CHECKS_DURING_BUILD=1 NVTE_NO_LOCAL_VERSION=1
    export NVTE_CMAKE_BUILD_DIR=$STATE/cmake PYTHONUNBUFFERED=1
    cd "$SRC" || die "no sources at $SRC (run start first)"
    python3 -c "from wheel.bdist_wheel import bdist_wheel" 2>/dev/null \
        || sed -i 's/^from wheel.bdist_wheel import bdist_wheel/from setuptools.command.bdist_wheel import bdist_wheel/' setup.py
    { echo "cores $(nproc)"; nvcc --version | tail -n2 | head -n1; cmake --version | head -n1
      python3 -c 'import torch; print("torch", torch.__version__)'; } >"$STATE/report.txt" 2>&1

    phase "build (core library, then the PyTorch extension)"
    python3 setup.py bdist_wheel -d "$STATE/dist1" || return 1
    phase "stubs"
    local check=$STATE/check core ext
    rm -rf "$check" && mkdir -p "$check" && (cd "$check" && python3 -m zipfile -e "$STATE"/dist1/*.whl .)
    core=$(find "$check" -name 'libtransformer_engine.so' | head -n1)
    ext=$(find "$check" -name 'transformer_engine_torch*.so' | head -n1)
    [[ -n $core && -n $ext ]] || { log "the wheel lacks libtransformer_engine.so or transformer_engine_torch*.so"; return 1; }
    python3 "$STATE/bin/lean.py" stubs "$SRC" "$core" "$ext" | tee -a "$STATE/report.txt"
    phase "relink with the stubs"
    python3 setup.py bdist_wheel -d "$STATE/dist" || return 1
    rm -rf "$check" && mkdir -p "$check" && (cd "$check" && python3 -m zipfile -e "$STATE"/dist/*.whl .)
    core=$(find "$check" -name 'libtransformer_engine.so' | head -n1)
    ext=$(find "$check" -name 'transformer_engine_torch*.so' | head -n1)
    python3 "$STATE/bin/lean.py" check "$core" "$ext" 2>&1 | tee -a "$STATE/report.txt"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || return 1
    phase "done"
    { echo "--- phases (name, seconds since start)"; cat "$STATE/times.txt"
      echo "--- wheel"; ls -l "$STATE"/dist/*.whl; ls -l "$core" "$ext"
      echo "--- slowest compiles, core library (seconds, object)"
      awk -F'\t' '!/^#/ {printf "%8.1f s  %s\n", ($2-$1)/1000, $4}' "$STATE/cmake/.ninja_log" | sort -rn | head -n 30
      echo "--- slowest compiles, PyTorch extension"
      awk -F'\t' '!/^#/ {printf "%8.1f s  %s\n", ($2-$1)/1000, $4}' build/temp*/.ninja_log 2>/dev/null | sort -rn | head -n 15
    } >>"$STATE/report.txt" 2>&1
    return 0
}

case ${1:-} in
    run)
        # rc is written however the build ends (die exits from inside run_build too).
        trap 'echo $? >"$STATE/rc"' EXIT
        run_build >>"$STATE/build.log" 2>&1 ;;
    start)
        [[ -f .te/build/te-src.tar.xz ]] || die "no .te/build/te-src.tar.xz: run scripts/te/fetch.sh here and carry .te/build and .te/whl"
        if [[ -f $STATE/phase && ! -f $STATE/rc ]]; then
            log "a build is already under way on this machine: watching it"
        else
            rm -rf "$STATE/src" "$STATE/cmake" "$STATE/dist" "$STATE/dist1" "$STATE/rc" "$STATE/phase" "$STATE/build.log"
            mkdir -p "$STATE/src" "$STATE/bin" "$STATE/buildsite"
            # The detached build runs from copies: the next call may lay the repository copy anew.
            cp scripts/te/build.sh scripts/te/lean.py "$STATE/bin/"
            tar -C "$STATE/src" -xJf .te/build/te-src.tar.xz || die "unpacking .te/build/te-src.tar.xz failed"
            log "sources: $(cat "$SRC/PINNED")"
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$STATE/buildsite" \
                .te/build/whl/*.whl || die "installing .te/build/whl failed"
            python3 "$STATE/bin/lean.py" patch "$SRC" || die "patching TE's CMakeLists.txt failed"
            echo "unpacked" >"$STATE/phase"
            setsid nohup bash "$STATE/bin/build.sh" run </dev/null >/dev/null 2>&1 &
            log "build started detached (pid $!); log $STATE/build.log"
        fi
        # Collecting and the smoke test are left to `wait`: this call's time went to unpacking.
        wait_done "${2:-520}"
        log "make the next call at once (the machine stays warm 30 s): bash scripts/te/build.sh wait" ;;
    wait)
        [[ -f $STATE/phase ]] || die "no build on this machine: it was given back (a later call than its warm window?); start again"
        wait_done "${2:-420}" || { log "make another wait call at once"; exit 1; }
        tail -n 30 "$STATE/build.log"
        collect || exit 1
        [[ $(cat "$STATE/rc") == 0 ]] || exit 1
        smoke ;;
    *) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
