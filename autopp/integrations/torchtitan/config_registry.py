"""torchtitan config registry of autopp: ``--module autopp.integrations.torchtitan``.

Configs: ``llama3_debugmodel_autopp`` (torchtitan's Trainer through an autopp pipeline,
``--autopp.*`` options), ``llama3_debugmodel_torchtitan`` (the same job with torchtitan's
manual PP x FSDP x TP, for comparison), and ``llama3_autopp(flavor)`` /
``llama3_torchtitan(flavor)`` for any llama3 preset. Both run on gloo or GPUs.

Differences from torchtitan's ``llama3_debugmodel``, each for a reason: SDPA attention
(FlexAttention has no CPU backward, so attention is plain causal and per-document positions
reach RoPE only with :attr:`AutoppOptions.per_document_positions`); plain
``CrossEntropyLoss`` (the chunked loss needs the lm_head outside the pipeline); fp32
parameters; CPU-sized sequences; no activation checkpointing or validator; stand-in
tokenizer and dataset (:mod:`autopp.integrations.torchtitan.assets`)."""

from __future__ import annotations

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.protocols.model_spec import ModelSpec

from autopp.integrations.torchtitan.options import AutoppOptions
from autopp.integrations.torchtitan.pipelining import pipeline_autopp
from autopp.integrations.torchtitan.reference import gloo_safe, pipeline_torchtitan
from autopp.integrations.torchtitan.trainer import DATASET_PATH, TOKENIZER_PATH, AutoppTrainer


def llama3_spec(flavor: str, *, pipelining_fn) -> ModelSpec:
    """torchtitan's llama3 ``flavor`` with SDPA attention, pipelined by ``pipelining_fn``."""
    from torchtitan.experiments.graph_trainer.common_utils import (
        build_decoder_config_for_backend,
    )
    from torchtitan.models.llama3 import llama3_configs, parallelize_llama
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    return ModelSpec(
        name="llama3",
        flavor=flavor,
        model=build_decoder_config_for_backend(llama3_configs[flavor], "sdpa"),
        parallelize_fn=gloo_safe(parallelize_llama),
        pipelining_fn=pipelining_fn,
        post_optimizer_build_fn=None,
        state_dict_adapter=Llama3StateDictAdapter,
    )


def _llama3(flavor: str, pipelining_fn) -> AutoppTrainer.Config:
    spec = llama3_spec(flavor, pipelining_fn=pipelining_fn)
    return AutoppTrainer.Config(
        model_spec=spec,
        hf_assets_path=TOKENIZER_PATH,
        loss=CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(
            local_batch_size=4, seq_len=128, steps=20, mixed_precision_param="float32",
            disable_cuda_graphs=True),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test",
                                                    dataset_path=DATASET_PATH),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(
            pipeline_parallel_degree=2, tensor_parallel_degree=2,
            pipeline_parallel_schedule="Interleaved1F1B", pipeline_parallel_microbatch_size=1,
            spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(interval=10, last_save_model_only=False),
        activation_checkpoint=None,
        validator=Validator.Config(enable=False),
        autopp=AutoppOptions(),
    )


def llama3_autopp(flavor: str = "debugmodel") -> AutoppTrainer.Config:
    """llama3 ``flavor`` trained through an autopp pipeline."""
    return _llama3(flavor, pipeline_autopp)


def llama3_torchtitan(flavor: str = "debugmodel") -> AutoppTrainer.Config:
    """llama3 ``flavor`` with torchtitan's own manual PP x FSDP x TP (for comparison)."""
    return _llama3(flavor, pipeline_torchtitan)


def llama3_debugmodel_autopp() -> AutoppTrainer.Config:
    return llama3_autopp("debugmodel")


def llama3_debugmodel_torchtitan() -> AutoppTrainer.Config:
    return llama3_torchtitan("debugmodel")
