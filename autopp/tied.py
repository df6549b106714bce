"""Parameters tied across pipeline stages (a tied input embedding and output head).

A parameter held by modules of several stages gets one copy per stage, as Megatron does for
tied embeddings, and :class:`TiedSync` keeps the copies one parameter. Values: after init
every copy takes the value the whole model's last initialiser leaves, broadcast between the
copies' ranks. Gradients: after each step the copies' gradients are all-reduced shard by
shard (so copies must share placements) in a group per (dp, tp) coordinate of the copies' pp
ranks; identical optimizer steps then keep them equal. Norm: clipping counts the copy under
the first FQN and scales the others alike. Names: every copy is named by the first FQN, so a
checkpoint holds it once and loads into any layout. A rank holding two copies (a V placement)
keeps the second as a *mirror*, outside the state dict, optimizer and norm, refreshed from
the primary before each step."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TiedParameter", "TiedSync", "find_tied", "placement_conflicts"]


@dataclass(frozen=True, slots=True)
class TiedParameter:
    """One parameter that several stages hold."""

    fqns: tuple[str, ...]
    """All its FQNs in the whole model, in model order; ``fqns[0]`` names it in checkpoints."""
    stage_fqns: tuple[tuple[int, str], ...]
    """(stage id, the FQN that stage holds it under), in stage order."""
    init_stage: int
    """The stage whose copy's initial value every copy takes (holds ``fqns[-1]``)."""

    @property
    def name(self) -> str:
        return self.fqns[0]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.stage_fqns)


def find_tied(model: nn.Module, fqns_per_stage: Sequence[Sequence[str]],
              layers_attr: str | None = None) -> list[TiedParameter]:
    """The parameters of ``model`` (meta is fine) held by more than one stage of the split
    (``layers_attr``: as for :func:`autopp.stage_split.inspect_model`)."""
    from autopp.stage_split.layout import inspect_model, unit_of

    layout = inspect_model(model, layers_attr)
    stage_of = {fqn: s for s, fqns in enumerate(fqns_per_stage) for fqn in fqns}
    groups: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(fqn)
    out = []
    for fqns in groups.values():
        if len(fqns) < 2:
            continue
        held: dict[int, str] = {}
        for fqn in fqns:
            held.setdefault(stage_of[unit_of(fqn, layout)], fqn)
        if len(held) < 2:
            continue
        init = stage_of[unit_of(fqns[-1], layout)]
        out.append(TiedParameter(tuple(fqns), tuple(sorted(held.items())), init))
    return out


