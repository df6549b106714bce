"""Joint graphs reused within a process (autopp.tracing.cache): a unit traced again
with the same code, attributes, parameters, hooks and inputs is served the earlier graph;
any change to those traces again."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopp import tracing
from autopp.tracing import cache as trace_cache
from autopp.tracing.joint import graph_signature, trace_joint
from autopp.tracing.cache import trace_stats, traced_unit


class _Mlp(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16, eps: float = 1e-6):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x + self.down(F.silu(self.up(x)))


def _model(**kw) -> nn.Module:
    with torch.device("meta"):
        return _Mlp(**kw)


def _x(batch: int = 4) -> torch.Tensor:
    return torch.empty(batch, 8, device="meta")


def _served(module: nn.Module, x: torch.Tensor, **kw):
    """(the joint, whether it was served from the cache)."""
    before = trace_stats()["hits"]
    joint = traced_unit(module, (x,), **kw)
    return joint, trace_stats()["hits"] > before


def test_same_unit_is_served_and_equals_a_fresh_trace():
    trace_cache.clear()
    a, hit_a = _served(_model(), _x())
    b, hit_b = _served(_model(), _x())  # another instance, same code and shapes
    assert (hit_a, hit_b) == (False, True)
    assert b is a
    assert graph_signature(b) == graph_signature(trace_joint(_model(), (_x(),)))


def test_changed_inputs_shapes_attributes_or_settings_trace_again():
    trace_cache.clear()
    base, _ = _served(_model(), _x())
    changed = {
        "input shape": lambda: _served(_model(), _x(batch=2)),
        "parameter shape": lambda: _served(_model(hidden=32), _x()),
        "attribute": lambda: _served(_model(eps=1e-5), _x()),
        "parameter dtype": lambda: _served(_model(), _x(), param_dtype="bfloat16"),
        "requires_grad": lambda: _served(_model().requires_grad_(False), _x()),
    }
    for what, serve in changed.items():
        joint, hit = serve()
        assert not hit and joint is not base, what
    # the eps change is a constant of the graph: a served stale trace would hide it
    stale = traced_unit(_model(eps=1e-5), (_x(),))
    assert graph_signature(stale) != graph_signature(base)
    with tracing.settings(()):  # no setting changed: still served
        assert _served(_model(), _x())[1]


def test_changed_code_or_hooks_trace_again(monkeypatch):
    trace_cache.clear()
    base, _ = _served(_model(), _x())

    def forward(self, x):  # the same signature, other code
        return x + self.down(F.gelu(self.up(x)))

    monkeypatch.setattr(_Mlp, "forward", forward)
    joint, hit = _served(_model(), _x())
    assert not hit and graph_signature(joint) != graph_signature(base)
    monkeypatch.undo()
    assert _served(_model(), _x())[1]

    hooked = _model()
    hooked.up.register_forward_hook(lambda mod, args, out: out * 2)
    joint, hit = _served(hooked, _x())
    assert not hit and graph_signature(joint) != graph_signature(base)


def test_a_tensor_attribute_with_data_is_traced_uncached():
    trace_cache.clear()
    m = _model()
    m.scale = torch.ones(8)  # its values could be baked into the graph: not keyed
    before = trace_stats()["uncached"]
    traced_unit(m, (_x(),))
    traced_unit(m, (_x(),))
    assert trace_stats()["uncached"] == before + 2 and trace_stats()["hits"] == 0
