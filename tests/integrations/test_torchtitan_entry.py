"""torchtitan's own entry point trains through autopp (``autopp.integrations.torchtitan``),
and matches torchtitan's own manual PP x FSDP x TP from the same weights.

One seed checkpoint (torchtitan's own init, ``--checkpoint.create_seed_checkpoint`` on 1
process) is loaded by three launches of ``python -m torchtitan.train --module
autopp.integrations.torchtitan`` on 4 gloo processes (pp2 x dp2 x tp1, Interleaved1F1B, 4
microbatches, 5 steps):

1. ``--config llama3_debugmodel_autopp``: autopp's planner, a checkpoint at step 3;
2. ``--config llama3_debugmodel_torchtitan``: torchtitan's ``pipeline_llm`` and
   ``parallelize_llama`` (FSDP) under its own Trainer. What CPU/gloo needs changed, and
   nothing else (:mod:`autopp.integrations.torchtitan.reference`): FSDP reduces with SUM
   (gloo has no PREMUL_SUM) and torch 2.13's schedule takes the whole batch (torchtitan 0.3.0
   hands it microbatch lists); both runs share the configs' CPU settings (SDPA attention,
   plain cross entropy, fp32, seq 128);
3. autopp again, resumed from (1)'s step-3 checkpoint in another layout: 1F1B (2 stages
   of 4 blocks instead of Interleaved1F1B's 4 stages of 2), steps 4-5; in the default test
   with ``--autopp.parallelize replicate``.

The default test runs all three with ``--autopp.per_document_positions`` on the
short-documents dataset (rows pack several documents; the positions restart inside rows,
asserted from torchtitan's own dataset class): torchtitan's ``positions`` reach every stage
(RoPE per document; attention plain causal in both runs, torchtitan's SDPA attention takes
``is_causal`` only). The wide test runs without them.

The losses are torchtitan's own values as its Trainer computed them (``global_avg_loss``,
full precision, recorded by ``--autopp.losses_file``), not the metrics line's 5 digits:
(1) equals (2) within 1e-5 at every step, (3) equals (1) within 1e-5. The wide matrix runs
the same at pp2 x dp2 x tp2 on 8 processes, resumed at pp4 x dp2 x tp1.

The startup refusals of the integration are checked in-process, without a launch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.harness.launch import run_command

STEPS, SAVE_AT = 5, 3


def _missing() -> str | None:
    for name in ("torchtitan.train", "tokenizers", "datasets"):
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except ImportError:
            return name
    return None


needs_torchtitan = pytest.mark.skipif(
    _missing() is not None, reason=f"torchtitan's entry point needs {_missing()}, not installed")


def _train(work: Path, n: int, config: str, *args: str, timeout: float = 420) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(n), "--local-ranks-filter", "0", "-m", "torchtitan.train",
           "--module", "autopp.integrations.torchtitan", "--config", config, *args]
    out = run_command(cmd, cwd=work, env={**os.environ, "OMP_NUM_THREADS": "1"},
                      timeout=timeout)
    return re.sub(r"\x1b\[[0-9;]*m", "", out)


def _losses(prefix: Path) -> dict[int, float]:
    """{step: loss} from every rank's ``--autopp.losses_file`` record (ranks holding the
    last stage; they must agree exactly: one all-reduced value)."""
    out: dict[int, float] = {}
    files = sorted(prefix.parent.glob(prefix.name + ".rank*"))
    assert files, f"no loss records {prefix}.rank*"
    for f in files:
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            assert out.setdefault(rec["step"], rec["loss"]) == rec["loss"], (f, rec)
    return out


def _layout(pp: int, dp: int, tp: int) -> list[str]:
    return ["--parallelism.pipeline_parallel_degree", str(pp),
            "--parallelism.data_parallel_shard_degree", str(dp),
            "--parallelism.tensor_parallel_degree", str(tp)]


def _compare_runs(work: Path, n: int, layout: list[str], resume: list[str],
                  extra: tuple[str, ...] = ()) -> dict:
    seed_out = _train(work, 1, "llama3_debugmodel_torchtitan", "--dump_folder", "seed",
                      "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                      *_layout(1, 1, 1))
    assert (work / "seed/checkpoint/step-0").is_dir(), seed_out[-3000:]
    common = ["--training.steps", str(STEPS), "--checkpoint.enable",
              "--checkpoint.interval", str(SAVE_AT), *extra]
    from_seed = [*common, "--checkpoint.initial_load_path", str(work / "seed/checkpoint/step-0")]
    autopp = _train(work, n, "llama3_debugmodel_autopp", *layout, *from_seed,
                    "--dump_folder", "run_autopp", "--autopp.losses_file", str(work / "autopp"))
    _train(work, n, "llama3_debugmodel_torchtitan", *layout, *from_seed,
           "--dump_folder", "run_torchtitan", "--autopp.losses_file", str(work / "torchtitan"))
    resumed = _train(work, n, "llama3_debugmodel_autopp", *resume, *common,
                     "--checkpoint.initial_load_path",
                     str(work / f"run_autopp/checkpoint/step-{SAVE_AT}"),
                     "--checkpoint.no-initial-load-model-only", "--dump_folder", "run_resumed",
                     "--autopp.losses_file", str(work / "resumed"))
    runs = {name: _losses(work / name) for name in ("autopp", "torchtitan", "resumed")}
    diffs = {s: abs(runs["autopp"][s] - runs["torchtitan"][s]) for s in runs["torchtitan"]}
    print(f"losses autopp {runs['autopp']}\n  torchtitan {runs['torchtitan']}\n  resumed "
          f"{runs['resumed']}\n  max |autopp - torchtitan| {max(diffs.values()):.2e}")
    assert sorted(runs["autopp"]) == sorted(runs["torchtitan"]) == list(range(1, STEPS + 1))
    for s, d in diffs.items():
        assert d <= 1e-5, (s, runs["autopp"][s], runs["torchtitan"][s])
    assert sorted(runs["resumed"]) == list(range(SAVE_AT + 1, STEPS + 1)), resumed[-3000:]
    for s, loss in runs["resumed"].items():
        assert abs(loss - runs["autopp"][s]) <= 1e-5, (s, loss, runs["autopp"][s])
    return {"autopp_out": autopp, "runs": runs}


def _position_resets(work: Path, dp: int, rows: int) -> list[list[int]]:
    """Per dp rank, how often the per-document positions restart inside each of the first
    ``rows`` rows torchtitan's own dataset class gives that rank (the launches' data)."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    from autopp.integrations.torchtitan.trainer import SHORT_DOCS_DATASET_PATH, TOKENIZER_PATH

    tok = HuggingFaceTokenizer(tokenizer_path=str(work / TOKENIZER_PATH))
    out = []
    for rank in range(dp):
        it = iter(HuggingFaceTextDataset(
            dataset_name="c4_test", dataset_path=str(work / SHORT_DOCS_DATASET_PATH),
            tokenizer=tok, seq_len=128, dp_rank=rank, dp_world_size=dp, infinite=True))
        out.append([int((next(it)[0]["positions"][1:] == 0).sum()) for _ in range(rows)])
    return out


