#!/usr/bin/env bash
# The test command: refreshes .venv, then runs the whole suite (unit + multi-process gloo tests).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"
cd "$root"
# Two pytest workers: every multi-process test on one (one launch at a time), the
# single-process tests on the other beside it (tests/conftest.py). AUTOPP_TEST_WORKERS=0
# runs the suite in one process.
workers="${AUTOPP_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != "0" ]; then
    parallel=(-n "$workers" --dist loadgroup)
fi
# --durations: the slowest tests in every log, so the command's time can be watched
exec "$root/.venv/bin/python" -m pytest -q --durations=25 "${parallel[@]}" "$@"
