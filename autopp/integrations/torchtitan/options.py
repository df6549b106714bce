"""``AutoppOptions``: the ``[autopp]`` section of a torchtitan job config (``--autopp.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True, slots=True)
class AutoppOptions:
    """How autopp pipelines and shards the model inside torchtitan's Trainer.

    The mesh, schedule, microbatches and split come from torchtitan's own ``[parallelism]``
    and ``[training]`` sections; these fields are what only autopp has.
    """

    parallelize: Literal["auto", "replicate"] = "auto"
    """How each stage is parallelized over its dp x tp sub-mesh: "auto" (autopp's planner)
    or "replicate" (each stage replicated, gradients averaged over dp). For torchtitan's
    own FSDP + TP, use the ``*_torchtitan`` configs of this module's registry."""

    split: str | None = None
    """An autopp layout string ("Ett|tt|tt|tL") or a number of stages; None: the split
    torchtitan's ``pipeline_llm`` would make from ``parallelism.module_fqns_per_model_part``,
    ``pipeline_parallel_layers_per_stage`` and ``pipeline_parallel_{first,last}_stage_less_layers``."""

    profile: str | None = None
    """Device profile of the planner's cost model ("H100", "H200", "A100", "CPU"); None:
    "CPU" on CPU processes, else "H100"."""

    boundary: Literal["auto", "batch", "batch+seq"] = "auto"
    """Placement of activations sent between stages (planner)."""

    loss_parallel: Literal["auto", "on", "off"] = "auto"
    """Keep the logits split on the vocabulary over tp (planner, cross entropy only)."""

    memory_budget_gib: float | None = None
    """Per-device bound on parameter memory for the planner; None: no bound."""

    estimate: Literal["graphs", "rule", "off"] = "graphs"
    """The simulator's predictions logged at startup (step time, bubble, peak memory per
    device by category, tokens/s) and the predicted tps logged next to the measured one
    after each metrics line from the second on: "graphs" (each stage's plan lowered to read
    its activation memory, as ``autopp.dry_run`` does; about a second for small models),
    "rule" (no lowering, activations not counted), "off"."""

    seed: int = 0
    """Seed of autopp's split-independent initialisation (used when no checkpoint loads)."""

    per_document_positions: bool = False
    """Pass the dataloader's per-document ``positions`` (restarting at 0 at each document
    of a packed row) to the model, as torchtitan's Trainer does: every pipeline stage takes
    them as a keyword input (planned stages as graph inputs placed like the tokens; with
    ``parallelize replicate``, the model's own forward), and torchtitan's llama3 rotates
    its queries and keys by them (RoPE). Attention stays plain causal across the
    documents of a row: with the SDPA attention of this registry's configs torchtitan
    builds no document mask (``ScaledDotProductAttention`` takes ``is_causal`` only), in
    its own runs as in autopp's. False (the default): the positions are dropped and the
    model uses 0..seq_len-1 in every row. Both configs of this registry take it."""

    losses_file: str | None = None
    """Write each step's loss and gradient norm as torchtitan's Trainer computed them
    (``global_avg_loss``, ``grad_norm``: full precision, not the metrics line's 5 digits) as
    JSON lines to ``<losses_file>.rank<R>``, on every rank R that holds the last pipeline
    stage (the others log torchtitan's placeholder). Works with both configs of this registry (the comparison
    of ``examples/torchtitan_autopp.sh compare`` and ``tests/integrations/test_torchtitan_entry.py``
    reads it); None: nothing written."""
