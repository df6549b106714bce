#!/usr/bin/env bash
# Run a command with scripts/heapcheck/heapcheck.so preloaded (built here with gcc on first use),
# e.g. the test that intermittently dies with "malloc(): unaligned tcache chunk detected":
#
#   scripts/heapcheck/run.sh python -m pytest -x -q tests/models/test_any_decoder.py
#   grep -l 'qfree\|qfence' /tmp/autopp-ranks-*/rank*.log      # the rank logs of a launch
#
# QFENCE=0 turns the page fence off (it costs a page and a few syscalls per small tensor);
# QFREE_BT=0 drops the freeing stacks from the reports (faster). See heapcheck.c.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
so="${HEAPCHECK_SO:-/tmp/heapcheck-$(id -u).so}"
if [ ! -f "$so" ] || [ "$here/heapcheck.c" -nt "$so" ]; then
    gcc -O2 -shared -fPIC -o "$so" "$here/heapcheck.c" -lpthread -ldl
fi
export QFENCE="${QFENCE:-1}" QFREE_BT="${QFREE_BT:-1}"
LD_PRELOAD="$so${LD_PRELOAD:+:$LD_PRELOAD}" exec "$@"
