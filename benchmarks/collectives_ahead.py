"""UNSHARD and REDUCE_GRAD issued ahead against run in place: one plan, simulated both ways.

    .venv/bin/python benchmarks/collectives_ahead.py --model 70B --pp 8 --dp 8 --tp 8 \
        --schedule DualPipeV --microbatches 64 --batch-size 512 --seq-len 8192 \
        --mixed-precision bf16

Plans the layout exactly (``autopp.dry_run``, H100 profile; the flags of
``split_backward_memory.py``) and simulates its stage costs twice: with each stage's
UNSHARD and REDUCE_GRAD blocking its rank (``StageCost.collectives_ahead=False``) and
issued ahead on the rank's communication stream, as the graph runtime runs them with
``overlap_collectives`` on (the dry run's own estimate). Prints both steps and bubbles.
Simulated, not measured: docs/design.md, `graph/` (collectives issued ahead).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from split_backward_memory import layout_arguments, planned  # noqa: E402


def main() -> None:
    args = layout_arguments(argparse.ArgumentParser(
        description=__doc__.splitlines()[0])).parse_args()
    from autopp.estimate.pipeline import simulate_stages

    report = planned(args)
    ranks = [st.pp_rank for st in report.stages]
    for ahead in (False, True):
        costs = [dataclasses.replace(st.cost, collectives_ahead=ahead) for st in report.stages]
        sim = simulate_stages(report.schedule, costs, pp=report.pp,
                              n_microbatches=report.n_microbatches, stage_ranks=ranks,
                              profile=report.profile,
                              mesh_shape=(report.pp, report.dp, report.tp))
        print(f"{'issued ahead' if ahead else 'blocking':12s}  step {sim.step_time_s * 1e3:.3f} ms"
              f"  bubble {100 * sim.bubble_fraction:.1f}%")


if __name__ == "__main__":
    main()
