"""Deterministic, split-independent weight initialisation.

Each parameter is initialised from a stream seeded by ``(seed, whole-model FQN)`` on a
full-size temporary, and this rank's shard is kept. Invariant: the values do not depend on
the split, mesh or placements, so a pipelined, sharded model starts from the single-process
model's weights; that is what lets tests compare against a single-process reference.

Initialisers come from the model: an adapter's registered per-module initialiser
(:func:`register_module_init`, e.g. transformers' ``_init_weights``), torchtitan's
``_param_init`` tables, else ``reset_parameters()``. Buffers are never left as garbage: a
buffer with values keeps them; one on meta is recomputed by its module (torchtitan's
``_init_self_buffers``, ``reset_parameters()``); one nothing writes is an error naming it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn

from autopp._compat.ops import write_token


def _dtensor():
    """DTensor and distribute_tensor, imported on first use (``import autopp`` stays light)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    return DTensor, distribute_tensor


_MODULE_INITS: list[Callable[[nn.Module, nn.Module], Callable[[], None] | None]] = []


def register_module_init(
        fn: Callable[[nn.Module, nn.Module], Callable[[], None] | None]) -> None:
    """Add a model library's per-module initialiser lookup: ``fn(root, module)`` returns a
    callable initialising ``module``'s own parameters and buffers as the model defines it
    (e.g. transformers' ``root._init_weights(module)``), or None. Model adapters register
    (:mod:`autopp.adapters`); registering twice is a no-op."""
    if fn not in _MODULE_INITS:
        _MODULE_INITS.append(fn)


def _model_init(root: nn.Module, module: nn.Module) -> Callable[[], None] | None:
    for fn in _MODULE_INITS:
        init = fn(root, module)
        if init is not None:
            return init
    return None


def fqn_seed(seed: int, fqn: str) -> int:
    """A 63-bit seed derived from the global seed and a parameter/module FQN."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _full_like(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    shape = p.shape  # a DTensor's shape is its global shape
    return torch.empty(shape, dtype=p.dtype, device=device)


@torch.no_grad()
def _assign_full(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full-size value into ``p`` (keeping only this rank's shard if ``p`` is a DTensor)."""
    DTensor, distribute_tensor = _dtensor()
    if isinstance(p, DTensor):
        # src_data_rank=None: every rank holds the same full value, so shard it locally
        # without communication.
        shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(shard.to_local())
    else:
        p.copy_(full)


def _init_by_model(mod: nn.Module, mod_fqn: str, init, seed: int, device: torch.device,
                   lost: set[str]) -> None:
    """Run the model's initialiser ``init`` of ``mod`` under ``mod``'s per-FQN seed on
    full-size temporaries of its own parameters and buffers; keep what it wrote into the
    parameters and the ``lost`` buffers (buffers with values keep theirs). A parameter it did
    not write is an error naming it."""
    own = list(mod.named_parameters(recurse=False))
    buffers = [(n, b) for n, b in mod._buffers.items() if b is not None]
    if not own and not (lost & {n for n, _ in buffers}):
        return
    saved_p = {name: mod._parameters[name] for name, _ in own}
    saved_b = dict(buffers)
    temps: dict[str, torch.Tensor] = {}
    try:
        for name, p in own:
            temps[name] = _full_like(p, device)
            mod._parameters[name] = nn.Parameter(temps[name], requires_grad=False)
        for name, b in buffers:
            mod._buffers[name] = _full_like(b, device) if name in lost else \
                _full_buffer(b, device)
        marks = {name: write_token(t) for name, t in temps.items()}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(fqn_seed(seed, mod_fqn))
            init()
        fulls = {name: mod._parameters[name].detach() for name, _ in own}
        written = {name: mod._buffers[name] for name in lost if name in mod._buffers}
    finally:
        mod._parameters.update(saved_p)
        mod._buffers.update(saved_b)
    unset = [n for n, t in temps.items() if fulls[n] is t and write_token(t) == marks[n]]
    if unset:
        raise ValueError(
            f"the model's initialiser of {mod_fqn or type(mod).__name__} "
            f"({type(mod).__name__}) did not set its parameter(s) {unset}; autopp would leave "
            "uninitialised memory. Initialise them there, or load weights afterwards")
    for name, p in own:
        _assign_full(p, fulls[name])
    for name, value in written.items():
        _assign_full(mod._buffers[name], value.to(device))


def _full_buffer(b: torch.Tensor, device: torch.device) -> torch.Tensor:
    DTensor, _ = _dtensor()
    return (b.full_tensor() if isinstance(b, DTensor) else b).detach().clone().to(device)


