"""The pipeline object: this rank's stages, their schedule, and the training-step API.

Built by :func:`autopp.pipeline_autoparallel`; see its docstring for the arguments. A
``Pipeline`` holds the rank's stage modules (each a pruned copy of the whole model, so its
parameter names are whole-model FQNs), the torch schedule that runs them, and the data-parallel
bookkeeping: exact loss normalisation over microbatches and dp ranks (:mod:`autopp.loss`),
gradient averaging over dp for replicated stages, and global-norm clipping across all stages.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopp.backends import StageBackend
from autopp.format import compact_modules
from autopp.loss import TokenWeightedLoss, count_tokens
from autopp.stage_split import merge_stage_modules
from autopp.stage_split.build import is_model_input, model_input_keywords
from autopp.stage_split.merge import replay_state_dict_hooks

if TYPE_CHECKING:
    from autopp.tied import TiedParameter

@dataclass(frozen=True, slots=True)
class PipelineLayout:
    """Where the model's pieces live.

    Attributes:
        schedule: the schedule's name (or CSV path).
        n_stages: number of pipeline stages of the whole model.
        n_microbatches: microbatches per step.
        fqns_per_stage: the module FQNs of each stage, in stage order.
        stage_ids: the stages this rank holds.
        pp_rank, pp_size, dp_rank, dp_size, tp_rank, tp_size: this rank's mesh coordinates.
        model_notes: what model adapters changed on the model before it was split (e.g. a
            transformers model's attention implementation), one line each.
    """

    schedule: str
    n_stages: int
    n_microbatches: int
    fqns_per_stage: tuple[tuple[str, ...], ...]
    stage_ids: tuple[int, ...]
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    model_notes: tuple[str, ...] = ()

    def describe(self) -> str:
        lines = [
            f"autopp pipeline: {self.n_stages} stages over pp={self.pp_size} × "
            f"dp={self.dp_size} × tp={self.tp_size}, schedule {self.schedule}, "
            f"{self.n_microbatches} microbatches"
        ]
        for s, fqns in enumerate(self.fqns_per_stage):
            mine = " (this rank)" if s in self.stage_ids else ""
            lines.append(f"  stage {s}{mine}: {compact_modules(fqns)}")
        lines += [f"  model: {note}" for note in self.model_notes]
        return "\n".join(lines)


def _by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by their DTensor mesh (plain tensors together), in first-seen
    order (the same on every rank of a stage): DTensor's ops take one mesh at a time."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def _with_persistence(named: list[tuple[str, torch.Tensor]], modules: list[nn.Module]
                      ) -> list[tuple[str, torch.Tensor, bool]]:
    """(FQN, buffer, persistent) for ``named`` buffers, persistence as the stage modules as
    built declare it (a non-persistent buffer, e.g. a RoPE cache, stays out of state dicts)."""
    transient = {f"{p}.{b}" if p else b for m in modules for p, mod in m.named_modules()
                 for b in mod._non_persistent_buffers_set}
    return [(fqn, b, fqn not in transient) for fqn, b in named]


class Pipeline:
    """This rank's part of a pipelined model. Created by :func:`autopp.pipeline_autoparallel`.

    Lifecycle: ``init_weights()`` materialises and initialises the local stages (and builds the
    schedule); then ``step()`` / ``eval()`` / ``parameters()`` / ``state_dict()`` work.
    """

    def __init__(
        self,
        *,
        layout: PipelineLayout,
        stage_modules: list[nn.Module],
        mesh: DeviceMesh,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        ignore_index: int,
        backend: StageBackend,
        input_shapes: tuple[tuple[int, ...], ...] | None = None,
        raise_on_nonfinite: bool = True,
        tied: Sequence[TiedParameter] = (),
        rank_of: Sequence[int] | None = None,
        keyword_inputs: tuple[tuple[str, tuple[int, ...], str], ...] = (),
    ) -> None:
        self.layout = layout
        self.mesh = mesh
        #: How the stages are parallelized (see :mod:`autopp.backends`).
        self.backend = backend
        self.stage_modules = stage_modules
        #: This rank's stages as one module with whole-model parameter names (a view, no
        #: copies): what optimizers, state dicts and checkpoints see.
        self.local_model = merge_stage_modules(stage_modules)
        self._structure = list(stage_modules)
        self._device = torch.device(mesh.device_type)
        if mesh.device_type == "cuda":
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._ignore_index = ignore_index
        # Gradients summed over dp (DTensor semantics) need no dp factor in the loss; the
        # FSDP/DDP convention averages them, which the loss makes up for.
        grad_scale = 1.0 if backend.grads_summed_over_dp else float(layout.dp_size)
        self._loss = TokenWeightedLoss(
            loss_fn=loss_fn, ignore_index=ignore_index, grad_scale=grad_scale
        )
        self._loss.vocab_parallel_mesh = backend.vocab_parallel_mesh(mesh)
        self._schedule = None
        #: With graph stages: autopp.graph's runtime driving the schedule's actions.
        self._runtime = None
        self._stages: list = []
        self._all_fqns = {f for stage in layout.fqns_per_stage for f in stage}
        self._input_shapes = input_shapes
        #: (name, shape, dtype) of the keyword inputs the pipeline was built for
        #: (``example_kwargs``): what planned stages take with every step. With the model's
        #: inputs among them (``autopp_input_0``, ...: a forward that reads its input, see
        #: :mod:`autopp.stage_split.model_inputs`), every step hands its inputs to every stage.
        self._keyword_inputs = tuple(keyword_inputs)
        self._inputs_to_every_stage = any(is_model_input(n) for n, _, _ in keyword_inputs)
        #: A non-finite loss or gradient norm raises FloatingPointError (True, the default)
        #: or warns (False).
        self.raise_on_nonfinite = raise_on_nonfinite
        #: Parameters tied across stages, kept equal (see :mod:`autopp.tied`); None if none.
        self._tied = None
        if tied:
            from autopp.tied import TiedSync

            if rank_of is None:
                raise ValueError("tied parameters need rank_of (each stage's pp rank)")
            self._tied = TiedSync(tied, mesh, rank_of, layout.stage_ids)

    # ----------------------------------------------------------------- properties
    @property
    def dp_rank(self) -> int:
        """This rank's index along dp: which slice of the global batch it feeds."""
        return self.layout.dp_rank

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.layout.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.layout.n_stages - 1 in self.layout.stage_ids

    def describe(self) -> str:
        """A printable summary: stages, their modules, which this rank holds, and with
        parallelize="auto" the head of each local stage's plan report."""
        out = [self.layout.describe()]
        built = dict(zip(self.layout.stage_ids, self.stage_modules))
        for sid in self.layout.stage_ids:
            out += self.backend.describe(sid, built.get(sid))
        return "\n".join(out)

    # ----------------------------------------------------------------- weights
    def init_weights(self, seed: int = 0) -> None:
        """Materialise this rank's stages on the mesh's device and initialise them.

        Every parameter gets the value it would have in the whole single-process model
        initialised with :func:`autopp.init.init_module_` and the same ``seed``, whatever
        the split and the placements.
        """
        sub_mesh = self.mesh["dp", "tp"]
        built = list(self.stage_modules)  # as built (the model's own modules and hooks)
        self.stage_modules = [
            self.backend.materialize(sid, m, sub_mesh, seed=seed, device=self._device)
            for sid, m in zip(self.layout.stage_ids, self.stage_modules)
        ]
        named = self.backend.named_parameters(self.stage_modules)
        if self._tied is not None:
            self._bind_tied()
        if named is None:
            self.local_model = merge_stage_modules(self.stage_modules)
            if self._tied is not None:
                self._tied.rename_state_dict(self.local_model)
        else:
            from autopp.lower.stage import fqn_view

            aliases = self._tied.aliases if self._tied is not None else {}
            mirrors = self._tied.mirrors if self._tied is not None else {}
            # a tied copy goes by the parameter's first FQN, once; a second copy on this
            # rank (a mirror) is left out of the rank's module (see autopp.tied)
            renamed = [(aliases.get(fqn, fqn), p) for fqn, p in named if fqn not in mirrors]
            self.local_model = fqn_view(renamed, _with_persistence(
                self.backend.named_buffers(self.stage_modules) or [], built))
            replay_state_dict_hooks(self.local_model, built)
        self._structure = built  # the stage modules as built: names and the model's config
        self._build_schedule()

    def _bind_tied(self) -> None:
        """Hand the tied-parameter copies of this rank's stages to the sync and give them one
        initial value (see :mod:`autopp.tied`)."""
        by_stage = {}
        for sid, m in zip(self.layout.stage_ids, self.stage_modules):
            named = self.backend.named_parameters([m])
            by_stage[sid] = dict(named if named is not None else m.named_parameters())
        self._tied.bind(by_stage)
        self._tied.check_placements()  # every rank: a mismatch raises everywhere
        self._tied.sync_values()

    @property
    def action_counts(self) -> dict[str, int]:
        """Planned stages: the schedule actions this rank's graph runtime has run since
        ``init_weights``, by kind ("F", "B", "I", "W", "UNSHARD", "RESHARD", "REDUCE_GRAD",
        "OVERLAP_F_B"; "W" counts deferred weight-gradient graphs). Empty otherwise."""
        return dict(self._runtime.action_counts) if self._runtime is not None else {}

    @property
    def action_log(self) -> list[tuple[str, int, int | None]]:
        """Planned stages: the last schedule actions this rank ran, in order, as (kind,
        stage index, microbatch index or None); kinds as in :attr:`action_counts`, and
        ("UNSHARD wait", stage, None) where the runtime waited for the gathers a stage's
        UNSHARD left in flight (just before that stage's next action), ("REDUCE_GRAD
        wait", stage, None) where it waited for the reductions of its REDUCE_GRAD (when
        the step accumulates the gradients)."""
        return list(self._runtime.action_log) if self._runtime is not None else []

    def count_collectives(self):
        """Planned stages: from now on count the collectives each schedule action runs, and
        whether they read parameters (see :class:`autopp.graph.comm_counter.CollectiveCounter`,
        e.g. ``counter.summary()`` after a step). A diagnostic: it slows steps down."""
        self._require_built()
        if self._runtime is None:
            raise ValueError("count_collectives needs planned stages (parallelize='auto')")
        return self._runtime.count_collectives()

    @property
    def plans(self) -> dict:
        """With the planner: {stage id: StagePlan} of this rank's stages."""
        return self.backend.plans

    def _build_schedule(self) -> None:
        pp_group = self.mesh["pp"].get_group()
        self._stages = [
            self.backend.pipeline_stage(
                sid, m, n_stages=self.layout.n_stages, device=self._device, pp_group=pp_group,
                loss_fn=self._loss, get_mesh=self._get_mesh)
            for m, sid in zip(self.stage_modules, self.layout.stage_ids)
        ]
        self._schedule, self._runtime = self.backend.build_schedule(
            self.layout.schedule, self._stages, n_microbatches=self.layout.n_microbatches,
            loss_fn=self._loss, scale_grads=False)

    def _get_mesh(self, mesh_dim_names: tuple[str, ...], mesh_layout=None) -> DeviceMesh:
        """Resolve the mesh of a DTensor activation received from another stage (torch sends
        only its dim names): stages exchange DTensors on sub-meshes of the world mesh."""
        return self.mesh[tuple(mesh_dim_names)]

    def _require_built(self) -> None:
        if self._schedule is None:
            raise RuntimeError("call Pipeline.init_weights() before step/eval/state_dict")

    def parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of this rank's stages (pass them to an optimizer); a parameter tied
        across stages once, even where this rank holds two copies."""
        return (p for _, p in self.named_parameters())

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(whole-model FQN, parameter) for this rank's stages; a copy of a parameter tied
        across stages goes by the parameter's first FQN (as in state dicts)."""
        if self._tied is None:
            return self.local_model.named_parameters()
        aliases, mirrors = self._tied.aliases, {id(p) for p in self._tied.mirror_params()}
        return ((aliases.get(n, n), p) for n, p in self.local_model.named_parameters()
                if id(p) not in mirrors)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages' state, keyed by whole-model FQNs (DTensors where sharded)."""
        return self.local_model.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load this rank's stages from a state dict keyed by whole-model FQNs.

        ``state_dict`` may hold the whole model (keys of other ranks' stages are ignored).
        With ``strict``, a key missing for a local stage, or a key that belongs to no
        module of the model, raises ValueError.
        """
        self._require_built()
        own = self.local_model.state_dict()
        if strict:
            unknown = [k for k in state_dict if not self._belongs_to_model(k)]
            if unknown:
                raise ValueError(f"state_dict keys that belong to no stage of the model: {unknown[:5]}")
            missing = [k for k in own if k not in state_dict]
            if missing:
                raise ValueError(f"state_dict is missing keys of this rank's stages: {missing[:5]}")
        self.local_model.load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=False)

    def save_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | None = None, *,
                        force: bool = False) -> None:
        """Save the model (and optimizer) with torch.distributed.checkpoint; collective.

        Keys are whole-model FQNs, so the checkpoint loads into any pp/dp/tp layout and split.
        A non-finite state is refused (ValueError on every rank) unless ``force``. ``path``
        names the previous complete checkpoint until this one is complete (it is written to
        ``<path>.v<N>`` beside it and ``path``, a link, switched to it atomically), so a job
        killed at any point of a save loses nothing (:mod:`autopp.checkpoint`).
        """
        from autopp.checkpoint import save

        self._require_built()
        save(path, self.local_model, optimizer, force=force)

    def load_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint` (any layout); collective. An
        interrupted save is named in a warning; ``path`` incomplete or missing is a one-line
        error on every rank naming the last complete checkpoint."""
        from autopp.checkpoint import load

        self._require_built()
        load(path, self.local_model, optimizer)

    def load_pretrained(self, path: str) -> None:
        """Load a Hugging Face ``save_pretrained`` directory (safetensors, sharded or not)
        into this rank's stages by FQN, any split and layout; collective
        (:mod:`autopp.checkpoint_hf`). Call after :meth:`init_weights`."""
        from autopp.checkpoint_hf import load_pretrained

        self._require_built()
        load_pretrained(path, self.local_model)
        if self._tied is not None:
            self._tied.refresh_mirrors()

    def save_pretrained(self, path: str, config: Any = None) -> None:
        """Write the model as a Hugging Face directory: safetensors of full tensors (every
        rank's shards consolidated) and ``config.save_pretrained(path)`` when ``config`` (a
        transformers config) is given, so ``from_pretrained(path)`` loads it; collective."""
        from autopp.checkpoint_hf import save_pretrained

        self._require_built()
        save_pretrained(path, self.local_model, config)

    def _belongs_to_model(self, key: str) -> bool:
        parts = key.split(".")
        return any(".".join(parts[:i]) in self._all_fqns for i in range(1, len(parts) + 1))

    # ----------------------------------------------------------------- training
    def step(self, *inputs: torch.Tensor, target: torch.Tensor,
             **model_kwargs: torch.Tensor) -> float:
        """One forward+backward over this rank's dp slice of the global batch.

        Args:
            inputs: the model's positional inputs for this dp rank (batch on dim 0; the
                local batch is split into ``n_microbatches`` microbatches).
            target: the matching targets (e.g. next-token labels).
            model_kwargs: keyword inputs of the forward (e.g. ``attention_mask``), batch on
                dim 0, split into the same microbatches and given to every stage (every rank
                passes them); planned stages take exactly those they were built for
                (``pipeline_autoparallel(example_kwargs=...)``; an error names what differs).

        Returns the loss of the whole global batch (mean over its counted tokens, exactly
        as the unpipelined model computes it), on every rank. Gradients are left in the
        parameters' ``.grad``; call the optimizer next.
        """
        from autopp import adapters

        if self._tied is not None:
            self._tied.refresh_mirrors()  # the optimizer (or a load) updated the primary
        loss = self._run(inputs, target, train=True, model_kwargs=model_kwargs)
        # gradient reductions act on every local copy, mirrors included (autopp.tied)
        mirrors = self._tied.mirror_params() if self._tied is not None else []
        self.backend.after_step([*self.parameters(), *mirrors], self.mesh)
        # e.g. MoE load balancing, before the optimizer
        adapters.after_step(self._structure, self.local_model, self._unreduced_stats_group())
        if self._tied is not None:
            self._tied.sync_grads()
        self._check_finite("loss", loss)
        return loss

    def _unreduced_stats_group(self) -> dist.ProcessGroup | None:
        """The group over which statistics the model's own forward keeps (e.g. MoE token
        counts) are partial: dp for stages that run the model's modules on this rank's
        batch slice; None for planned stages, whose graphs reduce them as planned."""
        if self.backend.stats_reduced_over_dp or self.dp_size == 1:
            return None
        return self.mesh["dp"].get_group()

    def _check_finite(self, what: str, value: float) -> None:
        """A non-finite loss or gradient norm (the same value on every rank): warn, or raise
        FloatingPointError on every rank when ``raise_on_nonfinite``."""
        if math.isfinite(value):
            return
        msg = (f"the step's {what} is {value} (non-finite): the model or the data diverged; "
               "lower the learning rate, clip gradients, or check the batch")
        if self.raise_on_nonfinite:
            raise FloatingPointError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)

    @torch.no_grad()
    def eval(self, *inputs: torch.Tensor, target: torch.Tensor,
             **model_kwargs: torch.Tensor) -> float:
        """Forward-only loss of the global batch (no gradients), on every rank. Training
        statistics the forward keeps (e.g. MoE tokens-per-expert counts) are left as they
        were. Arguments as for :meth:`step`."""
        from autopp import adapters

        if self._tied is not None:
            self._tied.refresh_mirrors()
        with adapters.training_state_kept(self._structure, self.local_model):
            return self._run(inputs, target, train=False, model_kwargs=model_kwargs)

    def _check_inputs(self, inputs: tuple[torch.Tensor, ...]) -> None:
        """Inputs shaped as the pipeline was built for (``example_inputs``): stages are
        traced and receive buffers sized for them, so another shape would fail deep in a
        collective. Checked on every rank before any communication."""
        if self._input_shapes is None:
            return
        got = tuple(tuple(x.shape) for x in inputs)
        if got != self._input_shapes:
            raise ValueError(
                f"step/eval got inputs of shapes {list(got)}, but this pipeline was built for "
                f"{list(self._input_shapes)} (its example_inputs: this dp rank's batch x "
                "sequence). Pad or cut the batch to that shape, or build a pipeline for the new "
                "shape with pipeline_autoparallel(example_inputs=...) (plans are cached on disk, "
                "so a shape seen before is not planned again)."
            )

    def _check_model_kwargs(self, inputs: tuple[torch.Tensor, ...],
                            model_kwargs: dict[str, Any]) -> None:
        """Keyword inputs the stages can take: tensors batched like the inputs and, for
        planned stages, the ones they were planned for (graph inputs of their traces)."""
        batch = inputs[0].shape[0] if inputs else None
        for name, value in model_kwargs.items():
            if is_model_input(name):
                raise ValueError(f"keyword input {name!r}: autopp passes the model's "
                                 "positional inputs to its stages by that name; give the "
                                 "model's inputs positionally, and rename this keyword")
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or (
                    batch is not None and value.shape[0] != batch):
                what = (f"a tensor of shape {tuple(value.shape)}"
                        if isinstance(value, torch.Tensor) else type(value).__name__)
                raise ValueError(
                    f"keyword input {name!r} is {what}: keyword inputs are split into "
                    f"microbatches on dim 0 like the inputs, so each must be a tensor whose "
                    f"dim 0 is this dp rank's batch ({batch})")
        if not self.backend.takes_built_keyword_inputs:
            return
        from autopp.sharding.plan import describe_keyword_inputs

        built = [[n, list(shape), d] for n, shape, d in self._keyword_inputs]
        given = {**model_kwargs, **(model_input_keywords(inputs)
                                    if self._inputs_to_every_stage else {})}
        got = [[n, list(shape), d] for n, shape, d in describe_keyword_inputs(
            dict(sorted(given.items())))]
        if sorted(built) != got:
            raise ValueError(
                f"keyword inputs (name, shape, dtype) {got}: this pipeline's planned stages "
                f"(parallelize='auto') were planned for {sorted(built) or 'none'}, and take "
                "exactly those as graph inputs with every step. Pass the same ones (an "
                "all-ones attention_mask masks nothing), or build the pipeline with "
                "pipeline_autoparallel(example_kwargs={...}) naming the ones you pass (plans "
                "are cached on disk by them)")

    def _run(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, *, train: bool,
             model_kwargs: dict[str, Any] | None = None) -> float:
        from autopp.schedules import forward_only

        model_kwargs = model_kwargs or {}
        self._check_inputs(inputs)
        self._check_model_kwargs(inputs, model_kwargs)
        self._require_built()
        inputs = tuple(x.to(self._device) for x in inputs)
        model_kwargs = {k: v.to(self._device) for k, v in model_kwargs.items()}
        if self._inputs_to_every_stage:  # every stage runs the forward on them (see above)
            model_kwargs.update(model_input_keywords(inputs))
        target = target.to(self._device)
        losses: list[torch.Tensor] = []
        if self.has_last_stage:
            n = count_tokens(target, self._ignore_index).to(torch.float64)
            if self.dp_size > 1:
                dist.all_reduce(n, group=self.mesh["dp"].get_group())
            self._loss.global_tokens = n
        args = inputs if self.has_first_stage else ()
        # every stage's forward gets the keyword inputs (torch's schedules split them into
        # microbatches and pass them to each stage, first or not)
        kwargs = {"target": target, "losses": losses} if self.has_last_stage else {}
        kwargs.update(model_kwargs)
        runner = self._runtime if self._runtime is not None else self._schedule
        if train:
            runner.step(*args, **kwargs)
        else:
            with forward_only(self._schedule):
                runner.eval(*args, **kwargs)
        return self._reduce_loss(losses)

    def _reduce_loss(self, losses: list[torch.Tensor]) -> float:
        total = torch.zeros((), dtype=torch.float64, device=self._device)
        if self.has_last_stage:
            total += sum(l.detach().to(torch.float64) for l in losses) / self._loss.grad_scale
        if self.layout.pp_size > 1:
            dist.all_reduce(total, group=self.mesh["pp"].get_group())
        if self.dp_size > 1:
            dist.all_reduce(total, group=self.mesh["dp"].get_group())
        return float(total)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip gradients by the global norm over all stages and shards; returns the norm.

        The norm is accumulated in float64 (each local shard's norm, DTensor's reduction
        over the stage's sub-mesh, the sum over pp ranks): torch's float32 norm of one
        large gradient loses up to ~1e-5 relative (measured: 1.4e-5 on llama3 debugmodel's
        head, 512 x 256 per rank), which the single-process reference's fp64 norm shows."""
        from torch.distributed.tensor import DTensor

        dups = self._tied.norm_duplicates() if self._tied is not None else set()
        params = [p for p in self.parameters() if p.grad is not None and id(p) not in dups]
        norms = [torch.linalg.vector_norm(p.grad, norm_type, dtype=torch.float64)
                 for p in params]
        if norms:
            # one reduction per mesh: a user's parallelize may put parameters on several
            # (e.g. TP + FSDP over (dp, tp) on some, FSDP over dp alone on others), and
            # DTensor stacks only norms of one mesh
            parts = []
            for group_norms in _by_mesh(norms):
                part = torch.linalg.vector_norm(torch.stack(group_norms), norm_type)
                parts.append(part.full_tensor() if isinstance(part, DTensor) else part)
            total = torch.linalg.vector_norm(torch.stack(parts), norm_type)
        else:
            total = torch.zeros((), dtype=torch.float64, device=self._device)
        if self.layout.pp_size > 1:
            group = self.mesh["pp"].get_group()
            if math.isinf(norm_type):
                dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
            else:
                total = total ** norm_type
                dist.all_reduce(total, group=group)
                total = total ** (1.0 / norm_type)
        # tied copies were counted once; every copy is clipped by the same factor
        # (per mesh: torch's foreach scaling takes one mesh at a time)
        for same_mesh in _by_mesh([p for p in self.parameters() if p.grad is not None]):
            torch.nn.utils.clip_grads_with_norm_(same_mesh, max_norm, total.float())
        norm = float(total)
        self._check_finite("gradient norm", norm)
        return norm

    def zero_grad(self) -> None:
        for m in self.stage_modules:
            m.zero_grad(set_to_none=True)
