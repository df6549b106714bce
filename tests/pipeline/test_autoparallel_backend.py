"""meta's AutoParallel as the stage backend (``parallelize="autoparallel"``) on real gloo
processes: the loss and every gradient equal the single-process model's (fp32, 1e-5).

Runs where AutoParallel is installed (``scripts/env.sh`` installs it from
``../shared/wheels`` when that wheel exists); skipped with the reason otherwise."""

from __future__ import annotations

import pytest

from autopp.backends.meta_autoparallel import available
from tests.harness.launch import run_on_ranks
from tests.harness.models import llama3_meta, make_batch
from tests.harness.reference import reference_run
from tests.harness.workers.pipeline import run_configs
from tests.harness.checks import BATCH, N_LAYERS, SEQ, check_step, llama3_case

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not available(), reason="meta's AutoParallel is not installed (no "
                       "wheel in ../shared/wheels for scripts/env.sh to install)"),
]


@pytest.fixture(scope="module")
def reference():
    return reference_run(llama3_meta(N_LAYERS), [make_batch(BATCH, SEQ)])


# dp=2 (8 ranks, each solving AutoParallel's ILP on 2 cores: ~165 s) is in the wide matrix
@pytest.mark.parametrize("dp", [1, pytest.param(2, marks=pytest.mark.wide)])
def test_autoparallel_stages_match_single_process(reference, dp):
    # dp=1: a size-1 mesh dim, which AutoParallel itself cannot plan over
    configs = [llama3_case("1F1B", 2, dp=dp, tp=2, parallelize="autoparallel", eval=True)]
    check_step(run_on_ranks(run_configs, 2 * dp * 2, configs), configs, reference)
