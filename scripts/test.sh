#!/usr/bin/env bash
# The test command: refreshes .venv, then runs the whole suite (unit + multi-process gloo tests).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q "$@"
