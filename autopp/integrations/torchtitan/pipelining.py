"""autopp as torchtitan's ``pipelining_fn``: what torchtitan's Trainer drives with PP.

torchtitan's Trainer calls ``model_spec.pipelining_fn(model, ...)`` and expects
``(schedule, model_parts, has_first_stage, has_last_stage)``. :func:`pipeline_autopp` builds
an autopp :class:`~autopp.Pipeline` and returns :class:`AutoppSchedule` (its ``step`` joins
the microbatches into this dp rank's batch and runs ``Pipeline.step``), one
:class:`AutoppModelPart` per rank (the rank's stages under whole-model FQNs, the same
parameter objects, so torchtitan's optimizer, clipping and checkpointer work as they are and
checkpoints keep torchtitan's keys), and ``True, True``: every rank hands its tokens and
labels to the schedule and gets the loss.

The mesh is pp x (dp_replicate * dp_shard) x tp in torchtitan's rank order, so each rank's
batch is the one torchtitan's dataloader gives it; schedule, microbatches, split, mixed
precision and activation checkpointing map to autopp's options, and what autopp cannot
honour raises ValueError at startup."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from autopp import tracing
from autopp._compat import torchtitan as _compat
from autopp.integrations.torchtitan.options import AutoppOptions


class AutoppModelPart(nn.Module):
    """This rank's autopp stages as one module with whole-model parameter names.

    Its children are the pipeline's merged stage view (``Pipeline.local_model``), so its
    parameters are the trained ones. ``state_dict`` / ``load_state_dict`` run the state-dict
    hooks the whole model (on meta) has at those FQNs. The weights are created and
    initialised by autopp when the part is built: ``to_empty`` and ``init_weights`` (which
    torchtitan's Trainer calls next) leave them alone. It is run by :class:`AutoppSchedule`,
    not called.
    """

    def __init__(self, pipeline, whole_model: nn.Module) -> None:
        super().__init__()
        for name, child in pipeline.local_model.named_children():
            self.add_module(name, child)
        for name, p in pipeline.local_model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        object.__setattr__(self, "pipeline", pipeline)  # not a submodule
        own = {n for n, _ in self.named_modules()}
        hooked = [(fqn, m) for fqn, m in whole_model.named_modules() if fqn and fqn in own
                  and (_compat.has_state_dict_hooks(m))]
        object.__setattr__(self, "_hooked_modules", hooked)  # meta modules, not submodules
        self.register_state_dict_post_hook(AutoppModelPart._model_post_hooks)
        self.register_load_state_dict_pre_hook(AutoppModelPart._model_pre_hooks)

    @staticmethod
    def _model_post_hooks(module, state_dict, prefix, local_metadata) -> None:
        for fqn, original in module._hooked_modules:
            for hook in _compat.state_dict_post_hooks(original):
                hook(original, state_dict, f"{prefix}{fqn}.", local_metadata)

    @staticmethod
    def _model_pre_hooks(module, state_dict, prefix, local_metadata, strict, missing,
                         unexpected, errors) -> None:
        for fqn, original in module._hooked_modules:
            for hook in _compat.load_state_dict_pre_hooks(original):
                hook(state_dict, f"{prefix}{fqn}.", local_metadata, strict, missing,
                     unexpected, errors)

    def to_empty(self, *, device=None, recurse: bool = True):  # noqa: ARG002
        return self  # materialised by autopp already

    def init_weights(self, buffer_device=None) -> None:  # noqa: ARG002
        pass  # initialised by autopp (or loaded by torchtitan's checkpointer next)

    def forward(self, *args, **kwargs):
        raise RuntimeError("an autopp model part runs through its schedule "
                           "(AutoppSchedule.step), not by calling it")


class AutoppSchedule:
    """torchtitan's view of the pipeline schedule, running :meth:`autopp.Pipeline.step`.

    The loss appended to ``losses`` is this rank's share of the global-batch mean loss
    (the mean divided by the dp degree), so that torchtitan's sum over its loss mesh gives
    the exact global mean.
    """

    def __init__(self, pipeline, *, dp_size: int, plan=None,
                 keyword_inputs: Sequence[str] = ()) -> None:
        self.pipeline = pipeline
        self.dp_size = dp_size
        #: The model keyword inputs every step hands the stages (``("positions",)`` with
        #: ``--autopp.per_document_positions``).
        self.keyword_inputs = tuple(sorted(keyword_inputs))
        #: The whole pipeline's :class:`~autopp.plan.value.PipelinePlan` with the
        #: simulator's estimates (``--autopp.estimate``); None with ``parallelize
        #: replicate``. ``plan.save(path)`` keeps it.
        self.plan = plan

    @staticmethod
    def _batch(arg_mbs, kwarg_mbs, target_mbs
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """This dp rank's batch, labels and keyword inputs (each joined over the
        microbatches torchtitan split them into; autopp's schedule splits them again)."""
        if arg_mbs is None or target_mbs is None:
            raise ValueError("autopp's schedule needs every rank's tokens and labels")
        if any(len(a) != 1 for a in arg_mbs):
            raise ValueError("autopp's schedule expects one positional input (tokens)")
        kwargs: dict[str, torch.Tensor] = {}
        for key in sorted({k for kw in (kwarg_mbs or []) for k in kw}):
            values = [kw.get(key) for kw in kwarg_mbs]
            if not all(isinstance(v, torch.Tensor) for v in values):
                kinds = sorted({type(v).__name__ for v in values})
                raise ValueError(
                    f"model keyword input {key!r} is {'/'.join(kinds)}: autopp's pipeline "
                    "takes tensors batched like the tokens (e.g. --autopp."
                    "per_document_positions' positions), not attention masks built by the "
                    "model (use the SDPA attention of this registry's configs)")
            kwargs[key] = torch.cat(values)
        return torch.cat([a[0] for a in arg_mbs]), torch.cat(list(target_mbs)), kwargs

    def step(self, *args, arg_mbs: Sequence[tuple[torch.Tensor, ...]] | None = None,
             kwarg_mbs: Sequence[dict[str, Any]] | None = None,
             target_mbs: Sequence[torch.Tensor] | None = None, losses: list | None = None,
             loss_kwargs: dict[str, Any] | None = None, return_outputs: bool = False,
             **kwargs) -> None:
        if args or kwargs:
            raise TypeError("AutoppSchedule.step takes torchtitan's microbatch lists "
                            "(arg_mbs=, target_mbs=, ...)")
        if return_outputs:
            raise ValueError("autopp's schedule does not return outputs")
        del loss_kwargs  # autopp counts the global tokens itself
        inputs, target, model_kwargs = self._batch(arg_mbs, kwarg_mbs, target_mbs)
        if tuple(model_kwargs) != self.keyword_inputs:
            raise ValueError(
                f"torchtitan handed the model keyword inputs {list(model_kwargs)}; this autopp "
                f"pipeline was built for {list(self.keyword_inputs)} "
                "(--autopp.per_document_positions: the dataloader's positions). Turn the option "
                "off for a dataloader without positions, or on for one with them")
        loss = self.pipeline.step(inputs, target=target, **model_kwargs)
        if losses is not None:
            losses.append(torch.tensor(loss / self.dp_size, dtype=torch.float32,
                                       device=inputs.device))

    def eval(self, *args, **kwargs) -> None:
        raise NotImplementedError(
            "torchtitan's validator sums per-token losses; autopp's eval returns the mean. "
            "Run with --validator.enable false")


def _loss_for_autopp(loss_fn):
    """autopp's loss (mean over a microbatch's counted tokens) from torchtitan's
    ``loss_fn(pred, labels, global_valid_tokens) -> (sum / global_valid_tokens, metrics)``."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss, IGNORE_INDEX

    from autopp.loss import cross_entropy
    from autopp.loss import count_tokens

    if isinstance(loss_fn, ChunkedLossWrapper):
        raise ValueError(
            "ChunkedLossWrapper needs the lm_head outside the pipeline; with autopp use "
            "CrossEntropyLoss.Config (the *_autopp configs do)")
    if type(loss_fn) is CrossEntropyLoss:  # the planner may run it in parallel over tp
        return cross_entropy

    def mean_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        n = count_tokens(labels, IGNORE_INDEX).clamp(min=1)
        return loss_fn(pred, labels, n)[0]

    return mean_loss


def _recompute(ac_config) -> str:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if ac_config is None:
        return "none"
    if isinstance(ac_config, FullAC.Config):
        return "full"
    if isinstance(ac_config, SelectiveAC.Config):
        return "selective"
    raise ValueError("autopp maps activation_checkpoint none, selective and full to its "
                     f"recompute; got {type(ac_config).__qualname__}")


def expert_dims_of(parallel_dims) -> str:
    """``PlannerOptions.expert_dims`` for torchtitan's ``expert_parallel_degree``.
    torchtitan's ep group is the innermost ep devices of (dp_shard, cp, tp) (its sparse
    mesh is dp_replicate x efsdp x ep); on autopp's (dp, tp) stage mesh that is tp
    (ep = tp), dp x tp (ep = dp_shard x tp, dp_replicate 1), or dp (the same with tp 1).
    "auto" for ep 1: the planner chooses where the experts go. Any other degree splits
    one of autopp's mesh dims: refused with the degrees that map."""
    ep, tp = parallel_dims.ep, parallel_dims.tp
    shard, rep = parallel_dims.dp_shard, parallel_dims.dp_replicate
    if ep <= 1:
        return "auto"
    if ep == tp:
        return "tp"
    if rep == 1 and ep == shard * tp:
        return "dp" if tp == 1 else "dp*tp"
    fits = sorted(({tp} | ({shard * tp} if rep == 1 else set())) - {1})
    raise ValueError(
        f"expert parallelism of degree {ep} (expert_parallel_degree) on dp_replicate={rep} x "
        f"dp_shard={shard} x tp={tp}: autopp splits experts over whole (dp, tp) mesh dims; "
        f"set expert_parallel_degree to {' or '.join(map(str, fits)) or 'nothing above 1'}"
        ", or 1 to let autopp's planner place the experts")


