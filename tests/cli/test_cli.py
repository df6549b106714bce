"""The ``autopp`` command line (autopp/cli.py), run as ``python -m autopp`` in a subprocess
(each dry run needs a fresh process for its fake process group), on small models: torchtitan's
llama3 debugmodel, a small Qwen3 config.json written here, and ``module:factory``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autopp.plan.value import PipelinePlan

ROOT = Path(__file__).resolve().parents[2]


def autopp(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m autopp ARGV`` from the repository root (so ``tests.harness.models`` imports)."""
    out = subprocess.run([sys.executable, "-m", "autopp", *argv], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    if check and out.returncode != 0:
        raise AssertionError(f"autopp {' '.join(argv)} exited {out.returncode}:\n"
                             f"{out.stderr[-3000:]}")
    return out


SMALL = ("--global-batch", "4", "--seq-len", "32")


@pytest.fixture(scope="module")
def llama_dry_run(tmp_path_factory):
    """``autopp --json dry-run llama3:debugmodel`` at pp=2 x tp=2, saving its plan."""
    path = tmp_path_factory.mktemp("cli") / "llama.json"
    out = autopp("--json", "dry-run", "llama3:debugmodel", "--pp", "2", "--tp", "2", *SMALL,
                 "--save", str(path))
    return json.loads(out.stdout), path, out.stderr


def test_dry_run_of_a_torchtitan_name(llama_dry_run):
    report, path, stderr = llama_dry_run
    assert (report["pp"], report["dp"], report["tp"]) == (2, 1, 2)
    assert report["n_microbatches"] == 2  # default: one per stage
    assert [s["modules"] for s in report["stages"]] == [
        "tok_embeddings, layers.0-2", "layers.3-5, norm, lm_head"]
    assert len(report["peak_bytes"]) == 2 and all(report["fits"])
    assert 0 < report["step_time_s"] < 1
    assert report["saved"] == str(path) and path.is_file()
    assert "stage" in stderr  # progress goes to stderr, not into the JSON


def test_show_describes_the_saved_plan(llama_dry_run):
    report, path, _ = llama_dry_run
    shown = json.loads(autopp("-q", "--json", "show", str(path)).stdout)
    assert (shown["pp"], shown["tp"], shown["n_stages"]) == (2, 2, 2)
    assert shown["estimates"]["peak_bytes"] == report["peak_bytes"]
    assert shown["fqns_per_stage"] == [list(f) for f in PipelinePlan.load(path).fqns_per_stage]
    text = autopp("-q", "show", str(path)).stdout
    assert text.startswith("PipelinePlan for model") and "pp=2 x dp=1 x tp=2" in text


def test_dry_run_of_a_hugging_face_config(tmp_path):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 1024,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 64, "tie_word_embeddings": False}))
    report = json.loads(autopp("-q", "--json", "dry-run", "--hf-config", str(config),
                               "--pp", "2", *SMALL).stdout)
    assert report["pp"] == 2 and len(report["stages"]) == 2
    assert report["stages"][0]["modules"].startswith("model.embed_tokens")
    assert report["stages"][1]["modules"].endswith("lm_head")


def test_plan_save_then_show_with_a_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    path, png = tmp_path / "plan.json", tmp_path / "step.png"
    made = json.loads(autopp("-q", "--json", "plan", "tests.harness.models:hf_meta", "--pp", "2",
                             "--schedule", "GPipe", *SMALL, "--save", str(path)).stdout)
    plan = PipelinePlan.load(path)
    assert (plan.pp, plan.schedule, plan.n_stages) == (2, "GPipe", 2)
    assert made["saved"] == str(path) and made["estimates"]["fits"] == [True, True]
    out = autopp("-q", "show", str(path), "--timeline", str(png),
                 "--model", "tests.harness.models:hf_meta").stdout
    assert f"simulated step drawn in {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("spec, says", [
    ("nosuch:thing", "cannot import 'nosuch'"),
    ("llama3:9Z", "its flavors: debugmodel, 1B"),
    ("llama3", "write family:flavor"),
])
def test_a_bad_model_spec_names_the_fix(spec, says):
    out = autopp("dry-run", spec, *SMALL, check=False)
    assert out.returncode == 2 and out.stdout == ""
    assert says in out.stderr and "Traceback" not in out.stderr


def test_planner_flags_reach_the_planner_options():
    """--optimality-gap goes into PlannerOptions, whose check refuses a gap outside (0, 1)."""
    out = autopp("dry-run", "llama3:debugmodel", *SMALL, "--optimality-gap", "2", check=False)
    assert out.returncode == 2 and "optimality_gap is a fraction" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_show_timeline_without_the_model_says_to_give_it(llama_dry_run):
    _, path, _ = llama_dry_run
    out = autopp("show", str(path), "--timeline", "x.png", check=False)
    assert out.returncode == 2 and "--model MODEL or --hf-config PATH" in out.stderr


def test_a_missing_extra_names_the_pip_install(monkeypatch):
    import importlib.util

    from autopp import extras

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(ImportError, match=r'pip install "autopp\[plot\]"'):
        extras.require("plot", for_what="--timeline")
    with pytest.raises(ImportError, match=r'pip install "autopp\[plot\]"'):
        extras.import_extra("matplotlib.figure", "plot", for_what="the timeline PNG")
