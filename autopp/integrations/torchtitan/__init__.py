"""autopp inside torchtitan's own entry point.

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module autopp.integrations.torchtitan --config llama3_debugmodel_autopp \\
        --parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_shard_degree 2 \\
        --parallelism.tensor_parallel_degree 2 --training.steps 20

torchtitan finds :mod:`.config_registry` from ``--module``. Its Trainer (:mod:`.trainer`)
drives an autopp pipeline through its ``pipelining_fn`` hook (:mod:`.pipelining`), with
torchtitan's data, loss, optimizer, checkpointer and metrics as they are; autopp's predicted
step, memory and tokens/s are logged beside the measured ones (:mod:`.estimates`).
``--config llama3_debugmodel_torchtitan`` runs torchtitan's manual PP x FSDP x TP
(:mod:`.reference`); ``bash examples/torchtitan_autopp.sh compare`` checks the two against
each other. Nothing here is imported by ``import autopp``."""
