#!/usr/bin/env bash
# What the test command's work costs: each lane of the suite run alone, with the CPU seconds
# the whole machine spent meanwhile (user + nice + system, from /proc/stat; forked ranks and
# workers included) and the wall seconds. On N cores the suite cannot take less than the sum
# of the core-seconds over N, however its lanes are packed. Run it alone on the machine.
#   bash benchmarks/suite_cpu.sh            # both lanes
#   bash benchmarks/suite_cpu.sh multiprocess
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
hz=$(getconf CLK_TCK)
busy() { awk '/^cpu /{print $2 + $3 + $4}' /proc/stat; }
lanes=("$@")
[ $# -eq 0 ] && lanes=("multiprocess" "not multiprocess")
total=0
for lane in "${lanes[@]}"; do
    b0=$(busy); t0=$(date +%s.%N)
    "$root/.venv/bin/python" -m pytest -q -p no:randomly -m "$lane and not wide" | tail -1
    b1=$(busy); t1=$(date +%s.%N)
    cpu=$(( (b1 - b0) / hz ))
    total=$(( total + cpu ))
    printf '[suite_cpu] -m "%s and not wide": %d core-s in %.0f s wall\n' "$lane" "$cpu" \
        "$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')"
done
printf '[suite_cpu] %d core-s: at least %.1f min on %d cores\n' "$total" \
    "$(awk -v c="$total" -v n="$(nproc)" 'BEGIN {print c / n / 60}')" "$(nproc)"
