#!/usr/bin/env bash
# The prepared GPU check (issue 26): one process on one GPU, one table, under 5 minutes.
#
# The lent GPU machine has CUDA torch but no torchtitan, HiGHS or network. So:
#   - the plans are made here on CPU and carried in the working tree:
#       .venv/bin/python benchmarks/gpu_check.py --make-plans benchmarks
#   - the model is a pure-torch decoder (tests/models.py's Hugging Face style one);
#   - autopp's graph runtime imports torchtitan's graph_pp code (autopp/_compat/graph.py):
#     carry torchtitan's pure-Python wheel and install it there with --no-deps
#     (GPU_CHECK_WHEELS=dir of wheels; nothing is downloaded).
# On this CPU machine the same checks run with: bash scripts/gpu_check.sh --cpu
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
if [[ -n "${GPU_CHECK_WHEELS:-}" ]]; then
  "$python" -m pip install --no-deps --no-index --quiet "$GPU_CHECK_WHEELS"/*.whl
fi
if [[ " $* " == *" --cpu "* ]]; then
  exec "$python" benchmarks/gpu_check.py "$@"
fi
exec "$python" benchmarks/gpu_check.py --plans benchmarks "$@"
