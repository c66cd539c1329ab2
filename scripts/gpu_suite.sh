#!/usr/bin/env bash
# The GPU run, in one call on the device machine: the test suite (2 and 4 ranks sharing the GPU, or one rank per
# GPU where there are enough), the demo, and every benchmark. Logs go to $OUT (default ./gpu-out), benchmark JSON
# and PNG to $OUT/results.tgz (and bench/results/ when run by hand); a short table is printed last.
#   [BENCH='all_reduce matmul'] [BENCH_TIMEOUT=540] [TESTS_TIMEOUT=480] [DEMO=0] [DIAG=1]
#   bash scripts/gpu_suite.sh [all|tests|bench] [pytest -k expression]
# Every benchmark takes about 7 minutes on one H200, and the tests more than 9 (2026-12-03: 90 tests in 541 s, the
# fused-GEMM file 284 s of it), so within the device's 10 minutes per command run `bench` and the tests in two
# halves:  bash scripts/gpu_suite.sh tests "fused or graphs"  and  bash scripts/gpu_suite.sh tests "not fused and
# not graphs". Results come back as one tarball: the device returns at most 8 files per call.
set -u
WHAT=${1:-all}
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
# NVLink multicast stays off in every process we start (it can take a shared host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
export PY=${PY:-python3}
GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())')
# worlds: 2 and 4 ranks sharing one GPU; with several GPUs, 2 ranks and one rank per GPU
WORLDS=$([ "$GPUS" -ge 2 ] && echo "2,$GPUS" | sed 's/^2,2$/2/' || echo "2,4")
export PK_TEST_WORLDS=${PK_TEST_WORLDS:-$WORLDS} PK_TEST_CALLS=${PK_TEST_CALLS:-300}
# Ranks compile their kernels separately, and a rank's first launch may wait for a peer still compiling a GEMM
# (tens of seconds for several ranks at once): bounded waits get a minute here instead of the CPU tests' 20 s.
export PK_WAIT_TIMEOUT=${PK_WAIT_TIMEOUT:-60}
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
if [ "$WHAT" != tests ]; then
  # every benchmark (p2p only with two GPUs or more); BENCH="a b" picks some
  skip=$([ "$GPUS" -lt 2 ] && echo '^p2p$' || echo '^$')
  export BENCH=${BENCH:-$($PY -m parallelkittens bench --list | cut -d" " -f1 | grep -v "$skip")}
  stage bench ${BENCH_TIMEOUT:-540} bash -c 'for name in $BENCH; do
    echo "== bench $name"; $PY -m parallelkittens bench "$name" --out "'"$OUT"'/results"; done'
  tar -czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results"  # few files may come back
  # DIAG=1: also where a small GEMM's host time goes, layer by layer (scripts/diagnose_host.py)
  [ "${DIAG:-0}" = 1 ] && stage diag 150 $PY scripts/diagnose_host.py --out "$OUT"
fi
if [ "$WHAT" != bench ]; then
  # -v: a run cut off by the stage's timeout still shows which tests passed and which one it was in
  stage tests ${TESTS_TIMEOUT:-480} $PY -m pytest tests -v -p no:cacheprovider --timeout 300 -rfE --durations=12 ${2:+-k "$2"}
  [ "${DEMO:-1}" = 1 ] && stage demo 150 $PY -m parallelkittens demo --ranks 4
fi

echo "== summary ($GPUS GPU(s), worlds $PK_TEST_WORLDS) =="
[ -f "$OUT/tests.log" ] && { grep -E "^=+ .*(passed|failed)" "$OUT/tests.log" || echo "cut off after $(grep -c \
  " PASSED" "$OUT/tests.log") passed, $(grep -c " FAILED" "$OUT/tests.log") failed, in: $(grep -E "::" \
  "$OUT/tests.log" | tail -n 1 | cut -d" " -f1)"; }
[ -f "$OUT/demo.log" ] && grep -E "^[a-z_.+ ]+ +(cuda|cuda-shared) |passed" "$OUT/demo.log"
[ -f "$OUT/bench.log" ] && grep -vE "^wrote|\[#" "$OUT/bench.log" | grep -E "^==|GB/s|us |ms |^ +[0-9]+ " || true
printf '%s\n' "${status[@]}"
! printf '%s\n' "${status[@]}" | grep -qv "rc=0 "  # exit 1 when any stage failed