def _check_supported(parallel_dims, training) -> None:
    problems = []
    if parallel_dims.cp > 1:
        problems.append("context parallelism (context_parallel_degree > 1)")
    try:
        expert_dims_of(parallel_dims)
    except ValueError as e:
        problems.append(str(e))
    batch = parallel_dims.dp_replicate * parallel_dims.dp_shard
    if training.global_batch_size > 0 and training.global_batch_size != training.local_batch_size * batch:
        problems.append("gradient accumulation (global_batch_size != local_batch_size x dp): "
                        "autopp normalises the loss over one step's global batch")
    if problems:
        raise ValueError("autopp's pipeline does not support " + "; ".join(problems))


def pipeline_autopp(
    model: nn.Module, *, parallel_dims, training, parallelism, compile_config, ac_config,
    dump_folder: str, device: torch.device, model_config, parallelize_fn, loss_fn,
    options: AutoppOptions | None = None,
) -> tuple[AutoppSchedule, list[nn.Module], bool, bool]:
    """torchtitan ``pipelining_fn`` running the model as an autopp pipeline (module doc)."""
    del dump_folder, parallelize_fn
    from autopp.api import pipeline_autoparallel
    from autopp.mesh import build_world_mesh
    from autopp.stage_split.for_schedule import split_for_schedule
    from autopp.backends import Planner, PlannerOptions, Replicate
    from autopp.tied import find_tied
    from torchtitan.tools.logging import logger

    options = options or AutoppOptions()
    _check_supported(parallel_dims, training)
    dp = parallel_dims.dp_replicate * parallel_dims.dp_shard
    mesh = build_world_mesh(pp=parallel_dims.pp, dp=dp, tp=parallel_dims.tp,
                                   device_type=device.type)
    _check_same_ranks(mesh, parallel_dims)

    split: Any
    if options.split is not None:
        split = int(options.split) if options.split.isdigit() else options.split
    else:
        split = _compat.torchtitan_stage_fqns(parallel_dims, parallelism, model_config)
    schedule = parallelism.pipeline_parallel_schedule_csv or parallelism.pipeline_parallel_schedule
    n_microbatches = training.local_batch_size // parallelism.pipeline_parallel_microbatch_size
    tokens = torch.zeros(training.local_batch_size, training.seq_len, dtype=torch.long)
    # torchtitan's dataloader positions (``--autopp.per_document_positions``): every stage
    # takes them (planned stages as graph inputs, placed like the tokens)
    example_kwargs = ({"positions": torch.zeros_like(tokens)}
                      if options.per_document_positions else None)
    _, fqns_per_stage = split_for_schedule(
        model, schedule=schedule, split=split, pp=parallel_dims.pp,
        n_microbatches=n_microbatches, local_batch_size=training.local_batch_size)
    if find_tied(model, fqns_per_stage, None):
        raise ValueError("parameters tied across stages: torchtitan's gradient clipping would "
                         "count them twice; not supported through torchtitan's Trainer yet")

    if options.parallelize == "auto":
        mp = None
        if training.mixed_precision_param == "bfloat16":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                      reduce_dtype=torch.float32)
        backend = Planner(PlannerOptions(
            profile=options.profile or ("CPU" if device.type == "cpu" else "H100"),
            memory_budget_bytes=(None if options.memory_budget_gib is None
                                 else options.memory_budget_gib * 2**30),
            boundary=options.boundary,
            loss_parallel={"auto": None, "on": True, "off": False}[options.loss_parallel],
            mixed_precision=mp, recompute=_recompute(ac_config),
            # torchtitan's expert parallelism: the experts over its ep group, tokens sent to
            # them by all-to-all (ep 1: the planner chooses)
            expert_dims=expert_dims_of(parallel_dims),
            token_dispatch=("all_to_all" if parallel_dims.ep > 1
                            else tracing.setting("token_dispatch"))),
            compile=bool(compile_config.enable and "model" in compile_config.components))
    else:
        backend = Replicate()

    pipe = pipeline_autoparallel(
        model, mesh, example_inputs=(tokens,), example_kwargs=example_kwargs,
        loss_fn=_loss_for_autopp(loss_fn),
        schedule=schedule, n_microbatches=n_microbatches, split=split, parallelize=backend,
    )
    pipe.init_weights(seed=options.seed)
    logger.info("autopp plan:\n%s", pipe.describe())
    plan = _estimated_plan(backend, model, mesh, options, logger)
    part = AutoppModelPart(pipe, model)
    return (AutoppSchedule(pipe, dp_size=dp, plan=plan, keyword_inputs=list(example_kwargs or ())),
            [part], True, True)


