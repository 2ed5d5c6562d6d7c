#!/usr/bin/env bash
# One call on the GPU machine (see docs/gpu.md): install the carried wheels, run the GPU tests, run the
# CUDA benchmark; logs and results go under $OUT.
#
#   run(command="bash scripts/gpu_run.sh", carry=[".whl"])        # wheels: see docs/gpu.md
#
# Environment: TESTS=0 skips the tests, BENCH=0 the benchmark, BENCH_ARGS adds benchmark options.
set -uo pipefail
OUT=${OUT:-/tmp/streamsync-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
# NVLink multicast stays off on shared multi-GPU hosts (it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 STREAMSYNC_LOG=${STREAMSYNC_LOG:-warning} PYTHONWARNINGS=ignore

# megatron-core, structlog (and whatever else the machine lacks) come as wheels in .whl/.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD

{
  date -u; uname -r; nproc
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv
  python3 - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
for m in ("anyio", "structlog", "pytest", "megatron.core"):
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
} 2>&1 | tee "$OUT/env.txt"

rc=0
if [ "${TESTS:-1}" != 0 ]; then
  echo "=== GPU tests"
  timeout 200 python3 -m pytest -p no:cacheprovider -q -rA --timeout 150 tests/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.log"
  rc=$((rc | ${PIPESTATUS[0]}))
fi
if [ "${BENCH:-1}" != 0 ]; then
  echo "=== benchmark"
  mkdir -p "$OUT/trace"
  # shellcheck disable=SC2086
  timeout 360 python3 -m streamsync.bench.cuda --json "$OUT/h200.json" --trace-dir "$OUT/trace" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench.log"
  rc=$((rc | ${PIPESTATUS[0]}))
fi
exit $rc
