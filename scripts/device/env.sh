# Sourced at the start of every command on a device machine (the `device` tool's GPU hosts):
# installs the carried wheels (.whl: megatron-core for Python 3.12, pybind11, pytest), builds the C++
# ring extension in place, and sets the environment every GPU process must have.
# Make .whl here first:  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#   --implementation cp --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2 pybind11 \
#   pytest pluggy iniconfig pytest-timeout psutil
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device env: wheel install failed"; return 1 2>/dev/null || exit 1; }
export PYTHONPATH=/tmp/site:$PWD
python3 setup.py -q build_ext --inplace >/tmp/build_ext.log 2>&1 || { tail -20 /tmp/build_ext.log; return 1 2>/dev/null || exit 1; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
# One GPU test file, bounded: `gpu_pytest FILE SECONDS PATTERN LINES [pytest args]` writes $OUT/<file>.log and
# prints its exit status, its time and its last LINES lines matching PATTERN (warnings left out).
gpu_pytest() {
    local file=$1 limit=$2 pattern=$3 lines=$4 t0=$SECONDS name rc
    shift 4
    name=$(basename "$file" .py)
    timeout "$limit" python3 -m pytest -q -s -m gpu -p no:cacheprovider "$file" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s"
    grep -vE "UserWarning|warnings.warn" "$OUT/$name.log" | grep -E "$pattern" | tail -"$lines"
}
