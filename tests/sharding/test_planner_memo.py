"""The planner's in-process memo forgets the least recently used unit, with exactly its
models and solutions (a solution names its traced unit's nodes: one must never outlive its
unit, or a re-traced unit would be served another trace's solution)."""

from __future__ import annotations

from autopp.sharding.planner import _Memo


def _fill(memo: _Memo, ukey: str) -> None:
    memo.traced[ukey] = f"trace {ukey}"
    mkey = (ukey, "H100", False, "memory", 1.0)
    memo.models[mkey[:3] + mkey[4:]] = f"base {ukey}"
    memo.models[mkey] = f"model {ukey}"
    memo.solves[(mkey, ("in", "out"), "price 0")] = f"solve {ukey}"


def test_the_least_recently_used_unit_goes_with_its_models_and_solves(monkeypatch):
    monkeypatch.setattr(_Memo, "LIMIT", 4)
    memo = _Memo()
    for u in "abc":
        _fill(memo, u)
    assert memo.unit("a") == "trace a"  # a is now the most recently used
    memo.trim()  # 6 models > 4: b goes (a, inserted first, was used since)
    assert list(memo.traced) == ["c", "a"]
    assert sorted(memo.models.values()) == ["base a", "base c", "model a", "model c"]
    assert sorted(memo.solves.values()) == ["solve a", "solve c"]
    assert memo.unit("b") is None


def test_within_its_limits_the_memo_keeps_everything(monkeypatch):
    monkeypatch.setattr(_Memo, "LIMIT", 6)
    memo = _Memo()
    for u in "abc":
        _fill(memo, u)
    memo.trim()
    assert list(memo.traced) == ["a", "b", "c"] and len(memo.solves) == 3
