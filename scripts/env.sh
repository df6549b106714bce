#!/usr/bin/env bash
# Creates or refreshes the project's virtual environment (.venv) so that the other
# scripts need nothing typed before them, with the exact versions CI uses (constraints.txt).
# Re-installs only when pyproject.toml or constraints.txt changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.autopp-installed"
want="$(cat "$root/pyproject.toml" "$root/constraints.txt" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
    echo "[env] creating $venv" >&2
    python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[env] installing autopp and its pinned dependencies into $venv" >&2
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    # torch first and pinned (constraints.txt), so no other package can pull a CUDA build
    # of a newer torch; then autopp with every extra the suite needs, at the pinned versions.
    "$venv/bin/python" -m pip install -q -c "$root/constraints.txt" torch >&2
    "$venv/bin/python" -m pip install -q -c "$root/constraints.txt" -e "$root[dev]" >&2
    echo "$want" > "$stamp"
fi
# meta's AutoParallel (not on any registry here): installed from the shared wheel when one is
# beside the checkout, so the AutoParallel backend's tests run; skipped (with the reason
# printed by pytest) where there is none.
wheel="$(ls "$root"/../shared/wheels/autoparallel-*.whl 2>/dev/null | head -n 1 || true)"
if [ -n "$wheel" ] && ! "$venv/bin/python" -c "import autoparallel.api" 2>/dev/null; then
    echo "[env] installing meta's AutoParallel from $wheel" >&2
    "$venv/bin/python" -m pip install -q "$wheel" >&2
fi
