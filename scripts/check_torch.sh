#!/usr/bin/env bash
# The other torch (run by .ci/run): the full suite runs on constraints.txt's torch (2.13.0);
# this runs the `compat` tests (pytest -m compat: where torch versions differ) on torch
# 2.14.1, in a venv of its own (.venv-torch2.14, made once and kept; AUTOPP_COMPAT_VENV: another
# path) with the other pins of constraints.txt. TORCH=x.y.z checks another release.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
torch_version="${TORCH:-2.14.1}"
venv="${AUTOPP_COMPAT_VENV:-$root/.venv-torch${torch_version%.*}}"
stamp="$venv/.autopp-installed"
# constraints.txt less its torch and triton pins (this torch brings the triton it needs)
want="$(cat "$root/pyproject.toml" "$root/constraints.txt" | sha256sum | cut -d' ' -f1) $torch_version"
start=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
    python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[check_torch] installing torch $torch_version and autopp[dev] into $venv" >&2
    pins="$venv/constraints.txt"
    grep -v -E '^(torch|triton)==' "$root/constraints.txt" > "$pins"
    echo "torch==$torch_version" >> "$pins"
    "$venv/bin/python" -m pip install -q "torch==$torch_version" >&2
    "$venv/bin/python" -m pip install -q -c "$pins" -e "$root[dev]" >&2
    echo "$want" > "$stamp"
fi
got="$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
[ "$got" = "$torch_version" ] || { echo "[check_torch] pip replaced torch $torch_version by $got" >&2; exit 1; }
cd "$root"
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m compat "$@"
echo "[check_torch] torch $got: compat tests passed in $((SECONDS - start)) s"
