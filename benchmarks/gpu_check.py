"""The prepared device check (``scripts/gpu_check.sh``): what one GPU must confirm before
autopp's GPU figures are trusted, in one process, printed as one table.

The GPU machine this project is sometimes lent has no torchtitan, no HiGHS and no network,
so the model is a pure-torch Hugging Face style decoder (``tests/models.py``) and the plan
is made here, on CPU, and carried as JSON (``--make-plan``); the device only applies it:

    .venv/bin/python benchmarks/gpu_check.py --make-plan benchmarks/gpu_check_plan.json
    python benchmarks/gpu_check.py --plan benchmarks/gpu_check_plan.json      # on the GPU
    .venv/bin/python benchmarks/gpu_check.py --cpu       # the same checks on CPU (gloo),
                                                         # planning in-process (wide test)

Rows (check, result, figures):

1. ``device``: the profile autopp detects for the device (an H200 must not be planned as
   an 80 GB H100) and the mesh's device type under the process group's backend.
2. ``attention``: autopp's attention op forward + backward against torch's own SDPA under
   autograd, on the device: time, allocator peak (CUDA), largest gradient difference.
3. ``parity``: the planned pipeline (the carried plan, ``plan=``) runs a step; its loss and
   every gradient against the plain model on the same device (fp32; TF32 off, torch's
   default), by the suite's parity metric (per tensor ‖g − r‖ / max(‖r‖, 1e-3) ≤ 1e-5).
4. ``step time``: the median of ``--repeats`` steps against the plan's simulated step.
5. ``peak memory``: ``torch.cuda.max_memory_allocated`` during a step against the plan's
   predicted peak (CUDA only).
6. ``checkpoint``: a DCP save and load on the device (NCCL all-reduces the finiteness
   flag on the device) and the loaded pipeline's eval loss.

Parity and checkpoint fail the script above their bounds; the ratios are measurements.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: The checked model: sizes for a GPU (a few GiB at most), and for the CPU mode.
SIZES = {"cuda": dict(vocab=32000, dim=1024, n_layers=4, n_heads=16, hidden=4096, max_seq=2048),
         "cpu": dict(vocab=2048, dim=64, n_layers=4, n_heads=4, hidden=128, max_seq=64)}
BATCH = {"cuda": (8, 2048), "cpu": (8, 64)}
SCHEDULE, N_MICROBATCHES = "GPipe", 2


def _model(kind: str) -> torch.nn.Module:
    from tests.models import HFForCausalLM

    with torch.device("meta"):
        return HFForCausalLM(**SIZES[kind])


def make_plan(kind: str, profile: str, path: str | None = None):
    """The pp1 x dp1 x tp1 plan of the checked model (a dry run on the fake process
    group): its PipelinePlan, with the simulator's estimates."""
    from autopp.backends import PlannerOptions
    from autopp.dry_run import dry_run

    batch, seq = BATCH[kind]
    report = dry_run(_model(kind), pp=1, dp=1, tp=1, schedule=SCHEDULE,
                     n_microbatches=N_MICROBATCHES, global_batch=batch, seq_len=seq,
                     options=PlannerOptions(profile=profile))
    if path is not None:
        report.plan.save(path)
    return report.plan


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _attention_row(device: torch.device) -> tuple[str, str, str]:
    import autopp.ops.attention  # noqa: F401  (registers autopp::sdpa)

    b, h, s, d = (1, 16, 4096, 64) if device.type == "cuda" else (1, 4, 512, 32)
    q, k, v = (torch.randn(b, h, s, d, device=device, requires_grad=True) for _ in range(3))
    g = torch.randn(b, h, s, d, device=device)

    def run(op):
        out = op(q, k, v)
        return torch.autograd.grad(out, (q, k, v), g)

    ours = lambda q, k, v: torch.ops.autopp.sdpa(q, k, v, True, d ** -0.5, False)  # noqa: E731
    theirs = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    figures = []
    for name, op in (("autopp", ours), ("torch", theirs)):
        run(op)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            run(op)
            _sync(device)
            times.append(time.perf_counter() - t0)
        peak = (f", peak {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB"
                if device.type == "cuda" else "")
        figures.append(f"{name} {statistics.median(times) * 1e3:.2f} ms{peak}")
    err = max(float((a - b).abs().max()) for a, b in zip(run(ours), run(theirs)))
    return ("attention", "ok" if err <= 1e-4 else "FAIL",
            f"(b, h, s, d) {(b, h, s, d)} causal fwd+bwd: {'; '.join(figures)}; max |grad "
            f"diff| {err:.1e}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check(kind: str, plan, repeats: int) -> list[tuple[str, str, str]]:
    """Rows 1-6 on device ``kind`` with ``plan`` (made for this model and batch)."""
    from autopp import build_world_mesh, init_module_, pipeline_autoparallel
    from autopp.backends import Planner, PlannerOptions
    from autopp.profiles.devices import profile_for_device
    from tests.models import ce_loss, make_batch
    from tests.parity import relative_error

    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" \
        else torch.device("cpu")
    rows = []
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", rank=0, world_size=1)
    try:
        mesh = build_world_mesh(pp=1, dp=1, tp=1)
        name = torch.cuda.get_device_name(device) if kind == "cuda" else "cpu"
        detected = profile_for_device(kind)
        rows.append(("device", "ok" if mesh.device_type == kind else "FAIL",
                     f"{name}: profile {detected} (the plan's: {plan.options.profile}); mesh "
                     f"device {mesh.device_type} under {dist.get_backend()}"))
        rows.append(_attention_row(device))

        batch, seq = BATCH[kind]
        tokens, target = (t.to(device) for t in make_batch(batch, seq, vocab=SIZES[kind]["vocab"]))

        def pipeline(seed: int):
            pipe = pipeline_autoparallel(
                _model(kind), mesh, example_inputs=(tokens,), loss_fn=ce_loss,
                schedule=SCHEDULE, n_microbatches=N_MICROBATCHES,
                parallelize=Planner(PlannerOptions(), plan=plan))
            pipe.init_weights(seed=seed)
            return pipe

        pipe = pipeline(0)
        loss = pipe.step(tokens, target=target)
        ref = init_module_(_model(kind), seed=0, device=device)
        ref_out = ce_loss(ref(tokens), target)
        ref_out.backward()
        ref_loss = ref_out.item()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        errs = {n: relative_error(_full(p.grad), ref_grads[n]) for n, p in pipe.named_parameters()}
        worst = max(errs, key=errs.get)
        ok = (errs[worst] <= 1e-5 and abs(loss - ref_loss) <= 1e-5
              and set(errs) == set(ref_grads))
        rows.append(("parity", "ok" if ok else "FAIL",
                     f"loss {loss:.6f} vs {ref_loss:.6f}; worst gradient {worst} rel "
                     f"{errs[worst]:.1e} of {len(errs)} tensors"))
        del ref, ref_grads

        times = []
        for _ in range(repeats):
            pipe.zero_grad()
            _sync(device)
            if kind == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            pipe.step(tokens, target=target)
            _sync(device)
            times.append(time.perf_counter() - t0)
        step, est = statistics.median(times), plan.estimates
        rows.append(("step time", "measured",
                     f"median {step * 1e3:.2f} ms of {repeats}; the plan's "
                     f"{est.step_time_s * 1e3:.2f} ms (measured / planned "
                     f"{step / est.step_time_s:.2f})"))
        if kind == "cuda":
            peak, planned = torch.cuda.max_memory_allocated(device), est.peak_bytes[0]
            rows.append(("peak memory", "measured",
                         f"{peak / 2**20:.0f} MiB allocated ("
                         f"{torch.cuda.max_memory_reserved(device) / 2**20:.0f} reserved); "
                         f"planned {planned / 2**20:.0f} MiB (measured / planned "
                         f"{peak / planned:.2f})"))
        else:
            rows.append(("peak memory", "skipped", "the CPU allocator keeps no peak"))

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ckpt")
            before = pipe.eval(tokens, target=target)
            pipe.save_checkpoint(path)
            other = pipeline(1)
            other.load_checkpoint(path)
            after = other.eval(tokens, target=target)
        rows.append(("checkpoint", "ok" if abs(after - before) <= 1e-6 else "FAIL",
                     f"eval loss {before:.6f} saved, {after:.6f} loaded"))
    finally:
        dist.destroy_process_group()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true",
                   help="run the checks on CPU (gloo), planning in-process")
    p.add_argument("--plan", default=None, help="the carried plan JSON (made by --make-plan)")
    p.add_argument("--make-plan", default=None, metavar="PATH",
                   help="make the GPU model's plan here (CPU, HiGHS) and save it; no checks")
    p.add_argument("--profile", default="H200", help="profile of --make-plan's plan")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    from autopp import PipelinePlan

    if args.make_plan:
        make_plan("cuda", args.profile, args.make_plan)
        print(f"saved the {args.profile} plan of the GPU check's model to {args.make_plan}")
        return
    kind = "cpu" if args.cpu else "cuda"
    if kind == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --cpu for the same checks on CPU")
    t0 = time.perf_counter()
    plan = PipelinePlan.load(args.plan) if args.plan else make_plan(kind, "CPU" if args.cpu
                                                                     else args.profile)
    rows = check(kind, plan, args.repeats)
    width = max(len(r[0]) for r in rows)
    print(f"autopp device check ({kind}, torch {torch.__version__}, "
          f"{time.perf_counter() - t0:.0f} s)")
    for name, result, figures in rows:
        print(f"  {name:{width}}  {result:8}  {figures}")
    if any(r[1] == "FAIL" for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
