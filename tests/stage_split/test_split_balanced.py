"""The cost-balanced split (autopp.stage_split.balanced): hand-computed cases."""

from __future__ import annotations

import itertools

import pytest

from autopp.stage_split.balanced import balanced_cuts, split_balanced
from autopp.stage_split.layout import ModelLayout


def _brute(costs, n_stages, fits=None):
    """Every split, by enumeration: the least (slowest stage, sum of squares)."""
    n, best = len(costs), None
    for inner in itertools.combinations(range(1, n), n_stages - 1):
        cuts = [0, *inner, n]
        if fits and not all(fits(s, a, b) for s, (a, b) in enumerate(zip(cuts, cuts[1:]))):
            continue
        t = [sum(costs[a:b]) for a, b in zip(cuts, cuts[1:])]
        key = (max(t), sum(x * x for x in t))
        if best is None or key < best[0]:
            best = (key, cuts)
    return None if best is None else best[1]


def test_equal_costs_split_evenly():
    assert balanced_cuts([1.0] * 8, 4) == [0, 2, 4, 6, 8]
    assert balanced_cuts([1.0] * 7, 3) in ([0, 2, 5, 7], [0, 3, 5, 7], [0, 2, 4, 7])


def test_heavy_last_unit_gets_fewer_neighbours():
    # a head as heavy as 4 layers: [1,1,1,1,1,4] in 2 stages; a uniform split by count
    # ([1,1,1 | 1,1,4]) is 3 vs 6; the balanced one's slowest stage is 5
    cuts = balanced_cuts([1, 1, 1, 1, 1, 4], 2)
    t = [sum([1, 1, 1, 1, 1, 4][a:b]) for a, b in zip(cuts, cuts[1:])]
    assert max(t) == 5


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force(seed):
    import random

    rng = random.Random(seed)
    costs = [rng.choice([0.5, 1.0, 1.5, 3.0]) for _ in range(rng.randint(3, 9))]
    k = rng.randint(1, len(costs))
    cap = rng.choice([None, 4.0, 6.0])
    fits = None if cap is None else (lambda s, a, b: b - a <= cap)
    got = balanced_cuts(costs, k, fits=fits)
    want = _brute(costs, k, fits)
    if want is None:
        assert got is None
    else:
        tg = [sum(costs[a:b]) for a, b in zip(got, got[1:])]
        tw = [sum(costs[a:b]) for a, b in zip(want, want[1:])]
        assert (max(tg), sum(x * x for x in tg)) == pytest.approx((max(tw), sum(x * x for x in tw)))
        assert all(fits(s, a, b) for s, (a, b) in enumerate(zip(got, got[1:]))) if fits else True


@pytest.mark.parametrize("seed", range(10))
def test_stage_table_matches_brute_force(seed):
    """Stages priced by a table (stage, units held), as the search does: a first and a last
    stage heavier per unit, and a memory cap on units per stage, against enumeration."""
    import math
    import random

    rng = random.Random(seed)
    n = rng.randint(3, 9)
    k = rng.randint(1, n)
    cap = rng.choice([n, 3, 2])
    rate = [rng.choice([1.0, 1.5, 2.0]) if s in (0, k - 1) else 1.0 for s in range(k)]
    table = [[u * rate[s] if 0 < u <= cap else math.inf for u in range(n + 1)]
             for s in range(k)]
    got = balanced_cuts([1.0] * n, k, stage_table=table)
    best = None
    for inner in itertools.combinations(range(1, n), k - 1):
        cuts = [0, *inner, n]
        t = [table[s][b - a] for s, (a, b) in enumerate(zip(cuts, cuts[1:]))]
        key = (max(t), sum(x * x for x in t))
        if math.isfinite(key[0]) and (best is None or key < best):
            best = key
    if best is None:
        assert got is None
    else:
        t = [table[s][b - a] for s, (a, b) in enumerate(zip(got, got[1:]))]
        assert (max(t), sum(x * x for x in t)) == pytest.approx(best)


def test_infeasible_memory_returns_none():
    # every stage may hold at most 1 unit, 4 units, 2 stages: impossible
    assert balanced_cuts([1, 1, 1, 1], 2, fits=lambda s, a, b: b - a <= 1) is None


def test_split_balanced_puts_pre_and_post_with_first_and_last_layer():
    layout = ModelLayout(pre=("tok_embeddings",), layers_attr="layers",
                         layer_names=tuple(str(i) for i in range(6)), post=("norm", "output"))
    # the head costs 2 layers: the last stage holds fewer layers (2 + head vs 4)
    stages = split_balanced(layout, 2, layer_costs=[1.0] * 6, post_cost=2.0)
    assert stages == [["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"],
                      ["layers.4", "layers.5", "norm", "output"]]
    with pytest.raises(ValueError, match="at least one layer"):
        split_balanced(layout, 7, layer_costs=[1.0] * 6)


@pytest.mark.parametrize("seed", range(10))
def test_empty_end_stages_match_brute_force(seed):
    """``empty_ends``: the first and last stage may hold no unit (a stage of only the
    embedding, or only the head), priced by their table's column 0; up to n + 2 stages.
    Against enumeration of every split whose middle stages are non-empty."""
    import math
    import random

    rng = random.Random(100 + seed)
    n = rng.randint(1, 6)
    k = rng.randint(1, n + 2)
    ends = [rng.choice([0.5, 1.0, 3.0]), rng.choice([0.5, 2.0, 4.0])]  # pre, post alone
    table = [[(ends[0] if s == 0 else 0.0) + (ends[1] if s == k - 1 else 0.0)
              + u * (1.5 if s in (0, k - 1) else 1.0)
              if u > 0 or s in (0, k - 1) else math.inf for u in range(n + 1)]
             for s in range(k)]
    got = balanced_cuts([1.0] * n, k, stage_table=table, empty_ends=True)
    best = None
    for inner in itertools.combinations_with_replacement(range(n + 1), k - 1):
        cuts = [0, *inner, n]
        spans = [b - a for a, b in zip(cuts, cuts[1:])]
        if any(x < 0 for x in spans) or any(x == 0 for x in spans[1:-1]):
            continue
        t = [table[s][b - a] for s, (a, b) in enumerate(zip(cuts, cuts[1:]))]
        key = (max(t), sum(x * x for x in t))
        if math.isfinite(key[0]) and (best is None or key < best):
            best = key
    assert got is not None and best is not None
    t = [table[s][b - a] for s, (a, b) in enumerate(zip(got, got[1:]))]
    assert (max(t), sum(x * x for x in t)) == pytest.approx(best)
    assert all(b > a for a, b in list(zip(got, got[1:]))[1:-1])  # middle stages hold a unit
    with pytest.raises(ValueError, match="cannot cut 2 units into 5 stages"):
        balanced_cuts([1.0, 1.0], 5, empty_ends=True)
