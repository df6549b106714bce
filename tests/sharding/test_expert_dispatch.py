"""Routed experts dispatching tokens by all-to-all (``autopp.sharding.expert_dispatch``).

On 4 gloo ranks the op, given its devices' token rows and expert shards and a process group,
equals a dense hand-written MoE (every expert on every token, weighted by the routing):
output, input and score gradients for the rank's rows, weight gradients for its experts.
Cases: one flat group of 4; a 2 x 2 mesh dispatching over the outer dim with experts split
further over the inner one; and over the inner dim inside each outer block. Single-process
checks: the options the planner gets, and their all-to-all price.
"""

from __future__ import annotations

import pytest
import torch

from autopp.sharding import experts  # noqa: F401  (registers the op and its hooks)
from tests.dist_harness import run_on_ranks
from tests.sharding._dispatch_worker import run


@pytest.mark.multiprocess
def test_all_to_all_dispatch_matches_a_dense_moe():
    results = run_on_ranks(run, 4, timeout=300)
    names = ["output", "x grad", "scores grad", "w1 grad", "w2 grad", "w3 grad"]
    for rank, res in enumerate(results):
        for case, (got, want) in res.items():
            for name, a, b in zip(names, got, want):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"rank {rank} {case} {name}: {m}")
