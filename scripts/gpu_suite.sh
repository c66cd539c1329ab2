#!/usr/bin/env bash
# The GPU run, in one call on the device machine: test suite (2 and 4 ranks sharing the GPU, or one rank per GPU
# where there are enough), the demo, and every benchmark. Logs and JSON go to $OUT (default ./gpu-out); a short
# table is printed last.  Usage: bash scripts/gpu_suite.sh [pytest -k expression]
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
# NVLink multicast stays off in every process we start (it can take a shared host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
PY=${PY:-python3}
GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())')
export PK_TEST_WORLDS=${PK_TEST_WORLDS:-2,4}
status=()

stage() {  # stage NAME TIMEOUT_S CMD...: run, log to $OUT/NAME.log, remember the exit code
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  status+=("$(printf '%-10s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - start))")")
  tail -n 25 "$OUT/$name.log"
}

{ nvidia-smi -L; nvidia-smi topo -m; $PY -c 'import torch, triton; print("torch", torch.__version__, "triton",
  triton.__version__, "cuda", torch.version.cuda)'; } >"$OUT/machine.log" 2>&1
cat "$OUT/machine.log"
stage tests 420 $PY -m pytest tests -q -p no:cacheprovider --timeout 240 -rfE --durations=12 ${1:+-k "$1"}
stage demo 180 $PY -m parallelkittens demo --ranks 4
stage bench 240 $PY -m parallelkittens bench runtime --out "$OUT"

echo "== summary ($GPUS GPU(s), worlds $PK_TEST_WORLDS) =="
grep -E "passed|failed" "$OUT/tests.log" | tail -n 1
grep -E "^[a-z_+ ]+ +(cuda|cuda-shared) " "$OUT/demo.log" || true
grep -E "GB/s|us |ms " "$OUT/bench.log" | grep -v wrote || true
printf '%s\n' "${status[@]}"
