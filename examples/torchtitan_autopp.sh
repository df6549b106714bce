#!/usr/bin/env bash
# torchtitan's own entry point (python -m torchtitan.train) training llama3 debugmodel
# through autopp, pp=2 x dp=2 x tp=2 on 8 CPU processes (gloo).
#
#   bash examples/torchtitan_autopp.sh           # 20 steps with autopp; extra args go to torchtitan
#       (e.g. --autopp.per_document_positions --dataloader.dataset_path
#        ./outputs/autopp_assets/c4_test_short_docs: RoPE positions restarting per document)
#   bash examples/torchtitan_autopp.sh compare   # the acceptance checks, on the same weights:
#       1. a seed checkpoint (torchtitan's init, 1 process);
#       2. autopp at pp2 x dp2 x tp2 from it, 20 steps, checkpoints at steps 10 and 20;
#       3. torchtitan's own manual PP x FSDP x TP from it, 20 steps: losses side by side;
#       4. autopp resumed from step 10 at pp4 x dp2 x tp1: steps 11-20 side by side with 2.
# Work files go to $WORK (default: /tmp/torchtitan_autopp).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="$root/.venv/bin"
work="${WORK:-/tmp/torchtitan_autopp}"
mkdir -p "$work" && cd "$work"
train() {  # nprocs, then torchtitan's arguments
  local n=$1; shift
  "$bin/torchrun" --standalone --nproc-per-node "$n" --local-ranks-filter 0,$((n / 2)) \
    -m torchtitan.train --module autopp.integrations.torchtitan "$@"
}
layout=(--parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_shard_degree 2
        --parallelism.tensor_parallel_degree 2)

if [[ "${1:-}" != "compare" ]]; then
  train 8 --config llama3_debugmodel_autopp "${layout[@]}" --training.steps 20 "$@"
  exit
fi

rm -rf seed run_autopp run_torchtitan run_resumed
train 1 --config llama3_debugmodel_torchtitan --dump_folder seed --checkpoint.enable \
  --checkpoint.create_seed_checkpoint --parallelism.pipeline_parallel_degree 1 \
  --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1 > seed.log 2>&1
from_seed=(--training.steps 20 --checkpoint.enable
           --checkpoint.initial_load_path "$work/seed/checkpoint/step-0")
train 8 --config llama3_debugmodel_autopp "${layout[@]}" --dump_folder run_autopp "${from_seed[@]}" \
  2>&1 | tee autopp.log
train 8 --config llama3_debugmodel_torchtitan "${layout[@]}" --dump_folder run_torchtitan \
  "${from_seed[@]}" > torchtitan.log 2>&1
train 8 --config llama3_debugmodel_autopp --parallelism.pipeline_parallel_degree 4 \
  --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1 \
  --dump_folder run_resumed --training.steps 20 --checkpoint.enable \
  --checkpoint.initial_load_path "$work/run_autopp/checkpoint/step-10" \
  --checkpoint.no-initial-load-model-only > resumed.log 2>&1
echo "== autopp (A) vs torchtitan's manual PP x FSDP x TP (B), same initial weights"
"$bin/python" -m autopp.integrations.torchtitan.logs autopp.log torchtitan.log
echo "== autopp pp2 x dp2 x tp2 (A) vs resumed from its step-10 checkpoint at pp4 x dp2 x tp1 (B)"
"$bin/python" -m autopp.integrations.torchtitan.logs autopp.log resumed.log
