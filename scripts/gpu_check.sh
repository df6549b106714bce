#!/usr/bin/env bash
# The prepared GPU check (issue 26): one process on one GPU, one table, under 5 minutes.
#
# The lent GPU machine has CUDA torch but no torchtitan, HiGHS or network. So:
#   - the plans are made here on CPU and carried in the working tree:
#       .venv/bin/python benchmarks/gpu_check.py --make-plans benchmarks
#   - the model is a pure-torch decoder (tests/harness/models.py's Hugging Face style one);
#   - autopp's graph runtime imports torchtitan's graph_pp code (autopp/_compat/graph.py):
#     carry torchtitan's pure-Python wheel and install it there with --no-deps
#     (GPU_CHECK_WHEELS=dir of wheels; nothing is downloaded).
# On this CPU machine the same checks run with: bash scripts/gpu_check.sh --cpu
#
# Node mode, for one 8-GPU node with the project installed (torchtitan, HiGHS): autopp's
# planned pp2 x dp2 x tp2 pipeline against torchtitan's own PP x FSDP x TP on the same data
# and weights, NCCL, step time side by side and the loss at every step within a relative
# bound:
#   bash scripts/gpu_check.sh --node          (--node --cpu: 8 gloo processes, same check)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
if [[ -n "${GPU_CHECK_WHEELS:-}" ]]; then
  "$python" -m pip install --no-deps --no-index --quiet "$GPU_CHECK_WHEELS"/*.whl
fi
if [[ " $* " == *" --node "* ]]; then
  device=cuda; bound=1e-4  # fp32 on CUDA: reductions in other orders than torchtitan's
  if [[ " $* " == *" --cpu "* ]]; then device=cpu; bound=1e-5; fi
  exec "$python" -m torch.distributed.run --standalone --nproc-per-node 8 \
    benchmarks/vs_torchtitan.py --device "$device" --pp 2 --dp 2 --tp 2 --schedule 1F1B \
    --microbatches 4 --batch-size 8 --seq-len 128 --steps 8 --warmup 2 \
    --runs torchtitan,autopp-auto --max-loss-rel "$bound"
fi
if [[ " $* " == *" --cpu "* ]]; then
  exec "$python" benchmarks/gpu_check.py "$@"
fi
exec "$python" benchmarks/gpu_check.py --plans benchmarks "$@"