def _init_own_params(mod: nn.Module, mod_fqn: str, seed: int, device: torch.device) -> None:
    own = list(mod.named_parameters(recurse=False))
    if not own:
        return
    table = getattr(mod, "_param_init", None)
    if table is not None:
        for name, p in own:
            fqn = f"{mod_fqn}.{name}" if mod_fqn else name
            if name not in table:
                raise ValueError(
                    f"no initialiser for parameter {fqn!r} in {type(mod).__name__}'s param_init"
                )
            full = _full_like(p, device)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(fqn_seed(seed, fqn))
                table[name](full)
            _assign_full(p, full)
        return
    reset = getattr(mod, "reset_parameters", None)
    if not callable(reset):
        raise ValueError(
            f"cannot initialise {mod_fqn or type(mod).__name__}: {type(mod).__name__} has "
            f"parameters {[n for n, _ in own]} but neither a param_init table nor "
            "reset_parameters(); give it one, or load weights with load_state_dict"
        )
    # reset_parameters() initialises the module's own attributes: point them at full-size
    # temporaries for the call, then shard back into the real parameters.
    saved = {name: mod._parameters[name] for name, _ in own}
    try:
        for name, p in own:
            mod._parameters[name] = nn.Parameter(_full_like(p, device), requires_grad=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(fqn_seed(seed, mod_fqn))
            reset()
        fulls = {name: mod._parameters[name].detach() for name, _ in own}
    finally:
        for name, p in saved.items():
            mod._parameters[name] = p
    for name, p in own:
        _assign_full(p, fulls[name])


def _init_own_buffers(mod: nn.Module, device: torch.device, lost: set[str]) -> None:
    """Recompute ``mod``'s own buffers: torchtitan's ``_init_self_buffers``; for buffers in
    ``lost`` (their values were never computed) with no such hook, ``reset_parameters()``
    when the module has it and no parameters of its own (else it ran with them)."""
    init_buffers = getattr(mod, "_init_self_buffers", None)
    if not callable(init_buffers) or not mod._buffers:
        reset = getattr(mod, "reset_parameters", None)
        if lost and callable(reset) and not mod._parameters:
            reset()
        return
    DTensor, distribute_tensor = _dtensor()
    dtensor_meta = {
        name: (b.device_mesh, b.placements)
        for name, b in mod._buffers.items()
        if isinstance(b, DTensor)
    }
    init_buffers(buffer_device=device)
    for name, (mesh, placements) in dtensor_meta.items():
        new = mod._buffers.get(name)
        if new is not None and not isinstance(new, DTensor):
            persistent = name not in mod._non_persistent_buffers_set
            mod.register_buffer(
                name, distribute_tensor(new, mesh, list(placements), src_data_rank=None),
                persistent=persistent,
            )


def _check_buffers_written(module: nn.Module, before: dict) -> None:
    """Raise, naming them, if buffers whose values never existed were not written."""
    unwritten = []
    for (mod_fqn, name), (ident, version) in before.items():
        b = module.get_submodule(mod_fqn)._buffers.get(name)
        if b is not None and id(b) == ident and write_token(b) == version:
            unwritten.append(f"{mod_fqn + '.' if mod_fqn else ''}{name} "
                             f"({type(module.get_submodule(mod_fqn)).__name__})")
    if unwritten:
        raise ValueError(
            f"buffer{'s' if len(unwritten) > 1 else ''} {', '.join(unwritten[:4])}"
            f"{' ...' if len(unwritten) > 4 else ''} {'were' if len(unwritten) > 1 else 'was'} "
            "built on meta, so {} values never existed, and nothing recomputes them: autopp "
            "would leave uninitialised memory. Give the module a method "
            "_init_self_buffers(buffer_device) that recomputes them (torchtitan's convention) "
            "or reset_parameters(); or build the model on CPU (buffers that hold values are "
            "kept); or load them afterwards (load_state_dict; non-persistent buffers are not "
            "in state dicts)".format("their" if len(unwritten) > 1 else "its"))


@torch.no_grad()
def init_module_(module: nn.Module, *, seed: int, device: torch.device | str) -> nn.Module:
    """Materialise ``module`` (meta or not) on ``device`` and initialise it deterministically.

    Args:
        module: a whole model or a stage module whose parameter names are whole-model FQNs;
            plain or DTensor parameters. A tied parameter stays tied and takes the value its
            last module's initialiser gives it.
        seed: the global seed; the same seed gives the same weights however the model is split.
        device: where the weights live ("cpu", "cuda:0", ...).

    Raises ValueError for a buffer on meta that no module recomputes (named, with the fixes)."""
    device = torch.device(device)
    lost: dict[str, set[str]] = {}  # module FQN -> its buffers whose values never existed
    if any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers()):
        tied: dict[int, list[str]] = {}
        for fqn, p in module.named_parameters(remove_duplicate=False):
            tied.setdefault(id(p), []).append(fqn)
        kept: dict[tuple[str, str], torch.Tensor] = {}  # buffers with values: not lost
        for mod_fqn, mod in module.named_modules():
            for name, b in mod._buffers.items():
                if b is None:
                    continue
                if b.is_meta and b.numel() > 0:  # an empty buffer has no values to lose
                    lost.setdefault(mod_fqn, set()).add(name)
                else:
                    kept[mod_fqn, name] = b.detach().clone()
        if any(t.is_meta for t in module.parameters()):
            module.to_empty(device=device)
        else:  # parameters materialised already (e.g. sharded shard by shard): buffers only
            for mod_fqn, names in lost.items():
                bufs = module.get_submodule(mod_fqn)._buffers
                for name in names:
                    bufs[name] = torch.empty_like(bufs[name], device=device)
        for fqns in tied.values():  # to_empty makes one tensor per module: tie them again
            keep = module.get_parameter(fqns[-1])
            for fqn in fqns[:-1]:
                owner, _, name = fqn.rpartition(".")
                (module.get_submodule(owner) if owner else module)._parameters[name] = keep
        for (mod_fqn, name), value in kept.items():
            module.get_submodule(mod_fqn)._buffers[name].copy_(value)
    before = {(f, n): (id(b), write_token(b)) for f, names in lost.items()
              for n, b in module.get_submodule(f)._buffers.items() if n in names}
    for mod_fqn, mod in module.named_modules():
        by_model = _model_init(module, mod)
        if by_model is not None:
            _init_by_model(mod, mod_fqn, by_model, seed, device, lost.get(mod_fqn, set()))
            continue
        _init_own_params(mod, mod_fqn, seed, device)
        _init_own_buffers(mod, device, lost.get(mod_fqn, set()))
    _check_buffers_written(module, before)
    return module
