#!/usr/bin/env bash
# The run command: refreshes .venv, then trains torchtitan's llama3 debugmodel with
# pp=2 x dp=2 x tp=2 on 8 CPU processes (gloo). Extra flags go to the example script.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"
cd "$root"
exec "$root/.venv/bin/torchrun" --standalone --nproc-per-node 8 \
    examples/llama3_pp_dp_tp.py --pp 2 --dp 2 --tp 2 --device cpu "$@"
