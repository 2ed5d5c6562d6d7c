#!/usr/bin/env bash
# The GPU machine's whole run in one command: install the wheels under .whl/, run the GPU tests, then the
# benchmark of the machine (one GPU or two; docs/gpu.md). Logs and results go under $OUT.
#
#   OUT=/tmp/out bash scripts/gpu_run.sh
#   OUT=/tmp/out TESTS=0 BENCH_ARGS="--models 8b,moe --repeat 5 --sweep-mib=" bash scripts/gpu_run.sh
#   OUT=/tmp/out TESTS_K="not nccl" BENCH2_ARGS="--cases remote-tp1" bash scripts/gpu_run.sh
#   OUT=/tmp/out TESTS_FILES=tests/test_vllm_gpu.py BENCH=0 bash scripts/gpu_run.sh     # a real vLLM: the tests
#   OUT=/tmp/out TESTS=0 BENCH=0 VLLM_BENCH=1 bash scripts/gpu_run.sh                   # ... and its benchmark
#
# Wheels of what the machine lacks (megatron-core, structlog, pytest-asyncio; docs/gpu.md says how to download
# them) come in .whl/ in the repository root, installed into /tmp/site, which goes first on PYTHONPATH, with the
# repository after it. A vLLM installed by the shared bundle's install.sh (docs/gpu.md, "A real vLLM") is used
# from $VLDEV/site (default $HOME/vldev/site), which then also holds those wheels; .whl/ may be left out.
#
# Writes under $OUT:
#   env.txt           the wheel install, kernel, cores, GPUs and their topology, package versions
#   gpu-tests.log     the GPU tests (pytest -m gpu over the test files that have any)
#   one GPU:          bench.log, h200.json, trace/                      (python -m benchmarks.cuda)
#   two GPUs:         bench-2gpu.log, h200x2.json, trace-remote-w4.json  (python -m benchmarks.two_gpu)
#   VLLM_BENCH=1:     bench-vllm.log, h200-vllm.json                    (python -m benchmarks.vllm_gpu)
#
# Environment (all optional):
#   OUT               where logs and results go (default /tmp/streamsync-out)
#   TESTS=0           skip the GPU tests; TESTS_K: a pytest -k expression selecting among them;
#                     TESTS_FILES: the test files to run (default: every file holding GPU tests)
#   BENCH=0|1         the one-GPU benchmark (default 1 when fewer than two GPUs are visible)
#   BENCH2=0|1        the two-GPU cases (default 1 when two or more GPUs are visible)
#   BENCH_ARGS        options added to python -m benchmarks.cuda (e.g. "--models 8b,moe --repeat 5")
#   BENCH2_ARGS       options added to python -m benchmarks.two_gpu (e.g. "--cases remote-tp1")
#   VLLM_BENCH=0|1    python -m benchmarks.vllm_gpu, into a real vLLM (default 0); VLLM_BENCH_ARGS: its options
#   TESTS_LIMIT, BENCH_LIMIT, BENCH2_LIMIT, VLLM_BENCH_LIMIT   seconds each step may run (420, 360, 480, 480)
#   STREAMSYNC_LOG    the library's log level (default warning)
# Each step runs in its own process group, killed whole at its limit (a receiver process left behind would
# keep a pipe or a GPU busy), and logs to its file only. The exit status is nonzero if any step failed.
set -uo pipefail
OUT=${OUT:-/tmp/streamsync-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
# NVLink multicast stays off on shared multi-GPU hosts (it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 STREAMSYNC_LOG=${STREAMSYNC_LOG:-warning} PYTHONWARNINGS=ignore

# megatron-core, structlog, pytest-asyncio (and whatever else the machine lacks) come as wheels in .whl/.
: > "$OUT/env.txt"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$OUT/env.txt" 2>&1 || { echo "wheel install failed"; cat "$OUT/env.txt"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD
VLSITE=${VLDEV:-$HOME/vldev}/site
if [ -d "$VLSITE/vllm" ]; then  # the shared vLLM bundle's install (docs/gpu.md, "A real vLLM")
  export PYTHONPATH=$VLSITE:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_HOST_IP=127.0.0.1
  echo "vLLM from $VLSITE" >> "$OUT/env.txt"
fi

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
for m in ("anyio", "structlog", "pytest", "pytest_asyncio", "pytest_timeout", "megatron.core", "vllm"):
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
  # The test files holding GPU tests: marked `gpu` by `@pytest.mark.gpu` or by `@gpu` (streamsync.testing.gpu).
  if [ -n "${TESTS_FILES:-}" ]; then
    read -r -a GPU_TESTS <<< "$TESTS_FILES"
  else
    mapfile -t GPU_TESTS < <(grep -lE '^@(pytest\.mark\.)?gpu\b' tests/test_*.py)
  fi
  run_step "GPU tests" "${TESTS_LIMIT:-420}" "$OUT/gpu-tests.log" \
    python3 -m pytest -p no:cacheprovider -q -rA --timeout 150 -m gpu ${TESTS_K:+-k "$TESTS_K"} "${GPU_TESTS[@]}"
  rc=$((rc | $?))
fi
if [ "$BENCH" != 0 ]; then
  mkdir -p "$OUT/trace"
  # shellcheck disable=SC2086
  run_step "one-GPU benchmark" "${BENCH_LIMIT:-360}" "$OUT/bench.log" \
    python3 -m benchmarks.cuda --json "$OUT/h200.json" --trace-dir "$OUT/trace" ${BENCH_ARGS:-}
  rc=$((rc | $?))
fi
if [ "$BENCH2" != 0 ]; then
  # shellcheck disable=SC2086
  run_step "two-GPU benchmark" "${BENCH2_LIMIT:-480}" "$OUT/bench-2gpu.log" \
    python3 -m benchmarks.two_gpu --json "$OUT/h200x2.json" --trace "$OUT/trace-remote-w4.json" ${BENCH2_ARGS:-}
  rc=$((rc | $?))
  [ -f "$OUT/h200x2.json" ] && python3 -c "
import json, sys
from benchmarks.two_gpu import table
print(table(json.load(open(sys.argv[1]))['rows']))" "$OUT/h200x2.json"
fi
if [ "${VLLM_BENCH:-0}" != 0 ]; then
  # shellcheck disable=SC2086
  run_step "vLLM benchmark" "${VLLM_BENCH_LIMIT:-480}" "$OUT/bench-vllm.log" \
    python3 -m benchmarks.vllm_gpu --json "$OUT/h200-vllm.json" ${VLLM_BENCH_ARGS:-}
  rc=$((rc | $?))
fi
exit $rc
