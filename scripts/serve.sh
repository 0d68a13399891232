#!/usr/bin/env bash
# Sets up, then starts `turnout serve` (frontend + 2 SmolLM2 workers on 127.0.0.1:8000).
# Extra arguments go to `turnout serve`, e.g. scripts/serve.sh --num-workers 1 --port 9000
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/turnout serve "$@"
