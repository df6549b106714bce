"""Worker for the attention variants' launch (tests/models/test_attention_check.py): transformers
decoders whose attention autopp reproduces (Gemma2's softcap, window and scaling) or routes
to the model's own function (attention sinks), planned with their blocks sharded over tp and
replicated; one step each."""

from __future__ import annotations

import torch.distributed as dist

from tests.harness.attention_models import MODELS
from tests.harness.case import Case, parity_options
from tests.harness.launch import ships_tensors
from tests.harness.models import ce_loss, make_batch
from tests.harness.parity import norms
from tests.harness.ranks import dp_rows, full


def one_step(rank: int, world_size: int, configs: list[Case]) -> list[dict]:
    """Each case: pipeline_autoparallel on its mesh (``planner_options`` give a Planner),
    one step; the loss, the gradients by FQN, the tp-sharded parameters and describe()."""
    from autopp import build_world_mesh, pipeline_autoparallel
    from autopp.backends import Planner

    out = []
    for cfg in configs:
        mesh = build_world_mesh(pp=cfg.pp, dp=cfg.dp, tp=cfg.tp)
        tokens, target = make_batch(cfg.batch, cfg.seq)
        tok, tgt = dp_rows(mesh, tokens, target)
        parallelize = cfg.parallelize
        if cfg.planner_options is not None:
            parallelize = Planner(parity_options(**cfg.planner_options))
        pipe = pipeline_autoparallel(MODELS[cfg.model](cfg.n_layers), mesh,
                                     example_inputs=(tok,), loss_fn=ce_loss,
                                     schedule=cfg.schedule, n_microbatches=cfg.n_microbatches,
                                     parallelize=parallelize)
        pipe.init_weights(seed=0)
        loss = pipe.step(tok, target=tgt)
        grads = {name: full(p.grad).detach().clone() for name, p in pipe.named_parameters()}
        from torch.distributed.tensor import DTensor

        out.append({"losses": [loss], "grads": grads if ships_tensors(mesh) else {},
                    "grad_norms": norms(grads), "describe": pipe.describe(),
                    "tp_sharded": sorted(
                        n for n, p in pipe.named_parameters() if isinstance(p, DTensor)
                        and any(pl.is_shard() for pl in p.placements))})
        dist.barrier()
    return out
