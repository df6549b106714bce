"""autopp inside torchtitan's own entry point.

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module autopp.integrations.torchtitan --config llama3_debugmodel_autopp \\
        --parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_shard_degree 2 \\
        --parallelism.tensor_parallel_degree 2 --training.steps 20

torchtitan finds :mod:`.config_registry` from ``--module``. Its Trainer (subclassed only to
add the ``--autopp.*`` options, CPU / torch 2.13 support and the stand-in data:
:mod:`.trainer`) drives an autopp pipeline through torchtitan's ``pipelining_fn`` hook
(:mod:`.pipelining`); torchtitan's data, loss, optimizer, LR schedule, clipping,
checkpointer, metrics and profiler are used as they are. autopp's plan and the schedule
simulator's predictions (step time, bubble, memory, tokens/s) are logged at startup, and the
predicted tps next to the measured one from the second metrics line on
(:mod:`.estimates`). ``--config
llama3_debugmodel_torchtitan`` runs the same job with torchtitan's own manual
PP x FSDP x TP (:mod:`.reference`).

``bash examples/torchtitan_autopp.sh compare`` checks both against each other from one
seed checkpoint (``--checkpoint.create_seed_checkpoint`` on 1 process, loaded by both with
``--checkpoint.initial_load_path``), and resumes autopp's step-10 checkpoint at
pp4 x dp2 x tp1 (``--checkpoint.no-initial-load-model-only``);
``python -m autopp.integrations.torchtitan.logs A.log B.log`` prints two runs' losses side
by side (:mod:`.logs`).

Nothing here is imported by ``import autopp``.
"""
