#!/usr/bin/env bash
# The embedded default: set up the environment if needed, then run the main job on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/streamsync run pipelines/embedded-default.toml "$@"
