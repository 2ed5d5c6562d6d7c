#!/usr/bin/env bash
# One call on a GPU machine (one H200 or two, see docs/gpu.md): install the carried wheels, run the GPU tests,
# run the benchmarks; logs and results go under $OUT (at most 8 files come back from there).
#
#   run(command="bash scripts/gpu_run.sh", carry=[".whl"])        # wheels: see docs/gpu.md
#
# One GPU:  tests (gpu-tests.log), the colocated benchmark (h200.json, bench.log, trace/).
# Two GPUs: tests, the two-GPU NCCL tests among them (gpu-tests.log), and the two-GPU cases
#           (h200x2.json, bench-2gpu.log, trace-remote-w4.json).
# Environment: TESTS=0 skips the tests, BENCH=0/1 the one-GPU benchmark, BENCH2=0/1 the two-GPU cases (each
# defaults to what the machine has); TESTS_K is a pytest -k filter; BENCH_ARGS / BENCH2_ARGS add options
# (e.g. BENCH2_ARGS="--cases remote-tp1"); TESTS_LIMIT / BENCH_LIMIT / BENCH2_LIMIT are seconds per step.
# Each step runs in its own process group, killed whole at its limit (a receiver process left behind would
# keep a pipe or a GPU busy), and logs to a file only.
set -uo pipefail
OUT=${OUT:-/tmp/streamsync-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
# NVLink multicast stays off on shared multi-GPU hosts (it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 STREAMSYNC_LOG=${STREAMSYNC_LOG:-warning} PYTHONWARNINGS=ignore

# megatron-core, structlog, pytest-asyncio (and whatever else the machine lacks) come as wheels in .whl/.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/env.txt" 2>&1 || { echo "wheel install failed"; cat "$OUT/env.txt"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD

NGPU=$(timeout -s KILL 60 python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
BENCH=${BENCH:-$([ "$NGPU" -ge 2 ] && echo 0 || echo 1)}
BENCH2=${BENCH2:-$([ "$NGPU" -ge 2 ] && echo 1 || echo 0)}

{
  date -u; uname -r; nproc; echo "GPUs: $NGPU"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv
  nvidia-smi topo -m
  timeout -s KILL 120 python3 - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
for m in ("anyio", "structlog", "pytest", "pytest_asyncio", "pytest_timeout", "megatron.core"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", e)
try:
    import streamsync.sources.megatron  # noqa: F401
    print("streamsync.sources.megatron: importable")
except Exception as e:
    print("streamsync.sources.megatron: NOT importable:", e)
EOF
} >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# run_step NAME LIMIT_S LOGFILE CMD...: CMD in its own session; killed with its children at the limit.
run_step() {
  local name=$1 limit=$2 logf=$3
  shift 3
  echo "=== $name (from $(date -u +%T), limit ${limit}s) -> $logf"
  setsid "$@" > "$logf" 2>&1 < /dev/null &
  local pid=$! waited=0
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$waited" -ge "$limit" ]; then
      echo "$name: still running after ${limit}s: killing its process group" | tee -a "$logf"
      kill -KILL -- "-$pid" 2>/dev/null
      break
    fi
    sleep 1
    waited=$((waited + 1))
  done
  wait "$pid"
  local code=$?
  kill -KILL -- "-$pid" 2>/dev/null  # anything it left behind
  echo "=== $name: exit $code after ${waited}s; last lines:"
  tail -n 40 "$logf"
  return $code
}

rc=0
if [ "${TESTS:-1}" != 0 ]; then
  run_step "GPU tests" "${TESTS_LIMIT:-420}" "$OUT/gpu-tests.log" \
    python3 -m pytest -p no:cacheprovider -q -rA --timeout 150 -m gpu ${TESTS_K:+-k "$TESTS_K"} tests/test_cuda_ipc.py tests/test_collective_gpu.py \
      tests/test_kernels.py tests/test_engine_layout.py tests/test_megatron.py
  rc=$((rc | $?))
fi
if [ "$BENCH" != 0 ]; then
  mkdir -p "$OUT/trace"
  # shellcheck disable=SC2086
  run_step "one-GPU benchmark" "${BENCH_LIMIT:-360}" "$OUT/bench.log" \
    python -m benchmarks.cuda --json "$OUT/h200.json" --trace-dir "$OUT/trace" ${BENCH_ARGS:-}
  rc=$((rc | $?))
fi
if [ "$BENCH2" != 0 ]; then
  # shellcheck disable=SC2086
  run_step "two-GPU benchmark" "${BENCH2_LIMIT:-480}" "$OUT/bench-2gpu.log" \
    python -m benchmarks.two_gpu --json "$OUT/h200x2.json" --trace "$OUT/trace-remote-w4.json" ${BENCH2_ARGS:-}
  rc=$((rc | $?))
  [ -f "$OUT/h200x2.json" ] && python3 -c "
import json, sys
from benchmarks.two_gpu import table
print(table(json.load(open(sys.argv[1]))['rows']))" "$OUT/h200x2.json"
fi
exit $rc
