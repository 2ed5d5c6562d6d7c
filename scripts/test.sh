#!/usr/bin/env bash
# The test suite: set up the environment if needed, lint, then run every test (GPU tests skip on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Headless Chromium for the trace viewer's browser tests (tests/test_viewer.py also installs it where it may);
# without it, and without root to install it, those tests skip and say why.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "== installing chromium (Debian package) for the trace viewer's tests =="
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "chromium could not be installed: the viewer's browser tests will skip"
fi
.venv/bin/ruff check .
.venv/bin/mypy  # the library's types ([tool.mypy] in pyproject.toml)
export STREAMSYNC_LOG=${STREAMSYNC_LOG:-warning} VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
exec .venv/bin/python -m pytest -ra --durations=25 "$@"
