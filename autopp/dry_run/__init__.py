"""The dry run: plan every stage of a pipeline on a fake world, simulate the schedule and
report step time and per-rank memory against the device's, without any device.

    from autopp.dry_run import dry_run
    report = dry_run(model_on_meta, pp=4, dp=8, tp=8, schedule="1F1B", n_microbatches=16,
                     global_batch=256, seq_len=8192)
    print(report)

* :mod:`autopp.dry_run.run`: :func:`dry_run` and its :class:`DryRunReport`.
* :mod:`autopp.dry_run.format`: the report's text.
"""

from autopp.dry_run.run import DryRunReport, StageReport, dry_run

__all__ = ["DryRunReport", "StageReport", "dry_run"]
