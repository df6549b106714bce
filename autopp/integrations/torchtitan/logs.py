"""Read torchtitan's metrics lines back from a log, and compare two runs step by step.

    python -m autopp.integrations.torchtitan.logs run_a.log run_b.log

prints each common step's loss and gradient norm from both logs and the largest loss
difference. Lines whose loss is torchtitan's placeholder for "this rank has no last
stage" (-2.0, with PP) are skipped.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_METRICS = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.]+)\s+grad_norm:\s*([-\d.]+)\s+"
                      r"memory:.*tps:\s*[\d,]+")


@dataclass(frozen=True, slots=True)
class StepMetrics:
    step: int
    loss: float
    grad_norm: float


def read_metrics(text: str) -> dict[int, StepMetrics]:
    """{step: metrics} from torchtitan's log text (the last line of a step wins)."""
    out = {}
    for m in _METRICS.finditer(_ANSI.sub("", text)):
        loss = float(m.group(2))
        if loss != -2.0:
            out[int(m.group(1))] = StepMetrics(int(m.group(1)), loss, float(m.group(3)))
    return out


def compare(a: dict[int, StepMetrics], b: dict[int, StepMetrics]) -> tuple[str, float]:
    """A step-by-step table of two runs and the largest |loss difference|."""
    lines = ["step     loss A     loss B   |diff|   grad_norm A  grad_norm B"]
    worst = 0.0
    for s in sorted(set(a) & set(b)):
        d = abs(a[s].loss - b[s].loss)
        worst = max(worst, d)
        lines.append(f"{s:4d}  {a[s].loss:9.5f}  {b[s].loss:9.5f}  {d:7.1e}  "
                     f"{a[s].grad_norm:11.4f}  {b[s].grad_norm:11.4f}")
    return "\n".join(lines), worst


if __name__ == "__main__":
    runs = [read_metrics(open(p).read()) for p in sys.argv[1:3]]
    table, worst = compare(*runs)
    print(table)
    print(f"max |loss difference| over {len(set(runs[0]) & set(runs[1]))} steps: {worst:.1e}")