#: torchtitan's per-document positions on, with rows packing several documents
POSITIONS = ("--autopp.per_document_positions", "--dataloader.dataset_path",
             "./outputs/autopp_assets/c4_test_short_docs")


@pytest.mark.multiprocess
@needs_torchtitan
def test_torchtitan_train_with_autopp_matches_torchtitans_own(tmp_path):
    """With ``--autopp.per_document_positions`` on a dataset whose rows pack several
    documents: both runs give each stage torchtitan's ``positions`` (RoPE restarts at each
    document; attention stays plain causal under SDPA in both); the resumed run uses
    ``--autopp.parallelize replicate``, so both autopp backends take them."""
    from autopp.integrations.torchtitan.logs import read_metrics

    res = _compare_runs(tmp_path, 4, _layout(2, 2, 1),
                        [*_layout(2, 2, 1), "--parallelism.pipeline_parallel_schedule", "1F1B",
                         "--autopp.parallelize", "replicate"], extra=POSITIONS)
    # the positions the runs trained on restart inside rows: in the first step's batch (4
    # rows) on each dp rank, and in the resumed run's first step (SAVE_AT + 1) on some
    resets = _position_resets(tmp_path, 2, 4 * STEPS)
    print("position resets per row, dp rank 0 and 1:", resets)
    assert all(sum(per_row[:4]) > 0 for per_row in resets), resets
    assert any(sum(per_row[4 * SAVE_AT:4 * SAVE_AT + 4]) > 0 for per_row in resets), resets
    out = res["autopp_out"]
    assert "autopp plan:" in out and "autopp pipeline: 4 stages over pp=2" in out, out[-6000:]
    metrics = read_metrics(out)  # torchtitan's metrics line, every step
    assert sorted(metrics) == list(range(1, STEPS + 1)), out[-6000:]
    for s, m in metrics.items():  # the line prints the recorded loss to 5 digits
        assert m.loss == pytest.approx(res["runs"]["autopp"][s], abs=6e-6)
    # autopp's simulator at startup: the whole plan with its estimates and the summary line
    assert "estimated step" in out and "pp rank 1: peak" in out, out[-6000:]
    startup = re.search(r"autopp predicted \(profile CPU, schedule Interleaved1F1B simulated\): "
                        r"step ([\d.]+) ms, bubble [\d.]+%, tps ([\d,]+) per device.*"
                        r"peak memory per device ([\d.]+) MiB .*activations ([\d.]+)", out)
    assert startup, out[-6000:]
    step_ms, tps = float(startup[1]), float(startup[2].replace(",", ""))
    assert step_ms > 0 and float(startup[3]) > 0 and float(startup[4]) > 0
    # 4 sequences of 128 tokens per dp rank over pp x tp = 2 devices, per simulated step
    assert tps == pytest.approx(4 * 128 / 2 / (step_ms / 1e3), rel=1e-2)
    # predicted tps next to the measured one, after each metrics line but the first
    predicted = {int(m[1]): (float(m[2].replace(",", "")), float(m[3].replace(",", "")))
                 for m in re.finditer(r"step:\s*(\d+)\s+autopp tps predicted: ([\d,]+)\s+"
                                      r"measured: ([\d,]+)", out)}
    assert sorted(predicted) == list(range(2, STEPS + 1)), out[-6000:]
    assert all(p == pytest.approx(tps, rel=1e-3) and m > 0 for p, m in predicted.values())
    assert "Training completed" in out