def _estimated_plan(backend, model: nn.Module, mesh, options: AutoppOptions, logger):
    """The planner's whole-pipeline plan with the simulator's estimates (computed on rank 0,
    broadcast), logged; the plan without them when they are off or fail; None without a
    plan (``--autopp.parallelize replicate``)."""
    from autopp.estimate.pipeline import estimate_plan
    from autopp.integrations.torchtitan.estimates import estimates_on_rank0, startup_summary
    from autopp.mesh import stage_sub_mesh

    plan = getattr(backend, "pipeline_plan", None)
    if plan is None or options.estimate == "off":
        return plan
    estimates, why = estimates_on_rank0(lambda: estimate_plan(
        plan, model, stage_sub_mesh(mesh), mode=options.estimate).estimates)
    if estimates is None:
        logger.warning("autopp: no simulated estimates for the plan (%s)", why)
        return plan
    plan = dataclasses.replace(plan, estimates=estimates)
    logger.info("autopp pipeline plan (%s plan, estimates simulated with profile %s):\n%s",
                getattr(backend, "plan_source", "") or "given", plan.options.profile,
                plan.describe())
    logger.info(startup_summary(plan, mesh.get_coordinate()[0]))
    return plan


def _check_same_ranks(mesh, parallel_dims) -> None:
    """autopp's (pp, dp, tp) coordinates of this rank equal torchtitan's (pp, batch, tp), so
    each rank trains on the batch torchtitan's dataloader gives it."""
    pp_rank, dp_rank, tp_rank = mesh.get_coordinate()
    theirs = []
    for name in ("pp", "batch", "tp"):
        sub = parallel_dims.get_optional_mesh(name)
        theirs.append(sub.get_local_rank() if sub is not None else 0)
    if tuple(theirs) != (pp_rank, dp_rank, tp_rank):
        raise RuntimeError(f"autopp's mesh coordinates {(pp_rank, dp_rank, tp_rank)} differ from "
                           f"torchtitan's (pp, batch, tp) {tuple(theirs)}")
