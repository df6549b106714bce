"""``AutoppTrainer``: torchtitan's Trainer with an ``[autopp]`` config section.

The training loop, data, loss, optimizer, LR schedule, clipping, checkpointing, metrics and
profiler are torchtitan's own. The subclass only adds the ``--autopp.*`` options and hands
them to :func:`~autopp.integrations.torchtitan.pipelining.pipeline_autopp`; adapts
torchtitan's environment for the job's lifetime (CPU devices, torch 2.13's missing
``set_timeout``: :mod:`autopp.integrations.torchtitan.environment`); writes the stand-in
tokenizer and dataset; drops the dataloader's per-document ``positions`` unless
``--autopp.per_document_positions``; logs autopp's predicted tps beside the measured one; and
with ``--autopp.losses_file`` records the losses torchtitan computed at full precision."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from autopp.integrations.torchtitan.options import AutoppOptions
from autopp.integrations.torchtitan.pipelining import pipeline_autopp

#: Where the configs of this registry look for the tokenizer and dataset.
ASSETS_ROOT = "./outputs/autopp_assets"
TOKENIZER_PATH = f"{ASSETS_ROOT}/tokenizer"
DATASET_PATH = f"{ASSETS_ROOT}/c4_test"
#: The same texts, one document per paragraph: rows pack several documents
#: (:mod:`autopp.integrations.torchtitan.assets`).
SHORT_DOCS_DATASET_PATH = f"{ASSETS_ROOT}/c4_test_short_docs"


class AutoppTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        autopp: AutoppOptions = field(default_factory=AutoppOptions)
        """autopp's options (``--autopp.*``); used when the model spec's pipelining_fn
        is autopp's."""

    def __init__(self, config: Config):
        from autopp.integrations.torchtitan import environment as env

        self._restore = [env.use_set_timeout()]
        try:
            if env.needs_cpu_device():
                if config.profiler.enable_memory_snapshot:
                    raise ValueError("--profiler.enable_memory_snapshot records CUDA "
                                     "allocations; there is no CUDA device here")
                self._restore.append(env.use_cpu_device())
            self._prepare(config)
            super().__init__(config)
            self._predicted = self._predict_tps()
            if config.autopp.losses_file:
                self._record_losses(config.autopp.losses_file)
        except BaseException:
            self._undo_environment()
            raise

    @staticmethod
    def _prepare(config: Config) -> None:
        if (config.hf_assets_path == TOKENIZER_PATH
                or getattr(config.dataloader, "dataset_path", None) in (
                    DATASET_PATH, SHORT_DOCS_DATASET_PATH)):
            from autopp.integrations.torchtitan.assets import ensure_assets

            ensure_assets(ASSETS_ROOT)
        spec = config.model_spec
        if spec is not None and spec.pipelining_fn is pipeline_autopp:
            if (config.parallelism.pipeline_parallel_degree == 1
                    and not config.checkpoint.create_seed_checkpoint):
                logger.warning("pipeline_parallel_degree 1: torchtitan's Trainer calls no "
                               "pipelining_fn, so autopp is not used; the model is "
                               "parallelized by torchtitan's own parallelize_fn")
            if config.validator.enable:
                raise ValueError("torchtitan's validator is not supported with autopp's "
                                 "pipeline yet: set --validator.enable false")
            config.model_spec = dataclasses.replace(
                spec, pipelining_fn=functools.partial(pipeline_autopp, options=config.autopp))

    def _predict_tps(self):
        """After each metrics line (from the second), the predicted tps next to the measured
        one (:class:`~autopp.integrations.torchtitan.estimates.PredictedThroughput`)."""
        from autopp.integrations.torchtitan.estimates import PredictedThroughput, predicted_tps
        from autopp.integrations.torchtitan.pipelining import AutoppSchedule

        schedule = getattr(self, "pp_schedule", None)
        plan = getattr(schedule, "plan", None) if isinstance(schedule, AutoppSchedule) else None
        if plan is None or predicted_tps(plan) is None:
            return None
        return PredictedThroughput(self.metrics_processor, plan, logger=logger)

    def _record_losses(self, path: str) -> None:
        """Append each step's loss and gradient norm, as torchtitan hands them to its
        metrics processor, to ``<path>.rank<R>`` (see ``AutoppOptions.losses_file``)."""
        import json

        import torch.distributed as dist

        out = f"{path}.rank{dist.get_rank() if dist.is_initialized() else 0}"
        log = self.metrics_processor.log

        holds_loss = getattr(self, "pp_has_last_stage", True)  # False: a placeholder loss

        def recording(step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
            if holds_loss:
                with open(out, "a") as f:
                    f.write(json.dumps({"step": int(step), "loss": float(global_avg_loss),
                                        "grad_norm": float(grad_norm)}) + "\n")
            return log(step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

        self.metrics_processor.log = recording

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor],
                                 labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        if not self.config.autopp.per_document_positions:
            input_dict = {k: v for k, v in input_dict.items() if k != "positions"}
        return super().post_dataloading_process(input_dict, labels)

    def _undo_environment(self) -> None:
        while self._restore:
            self._restore.pop()()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._undo_environment()


__all__ = ["AutoppTrainer", "ASSETS_ROOT", "TOKENIZER_PATH", "DATASET_PATH",
           "SHORT_DOCS_DATASET_PATH"]
