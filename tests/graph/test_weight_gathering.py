"""``autopp.graph.weight_gathering``: the exposed time of block-by-block collectives, priced
one stage at a time (the planner's estimates) and many at once (the layout search)."""

from __future__ import annotations

import numpy as np

from autopp.graph.weight_gathering import exposed_s


def test_exposed_time_priced_for_many_stages_at_once_equals_each_alone():
    """The layout search prices every layer count of a stage at once (numpy columns): each
    element equals the time priced for that stage alone, bit for bit, and a block's gathers
    are hidden under the blocks before it but the first block's."""
    rng = np.random.default_rng(0)
    comm, compute = rng.random(64) * 1e-3, rng.random(64) * 2e-3
    units = np.arange(64)
    at_once = exposed_s(comm, compute, units)
    assert at_once.shape == (64,)
    assert [float(x) for x in at_once] == [exposed_s(float(c), float(k), int(u))
                                           for c, k, u in zip(comm, compute, units)]
    assert exposed_s(1.0, 0.0, 4) == 1.0  # nothing to hide under: all of it
    assert exposed_s(1.0, 10.0, 4) == 0.25  # all but the first block's quarter hidden
    assert exposed_s(1.0, 10.0, 1) == exposed_s(1.0, 10.0, 0) == 1.0
