"""Rewrite the golden files under tests/golden/ from the current code.

    .venv/bin/python scripts/update_golden.py && git diff tests/golden/

The tests only compare against these files; they never write them, so a golden test cannot
compare a file with itself. Review the diff before committing it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autopp.schedules import dump_schedule_csv  # noqa: E402
from tests.schedules.test_schedules import GOLDEN, build_for, fake_pp  # noqa: E402

GOLDEN_SCHEDULES = {"interleaved1f1b_pp2_spr2_mb4.csv": ("Interleaved1F1B", 2, 4)}
"""File name -> (schedule, pp, n_microbatches), as tests/schedules/test_schedules.py reads them."""


def main() -> None:
    for name, (schedule, pp, n_mb) in GOLDEN_SCHEDULES.items():
        with fake_pp(pp):
            dump_schedule_csv(build_for(schedule, pp=pp, n_microbatches=n_mb), GOLDEN / name)
        print(f"wrote {GOLDEN / name}")


if __name__ == "__main__":
    main()
