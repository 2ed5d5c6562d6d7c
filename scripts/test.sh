#!/usr/bin/env bash
# The test suite: set up the environment if needed, lint, then run every test (GPU tests skip on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
export STREAMSYNC_LOG=${STREAMSYNC_LOG:-warning} VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
exec .venv/bin/python -m pytest -ra "$@"