class TiedSync:
    """Keeps the copies of tied parameters equal on this rank's stages (see the module doc).

    Args:
        tied: the pipeline's tied parameters (:func:`find_tied`).
        mesh: the world mesh ("pp", "dp", "tp").
        rank_of: the pp rank of each stage.
        stage_ids: the stages this rank holds.

    Every rank must create it (process groups are made collectively), before
    :meth:`bind` gives it this rank's stage parameters.
    """

    def __init__(self, tied: Sequence[TiedParameter], mesh, rank_of: Sequence[int],
                 stage_ids: Sequence[int]) -> None:
        self.tied = list(tied)
        self._stage_ids = set(stage_ids)
        self._groups: dict[int, tuple[object, int] | None] = {}
        ranks = mesh.mesh  # pp x dp x tp tensor of global ranks
        me = dist.get_rank() if dist.is_initialized() else 0
        for i, t in enumerate(self.tied):
            pps = sorted({rank_of[s] for s in t.stages})
            src_pp = rank_of[t.init_stage]
            self._groups[i] = None
            if len(pps) < 2:
                continue
            for d, k in itertools.product(range(ranks.shape[1]), range(ranks.shape[2])):
                members = [int(ranks[r, d, k]) for r in pps]
                group = dist.new_group(members)
                if me in members:
                    self._groups[i] = (group, int(ranks[src_pp, d, k]))
        self._copies: dict[int, list[tuple[int, nn.Parameter]]] = {}

    def _held(self, t: TiedParameter) -> tuple[str | None, list[str]]:
        """This rank's copies of ``t``: the primary's FQN (the copy under the parameter's
        first FQN if this rank holds it, else its first local copy; None: no copy here) and
        the others' (mirrors: a V placement puts the first and last stages on one rank)."""
        held = [fqn for s, fqn in t.stage_fqns if s in self._stage_ids]
        if not held:
            return None, []
        primary = t.name if t.name in held else held[0]
        return primary, [f for f in held if f != primary]

    @property
    def aliases(self) -> dict[str, str]:
        """{FQN a local stage holds a copy under: the parameter's first FQN} (renames), for
        the primary copy on ranks that do not hold the copy named by the first FQN."""
        out = {}
        for t in self.tied:
            primary, _ = self._held(t)
            if primary is not None and primary != t.name:
                out[primary] = t.name
        return out

    @property
    def mirrors(self) -> dict[str, str]:
        """{FQN of a mirror: its primary's FQN} on this rank. A mirror is a second copy on
        the same rank: it is in no state dict, no optimizer and no norm (the primary stands
        for the parameter, so a checkpoint holds one key in every placement), gets the
        summed gradient like every copy, and takes the primary's value before each step
        (:meth:`refresh_mirrors`)."""
        out = {}
        for t in self.tied:
            primary, others = self._held(t)
            out.update({f: primary for f in others})
        return out

    def mirror_params(self) -> list[nn.Parameter]:
        """Every mirror parameter of this rank (after :meth:`bind`)."""
        out = []
        for i, t in enumerate(self.tied):
            _, others = self._held(t)
            held = dict(t.stage_fqns)
            out += [p for s, p in self._copies.get(i, []) if held[s] in others]
        return out

    @torch.no_grad()
    def refresh_mirrors(self) -> None:
        """Every mirror takes its primary's current value (after an optimizer step or a
        load, which update the primary only); local copies, no communication."""
        for i, t in enumerate(self.tied):
            primary, others = self._held(t)
            if not others:
                continue
            held = dict(t.stage_fqns)
            copies = {held[s]: p for s, p in self._copies.get(i, [])}
            for f in others:
                self._local_tensor(copies[f]).copy_(self._local_tensor(copies[primary]))

    def rename_state_dict(self, module: nn.Module) -> None:
        """Make ``module`` (this rank's merged stages) save its tied copies once, under
        their first FQN, and load them from it (state-dict hooks): a primary is renamed, a
        mirror left out on save and filled from its primary's value on load."""
        aliases, mirrors = self.aliases, self.mirrors
        if not aliases and not mirrors:
            return

        def save_hook(mod, state_dict, prefix, local_metadata):
            for own in mirrors:
                state_dict.pop(prefix + own, None)
            for own, name in aliases.items():
                if prefix + own in state_dict:
                    state_dict[prefix + name] = state_dict.pop(prefix + own)
            return state_dict

        def load_hook(state_dict, prefix, *args):
            for own, name in aliases.items():
                if prefix + name in state_dict:
                    state_dict[prefix + own] = state_dict.pop(prefix + name)
            for own, primary in mirrors.items():
                if prefix + primary in state_dict and prefix + own not in state_dict:
                    state_dict[prefix + own] = state_dict[prefix + primary]

        module._register_state_dict_hook(save_hook)
        module._register_load_state_dict_pre_hook(load_hook)

    def bind(self, named_by_stage: dict[int, dict[str, nn.Parameter]]) -> None:
        """This rank's copies: ``named_by_stage[stage id][stage FQN] = parameter``."""
        self._copies = {}
        for i, t in enumerate(self.tied):
            copies = [(s, named_by_stage[s][fqn]) for s, fqn in t.stage_fqns
                      if s in self._stage_ids]
            for s, p in copies:
                if p is None:
                    raise ValueError(f"stage {s} holds no parameter for tied {t.fqns}")
            self._copies[i] = copies
            if len(copies) > 1:
                pls = {str(getattr(p, "placements", None)) for _, p in copies}
                if len(pls) > 1:
                    raise ValueError(f"tied parameter {t.name}: local copies placed as {pls}")

    def check_placements(self) -> None:
        """Raise ValueError on every rank when copies of a tied parameter are placed
        differently on different ranks (a user ``parallelize`` or AutoParallel that sharded
        the embedding one way and the head another): their gradients are summed shard by
        shard, which is only right for equal placements. Collective over the world (after
        :meth:`bind`); the planner fixes tied copies to one placement, so it never fails
        there."""
        mine = {t.name: str(tuple(getattr(p, "placements", ()) or ()))
                for i, t in enumerate(self.tied) for _, p in self._copies.get(i, [])[:1]}
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        if problems := placement_conflicts(gathered):
            raise ValueError("parameters tied across stages must be placed alike on every "
                             "rank (their gradients are summed shard by shard): "
                             + "; ".join(problems) + ". Give the copies one placement in "
                             "your parallelize (or let the planner place them)")

    @staticmethod
    def _local_tensor(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    @torch.no_grad()
    def sync_values(self) -> None:
        """Every copy takes the initial value of the copy on :attr:`TiedParameter.init_stage`."""
        for i, t in enumerate(self.tied):
            copies = self._copies.get(i, [])
            if not copies:
                continue
            src = next((p for s, p in copies if s == t.init_stage), None)
            if self._groups[i] is not None:
                group, src_rank = self._groups[i]
                buf = self._local_tensor(src if src is not None else copies[0][1])
                dist.broadcast(buf, src=src_rank, group=group)
                src = src if src is not None else copies[0][1]
            for _, p in copies:
                if p is not src:
                    self._local_tensor(p).copy_(self._local_tensor(src))

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum the copies' gradients (local shards) so that every copy holds the total."""
        for i, _ in enumerate(self.tied):
            copies = self._copies.get(i, [])
            if not copies:
                continue
            grads = [p.grad for _, p in copies]
            if any(g is None for g in grads):
                raise RuntimeError(f"tied parameter {self.tied[i].name} has no gradient on a "
                                   "stage that uses it; run step() before syncing")
            total = self._local_tensor(grads[0])
            for g in grads[1:]:
                total.add_(self._local_tensor(g))
            if self._groups[i] is not None:
                dist.all_reduce(total, group=self._groups[i][0])
            for g in grads[1:]:
                self._local_tensor(g).copy_(total)

    def norm_duplicates(self) -> set[int]:
        """``id`` of every local copy that a global gradient norm must not count again (all
        but the copy on the stage holding the parameter's first FQN)."""
        out = set()
        for i, t in enumerate(self.tied):
            held = dict(t.stage_fqns)
            out |= {id(p) for s, p in self._copies.get(i, []) if held[s] != t.name}
        return out


def placement_conflicts(per_rank: Sequence[dict[str, str]]) -> list[str]:
    """From each rank's {tied parameter: placements of its copy there} (by rank), one line
    per parameter whose copies' placements differ: "tok_embeddings.weight: (Shard(dim=0),)
    on ranks [0, 1], (Shard(dim=1),) on ranks [2, 3]"."""
    by_name: dict[str, dict[str, list[int]]] = {}
    for rank, mine in enumerate(per_rank):
        for name, pl in mine.items():
            by_name.setdefault(name, {}).setdefault(pl, []).append(rank)
    return [f"{name}: " + ", ".join(f"{pl} on ranks {ranks}" for pl, ranks in pls.items())
            for name, pls in sorted(by_name.items()) if len(pls) > 1]
