"""Stages that plan alike, planned once: a pipeline's stages grouped into classes of the same
units (by :func:`~autopp.tracing.units.unit_signature`, names aside), inputs, boundaries
and memory accounting, each class planned once and its plan given to the other members under
their own names (:func:`renamed`).

Budget classes: a stage whose time-optimal plan fits its budget plans it whatever it keeps in
flight; otherwise, where a backward is whole, the microbatches in flight are put in classes
of ratio :data:`IN_FLIGHT_RATIO` (a pipeline's stages each keep a few fewer than the one
before). A class is planned with its members' most in flight and least budget, so its plan
fits every member (it may be a little slower than a member's own).
The schedule's windows for once-per-step collectives do not split classes: a class is planned
with its members' smallest and each member's hidden time is recomputed with its own
(:func:`with_windows`). Invariant: a member's plan is the class's plan, renamed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopp.sharding import StagePlan, StageRequest

IN_FLIGHT_RATIO = 2 ** 0.5
"""Microbatches in flight within this ratio of each other may share a plan (classes are the
intervals (r^(k-1), r^k])."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageClass:
    """Stages planned by one plan; the first is planned, the others reuse it."""

    stages: tuple[int, ...]
    activation_factor: float | None
    """The members' most microbatches in flight (None: activations not counted)."""
    budget_bytes: float | None
    """The members' least budget (None: none)."""
    windows: tuple[float, float]
    """The members' smallest windows for once-per-step collectives, by kind."""


def in_flight_class(request: StageRequest, ratio: float | None = IN_FLIGHT_RATIO) -> Any:
    """The budget class of ``request``'s microbatches in flight: an interval index of
    ``ratio`` where they may be rounded up (whole backward), else the value itself."""
    m = request.memory
    f = m.activation_factor
    if ratio is None or f is None or m.split_in_flight or f <= 0:
        return ("exact", f, m.budget_bytes)
    return ("ratio", math.ceil(math.log(f) / math.log(ratio) - 1e-9))


def class_key(request: StageRequest, structure: tuple | None, free: bool = False,
              ratio: float | None = IN_FLIGHT_RATIO) -> tuple | None:
    """What must be equal for two stages to share a plan (None: planned alone): the units'
    structure (``structure``, from :func:`unit_structure`), the inputs, boundaries, fixed
    placements, everything the request says but names, budget, in flight and windows.
    ``free``: the stage's time-optimal plan fits its budget, so its plan is that one
    whatever it keeps in flight (one class for all such alike stages). ``ratio``: of the
    budget classes (None: only equal in flight and budgets share)."""
    if structure is None or request.param_placements:
        return None
    r = request
    memory = tuple((k, v) for k, v in dataclasses.asdict(r.memory).items()
                   if k not in ("budget_bytes", "activation_factor"))
    inputs = tuple((tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else repr(x)
                   for x in r.example_inputs)
    kw = tuple((k, tuple(v.shape), str(v.dtype)) for k, v in r.keyword_inputs.items())
    return (structure, inputs, repr(r.input_placements), repr(r.output_placements), memory,
            ("free", None if ratio else r.memory.budget_bytes) if free
            else in_flight_class(r, ratio), repr(r.mixed_precision), r.tf32, kw,
            r.microbatches_per_grad_reduce, r.time_limit_s, r.optimality_gap, r.reuse_blocks,
            tuple(r.mesh.shape), id(r.profile))


def unit_structure(units: Sequence[Any] | None) -> tuple | None:
    """A stage's units by signature and kind (pre, block, post), not by name; None for a
    stage planned flat."""
    from autopp.tracing.units import POST, PRE, unit_signature

    if units is None:
        return None
    return tuple((u.name if u.name in (PRE, POST) else "block", unit_signature(u))
                 for u in units)


def group(keys: Sequence[tuple | None], requests: Sequence[StageRequest]) -> list[StageClass]:
    """The stages' classes, in order of their first member (that stage is planned)."""
    by_key: dict[tuple, list[int]] = {}
    classes: list[list[int]] = []
    for s, key in enumerate(keys):
        if key is None:
            classes.append([s])
        elif key in by_key:
            by_key[key].append(s)
        else:
            by_key[key] = [s]
            classes.append(by_key[key])
    out = []
    for members in classes:
        mems = [requests[s].memory for s in members]
        factors = [m.activation_factor for m in mems]
        budgets = [m.budget_bytes for m in mems]
        wins = [requests[s].comm_windows_s for s in members]
        out.append(StageClass(
            stages=tuple(members),
            activation_factor=None if factors[0] is None else max(factors),
            budget_bytes=None if budgets[0] is None else min(budgets),
            windows=(min(w[0] for w in wins), min(w[1] for w in wins))))
    return out


def class_request(request: StageRequest, c: StageClass) -> StageRequest:
    """The representative's request as its class plans it."""
    if len(c.stages) == 1:
        return request
    return request.replace(budget_bytes=c.budget_bytes, activation_factor=c.activation_factor,
                           comm_windows_s=c.windows)


def name_map(rep_units: Sequence[Any], units: Sequence[Any]) -> tuple[dict, dict]:
    """({unit name in the planned stage: in the member}, {parameter or buffer FQN: the
    member's}), position by position (the classes' units are alike)."""
    prefixes, fqns = {}, {}
    for a, b in zip(rep_units, units, strict=True):
        prefixes[a.name] = b.name
        names = [n for n, _ in a.module.named_parameters()] + [
            n for n, _ in a.module.named_buffers()]
        for n in names:
            fqns[a.stage_fqn(n)] = b.stage_fqn(n)
    return prefixes, fqns


def renamed(plan: StagePlan, prefixes: Mapping[str, str], fqns: Mapping[str, str],
            note: str) -> StagePlan:
    """``plan`` with its units and parameters under a member's names, ``note`` added."""
    if all(a == b for a, b in prefixes.items()) and all(a == b for a, b in fqns.items()):
        return dataclasses.replace(plan, notes=(*plan.notes, note))
    pattern = re.compile(r"\((" + "|".join(re.escape(p) for p in prefixes if p) + r")\)") \
        if any(prefixes) else None

    def in_note(text: str) -> str:
        return text if pattern is None else pattern.sub(
            lambda m: f"({prefixes[m.group(1)]})", text)

    return dataclasses.replace(
        plan,
        params=tuple(dataclasses.replace(p, fqn=fqns.get(p.fqn, p.fqn)) for p in plan.params),
        blocks=tuple(dataclasses.replace(b, prefix=prefixes.get(b.prefix, b.prefix))
                     for b in plan.blocks),
        collectives=tuple(dataclasses.replace(
            c, block=prefixes.get(c.block, c.block), node=fqns.get(c.node, c.node),
            producer=fqns.get(c.producer, c.producer)) for c in plan.collectives),
        notes=(*(in_note(n) for n in plan.notes), note))


def with_windows(plan: StagePlan, windows: tuple[float, float], n_microbatches: int
                 ) -> StagePlan:
    """``plan`` with a member's own windows and what they hide of its once-per-step
    collectives (as :func:`autopp.sharding.chain.once_per_step.hidden_s` counts it, a step)."""
    if tuple(plan.comm_windows_s) == tuple(windows):
        return plan
    hidden = 0.0
    if plan.weight_gathering != "per_block":
        hidden = sum(min(c * n_microbatches, max(0.0, w))
                     for c, w in zip(plan.once_per_step_s(), windows))
    return dataclasses.replace(plan, comm_windows_s=tuple(windows), hidden_comm_s=hidden)
