#!/usr/bin/env bash
# Packaging check (run by .ci/run): builds autopp's wheel, installs it into a fresh venv with
# only its core dependencies (torch 2.13.0 first, as constraints.txt pins it, so pip keeps
# that torch), checks that no extra came with it, imports autopp and runs a dry run of a
# small plain-torch decoder through the `autopp` console script.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"  # the dev venv builds the wheel (its setuptools, no download)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
start=$SECONDS
"$root/.venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$root" >&2
wheel="$(ls "$work"/dist/autopp-*.whl)"
python3.11 -m venv "$work/venv" 2>/dev/null || python3 -m venv "$work/venv"
py="$work/venv/bin/python"
torch_pin="$(grep -E '^torch==' "$root/constraints.txt")"
"$py" -m pip install -q "$torch_pin" >&2
"$py" -m pip install -q "$wheel" >&2
"$py" - "$torch_pin" <<'PY'
import importlib.util, sys
import torch
want = sys.argv[1].split("==")[1]
assert torch.__version__.split("+")[0] == want, f"pip replaced torch {want} by {torch.__version__}"
extras = [m for m in ("transformers", "matplotlib") if importlib.util.find_spec(m)]
assert not extras, f"the core install brought extras' packages: {extras}"
import autopp  # noqa: F401
print(f"[check_wheel] autopp imports with core dependencies only (torch {torch.__version__})")
PY
# a plain-torch decoder (embedding, pre-norm blocks, head), importable as wheelcheck:build
cat > "$work/wheelcheck.py" <<'PY'
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False, is_causal=False)[0]
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 64, n_layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def build() -> nn.Module:
    return Decoder()
PY
cd "$work"
AUTOPP_PLAN_CACHE="$work/cache" "$work/venv/bin/autopp" -q --json dry-run wheelcheck:build \
    --pp 2 --dp 1 --tp 2 --global-batch 4 --seq-len 32 > "$work/report.json"
"$py" - "$work/report.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert (r["pp"], r["tp"], len(r["stages"])) == (2, 2, 2), r
assert all(r["fits"]) and r["step_time_s"] > 0, r
print(f"[check_wheel] dry run from the installed wheel: {len(r['stages'])} stages, "
      f"simulated step {r['step_time_s'] * 1e3:.3f} ms, peaks {r['peak_bytes']} bytes")
PY
echo "[check_wheel] passed in $((SECONDS - start)) s"