@pytest.mark.multiprocess
@pytest.mark.wide
@needs_torchtitan
def test_torchtitan_parity_pp2_dp2_tp2_resumed_at_pp4(tmp_path):
    _compare_runs(tmp_path, 8, _layout(2, 2, 2), _layout(4, 2, 1))


# ---- startup refusals, in-process ---------------------------------------------------------
@needs_torchtitan
def test_startup_refusals_name_the_problem():
    from autopp.integrations.torchtitan import pipelining
    from autopp.integrations.torchtitan.config_registry import llama3_debugmodel_autopp
    from autopp.integrations.torchtitan.trainer import AutoppTrainer

    def dims(**kw):
        d = dict(cp=1, ep=1, dp_replicate=1, dp_shard=2, pp=2, tp=1)
        return SimpleNamespace(**{**d, **kw})

    training = SimpleNamespace(global_batch_size=-1, local_batch_size=4)
    pipelining._check_supported(dims(), training)  # the configs' own: accepted
    for kw, words in ((dict(cp=2), "context parallelism"),
                      (dict(ep=2, dp_shard=4), "expert parallelism of degree 2 .* set "
                       "expert_parallel_degree to 4, or 1"),
                      (dict(ep=4, dp_replicate=2, tp=2), "expert parallelism of degree 4 .* "
                       "set expert_parallel_degree to 2, or 1")):
        with pytest.raises(ValueError, match=f"autopp's pipeline does not support {words}"):
            pipelining._check_supported(dims(**kw), training)
    # torchtitan's ep group (the innermost ep devices of dp_shard x tp) as autopp's
    # expert_dims; the pipeline plans the experts over it with all-to-all dispatch
    for kw, want in ((dict(), "auto"), (dict(ep=2), "dp"), (dict(ep=2, tp=2), "tp"),
                     (dict(ep=4, tp=2), "dp*tp"), (dict(ep=2, tp=2, dp_replicate=2), "tp")):
        pipelining._check_supported(dims(**kw), training)
        assert pipelining.expert_dims_of(dims(**kw)) == want, kw
    with pytest.raises(ValueError, match=r"gradient accumulation \(global_batch_size != "
                                         r"local_batch_size x dp\)"):
        pipelining._check_supported(dims(), SimpleNamespace(global_batch_size=16,
                                                            local_batch_size=4))
    with pytest.raises(ValueError, match="maps activation_checkpoint none, selective and full"):
        pipelining._recompute(SimpleNamespace())
    assert pipelining._recompute(None) == "none"

    cfg = llama3_debugmodel_autopp()
    cfg.autopp.per_document_positions = True
    AutoppTrainer._prepare(cfg)  # accepted: positions reach every stage

    # the schedule joins torchtitan's microbatch lists, keyword inputs included
    tok = [(torch.full((1, 3), i),) for i in range(2)]
    pos = [{"positions": torch.tensor([[0, 1, 0]]) + i} for i in range(2)]
    labels = [torch.zeros(1, 3, dtype=torch.long)] * 2
    x, y, kw = pipelining.AutoppSchedule._batch(tok, pos, labels)
    assert x.shape == y.shape == kw["positions"].shape == (2, 3) and kw["positions"][1, 2] == 1
    with pytest.raises(ValueError, match="model keyword input 'attention_masks' is dict"):
        pipelining.AutoppSchedule._batch(tok, [{"attention_masks": {}}] * 2, labels)
    built_without = pipelining.AutoppSchedule(None, dp_size=1)
    with pytest.raises(ValueError, match=r"keyword inputs \['positions'\]; this autopp pipeline "
                                         r"was built for \[\].*Turn the option off"):
        built_without.step(arg_mbs=tok, kwarg_mbs=pos, target_mbs=labels)
    cfg = llama3_debugmodel_autopp()
    cfg.validator.enable = True
    with pytest.raises(ValueError, match="set --validator.enable false"):
        AutoppTrainer._prepare(cfg)
