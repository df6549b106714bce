"""The prepared device check (``scripts/gpu_check.sh``): what one GPU must confirm before
autopp's GPU figures are trusted, in one process, printed as one table.

The GPU machine this project is sometimes lent has no torchtitan, no HiGHS and no network,
so the model is a pure-torch Hugging Face style decoder (``tests/harness/models.py``) and the plans
are made here, on CPU, and carried as JSON (``--make-plans``); the device only applies them:

    .venv/bin/python benchmarks/gpu_check.py --make-plans benchmarks   # here, with HiGHS
    python benchmarks/gpu_check.py                  # on the GPU: the plans in benchmarks/
    .venv/bin/python benchmarks/gpu_check.py --cpu  # the same checks on CPU (gloo),
                                                    # planning in-process (wide test)

Three pipelines of the one model on the one device (:data:`PIPELINES`): GPipe in fp32 (one
stage), ZBVZeroBubble in fp32 (two stages on the one rank: same-rank hand-off, input and
weight gradients split), and 1F1B under bf16 compute with fp32 masters, the last also with
its stage graphs compiled by Inductor (``compile=True``: on CUDA with collective bucketing
and reordering on).

Rows (check, result, figures):

1. ``device``: the profile autopp detects for the device (an H200 must not be planned as
   an 80 GB H100) and the mesh's device type under the process group's backend.
2. ``attention``: autopp's attention op forward + backward against torch's own SDPA under
   autograd, on the device: time, allocator peak (CUDA), largest gradient difference, the
   FLOP rate by the op's registered FLOPs; unmasked causal, and with a padding + causal
   mask per sequence (the kernel torch picks and the one autopp runs named).
3. ``parity <pipeline>``: the planned pipeline (a carried plan, ``plan=``) runs a step; its
   loss and every gradient against the plain model on the same device. fp32 (TF32 off,
   torch's default): the suite's parity metric (per tensor ‖g − r‖ / max(‖r‖, 1e-3)
   ≤ 1e-5). bf16: every gradient within 2% of the plain model run on bf16 copies of its
   fp32 parameters, and most of them nearer to it than to the fp32 run's (compiled: the 2%
   alone, since Inductor rounds a fused chain of elementwise ops once).
4. ``step <pipeline>``: the median of ``--repeats`` steps against the plan's simulated step,
   and against the plain model's forward + backward in eager torch over the same
   microbatches (same FLOPs and kernels, no pipeline: what autopp's runtime adds).
5. ``peak <pipeline>``: ``torch.cuda.max_memory_allocated`` over the timed steps, less what
   was allocated before the pipeline was built (the references' gradients), and the
   reserved peak, against the plan's predicted peak less its optimizer state (the check
   takes no optimizer step) (CUDA only).
6. ``checkpoint``: a DCP save and load on the device (NCCL all-reduces the finiteness
   flag on the device) and the loaded pipeline's eval loss (first pipeline).
7. ``profile``: the device's rates measured on one rank (``measure_profile(world_size=1)``:
   fp32, TF32 and bf16 matmuls, memory copy) against those the plans were priced with (the
   built-in profile's peak x its compute efficiency); ``--save-profile`` stores the
   measurement as JSON, so the plans can be re-priced with it where HiGHS is.

Parity, attention and checkpoint fail the script above their bounds; the ratios are
measurements.
"""

from __future__ import annotations

import argparse
import gc
import math
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
         # --large: two blocks of llama3-70B's width (dim 8192, 64 heads, MLP 28672; no
         # GQA in this model) at seq 8192, where kernels are long enough to hide launches
         "cuda-large": dict(vocab=32000, dim=8192, n_layers=2, n_heads=64, hidden=28672,
                            max_seq=8192),
         "cpu": dict(vocab=2048, dim=64, n_layers=4, n_heads=4, hidden=128, max_seq=64)}
BATCH = {"cuda": (8, 2048), "cuda-large": (2, 8192), "cpu": (8, 64)}
#: The pipelines --large runs (fp32 steps of that size take seconds each).
LARGE = ("bf16", "bf16-compiled")
#: The checked pipelines: name -> (schedule, microbatches, bf16 compute). The first is the
#: strict fp32 parity check and runs the checkpoint round trip.
PIPELINES = {"gpipe": ("GPipe", 2, False), "zbv": ("ZBVZeroBubble", 4, False),
             "bf16": ("1F1B", 2, True)}
#: Pipelines also run with Inductor (``compile=True``), from the same plan: name -> plan's.
COMPILED = {"bf16-compiled": "bf16"}
PLAN_DIR = Path(__file__).resolve().parent


def plan_path(name: str, directory: str | os.PathLike = PLAN_DIR, kind: str = "cuda") -> Path:
    """Where pipeline ``name``'s carried plan lies (the first keeps its old file name)."""
    if kind == "cuda-large":
        return Path(directory) / f"gpu_check_plan_large_{name}.json"
    return Path(directory) / ("gpu_check_plan.json" if name == "gpipe"
                              else f"gpu_check_plan_{name}.json")


def _model(kind: str) -> torch.nn.Module:
    from tests.harness.models import HFForCausalLM

    with torch.device("meta"):
        return HFForCausalLM(**SIZES[kind])


def _bf16_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def make_plan(kind: str, profile: str, name: str):
    """The pp1 x dp1 x tp1 plan of the checked model for pipeline ``name`` (a dry run on the
    fake process group): its PipelinePlan, with the simulator's estimates."""
    from autopp.backends import PlannerOptions
    from autopp.dry_run import dry_run

    schedule, microbatches, bf16 = PIPELINES[name]
    batch, seq = BATCH[kind]
    options = PlannerOptions(profile=profile, mixed_precision=_bf16_policy() if bf16 else None)
    return dry_run(_model(kind), pp=1, dp=1, tp=1, schedule=schedule,
                   n_microbatches=microbatches, global_batch=batch, seq_len=seq,
                   options=options).plan


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


#: Attention shapes (b, h, s, d), dtypes and whether masked, that the attention row times:
#: on CUDA also a llama3-70B-like head size at seq 8192 in bf16, the training case the cost
#: model prices, and a padding + causal mask per sequence (:func:`_padding_mask`) at a
#: sequence length not a multiple of 16 (the memory-efficient kernel's bias alignment).
ATTENTION_CASES = {"cuda": (((1, 16, 4096, 64), torch.float32, False),
                            ((1, 32, 8192, 128), torch.bfloat16, False),
                            ((2, 16, 1000, 64), torch.bfloat16, True)),
                   "cpu": (((1, 4, 512, 32), torch.float32, False),
                           ((2, 4, 500, 32), torch.float32, True))}


def _padding_mask(b: int, s: int, device: torch.device) -> torch.Tensor:
    """Causal and right padding (row i of the batch loses its last ``100 * i`` keys), one
    boolean ``(b, 1, s, s)`` mask per sequence; every query keeps key 0 (no empty row)."""
    from autopp.ops.attention import keep_mask

    valid = torch.ones(b, s, device=device)
    for i in range(b):
        valid[i, s - 100 * i:] = 0
    return keep_mask(s, s, device=device, key_valid=valid)


def _attention_row(device: torch.device) -> tuple[str, str, str]:
    """Row 2: autopp's attention op forward + backward against torch's SDPA under autograd:
    median time, CUDA allocator peak, largest gradient difference, and the FLOP rate the
    op reaches by its registered FLOPs (what the cost model divides by the profile's)."""
    import autopp.ops.attention  # noqa: F401  (registers autopp::sdpa)
    from torch.utils.flop_counter import FlopCounterMode

    from autopp._compat import attention as fused

    worst, cases = 0.0, []
    for shape, dtype, masked in ATTENTION_CASES[device.type]:
        b, h, s, d = shape
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(shape, device=device, dtype=dtype)
        mask = _padding_mask(b, s, device) if masked else None
        causal = not masked  # the mask holds the causal part

        def run(op):
            out = op(q, k, v)
            return torch.autograd.grad(out, (q, k, v), g)

        ours = lambda q, k, v: torch.ops.autopp.sdpa(  # noqa: E731
            q, k, v, causal, d ** -0.5, False, mask)[0]
        theirs = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
            q, k, v, attn_mask=mask, is_causal=causal)
        with torch.no_grad():
            pick = fused.torch_choice(q, k, v, causal, d ** -0.5, mask)
            runs = fused.fused_backend(q, k, v, causal, d ** -0.5, mask)
        kernel = (f"torch picks {pick.name}, autopp runs "
                  + (runs.name if runs is not None else "torch's SDPA (fallback)"))
        with FlopCounterMode(display=False) as counter:
            run(ours)
        flops = counter.get_total_flops()
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
            t = statistics.median(times)
            peak = (f", peak {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB"
                    if device.type == "cuda" else "")
            rate = f", {flops / t / 1e12:.3g} TFLOP/s by its FLOPs" if name == "autopp" else ""
            figures.append(f"{name} {t * 1e3:.2f} ms{peak}{rate}")
        err = max(float((a - b).abs().max()) for a, b in zip(run(ours), run(theirs)))
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        worst = max(worst, err / tol if math.isfinite(err) else math.inf)  # NaN fails
        cases.append(f"{shape} {str(dtype).removeprefix('torch.')}"
                     f"{' masked' if masked else ''} ({kernel}): {'; '.join(figures)}; "
                     f"max |grad diff| {err:.1e}")
    return ("attention", "ok" if worst <= 1 else "FAIL",
            "causal fwd+bwd " + " | ".join(cases))


def _profile_row(kind: str, priced_with: str, save: str | None) -> tuple[str, str, str]:
    """Row 7: measured rates against the plan's profile (before any process group exists
    here: the measurement starts its own rank process)."""
    from autopp.profiles.devices import save_profile
    from autopp.profiles.lookup import get_profile
    from autopp.profiles.measure import measure_profile

    measured, priced = measure_profile(world_size=1, device=kind.split("-")[0], cache=False), \
        get_profile(priced_with)
    if save:
        save_profile(measured, Path(save))

    def rate(p, attr):
        value = getattr(p, attr)
        return None if value is None else value * (p.compute_efficiency if attr != "mem_bw"
                                                   else 1.0)

    figures = []
    for attr, unit in (("flops_fp32", "TFLOP/s"), ("flops_tf32", "TFLOP/s"),
                       ("flops_bf16", "TFLOP/s"), ("mem_bw", "TB/s")):
        m, p = rate(measured, attr), rate(priced, attr)
        if m is None or p is None:
            continue
        figures.append(f"{attr} {m / 1e12:.3g} vs {p / 1e12:.3g} {unit} ({m / p:.2f})")
    return ("profile", "measured", f"measured vs {priced.name}'s priced: " + "; ".join(figures))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reference(kind: str, device: torch.device, tokens, target, param_dtype=None):
    """The plain model's loss and gradients on ``device`` (seed 0), with the forward on
    ``param_dtype`` copies of its fp32 parameters when given (plain torch: gradients flow
    back to the fp32 masters)."""
    from autopp import init_module_
    from tests.harness.models import ce_loss

    ref = init_module_(_model(kind), seed=0, device=device)
    params = None if param_dtype is None else \
        {n: p.to(param_dtype) for n, p in ref.named_parameters()}
    logits = ref(tokens) if params is None else torch.func.functional_call(ref, params,
                                                                           (tokens,))
    loss = ce_loss(logits, target)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.named_parameters()}


def _timed(device: torch.device, fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _plain_step(kind: str, device: torch.device, tokens, target, microbatches: int,
                param_dtype=None):
    """One training step's forward + backward of the plain model in eager torch, over the
    same microbatches (gradients accumulated), as a function to time: the yardstick for
    autopp's step on one device (no parallelism: same FLOPs, same kernels)."""
    from autopp import init_module_
    from tests.harness.models import ce_loss

    model = init_module_(_model(kind), seed=0, device=device)

    def step():
        model.zero_grad(set_to_none=False)
        for tok, tgt in zip(tokens.chunk(microbatches), target.chunk(microbatches)):
            if param_dtype is None:
                logits = model(tok)
            else:
                params = {n: p.to(param_dtype) for n, p in model.named_parameters()}
                logits = torch.func.functional_call(model, params, (tok,))
            (ce_loss(logits, tgt) / microbatches).backward()
    return step


def _trace(device: torch.device, fn, path: Path) -> None:
    """The profiler's table of one ``fn()`` (ops by device time), written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=60))


def _parity_row(name: str, bf16: bool, loss: float, grads: dict, refs: dict,
                compiled: bool = False):
    from tests.harness.parity import relative_error

    ref_loss, ref_grads = refs["fp32"]
    if set(grads) != set(ref_grads):
        return (f"parity {name}", "FAIL", f"gradients of {sorted(set(grads) ^ set(ref_grads))}"
                " missing on one side")
    if not bf16:
        errs = {n: relative_error(g, ref_grads[n]) for n, g in grads.items()}
        worst = max(errs, key=errs.get)
        ok = errs[worst] <= 1e-5 and abs(loss - ref_loss) <= 1e-5
        return (f"parity {name}", "ok" if ok else "FAIL",
                f"loss {loss:.6f} vs {ref_loss:.6f}; worst gradient {worst} rel "
                f"{errs[worst]:.1e} of {len(errs)} tensors")
    loss16, grads16 = refs["bf16"]
    errs = {n: float((g - grads16[n]).norm() / grads16[n].norm()) for n, g in grads.items()}
    nearer = sum(errs[n] < float((g - ref_grads[n]).norm() / ref_grads[n].norm())
                 for n, g in grads.items())
    worst = max(errs, key=errs.get)
    # Inductor computes a fused chain of bf16 elementwise ops in fp32 and rounds once, so a
    # compiled step sits between the eager bf16 run and the fp32 one: only the 2% bound
    ok = errs[worst] < 0.02 and (compiled or nearer >= 0.75 * len(grads))
    return (f"parity {name}", "ok" if ok else "FAIL",
            f"loss {loss:.6f} vs bf16 run {loss16:.6f} (fp32 {ref_loss:.6f}); worst gradient "
            f"{worst} rel {errs[worst]:.1e} to the bf16 run; {nearer} of {len(grads)} nearer "
            "to it than to the fp32 run")


def check(kind: str, plans: dict, repeats: int,
          trace: str | None = None) -> list[tuple[str, str, str]]:
    """Rows 1-6 on device ``kind`` with ``plans`` (name in :data:`PIPELINES` -> the plan
    made for this model and batch); ``trace``: a folder for the profiler's op tables of
    each pipeline's step and of the plain model's."""
    from autopp import build_world_mesh, pipeline_autoparallel
    from autopp.backends import Planner, PlannerOptions
    from autopp.profiles.devices import profile_for_device
    from tests.harness.models import ce_loss, make_batch

    dev = kind.split("-")[0]  # "cuda-large": the larger model on CUDA
    device = torch.device("cuda", torch.cuda.current_device()) if dev == "cuda" \
        else torch.device("cpu")
    rows = []
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl" if dev == "cuda" else "gloo", rank=0, world_size=1)
    try:
        mesh = build_world_mesh(pp=1, dp=1, tp=1)
        name = torch.cuda.get_device_name(device) if dev == "cuda" else "cpu"
        detected = profile_for_device(dev)
        profiles = sorted({p.options.profile for p in plans.values()})
        rows.append(("device", "ok" if mesh.device_type == dev else "FAIL",
                     f"{name}: profile {detected} (the plans': {', '.join(profiles)}); mesh "
                     f"device {mesh.device_type} under {dist.get_backend()}"))
        rows.append(_attention_row(device))

        batch, seq = BATCH[kind]
        tokens, target = (t.to(device) for t in make_batch(batch, seq, vocab=SIZES[kind]["vocab"]))
        refs = {"fp32": _reference(kind, device, tokens, target)}
        if any(PIPELINES[COMPILED.get(n, n)][2] for n in plans):
            refs["bf16"] = _reference(kind, device, tokens, target, torch.bfloat16)

        def pipeline(plan, seed: int, compile: bool = False):
            pipe = pipeline_autoparallel(
                _model(kind), mesh, example_inputs=(tokens,), loss_fn=ce_loss,
                schedule=plan.schedule, n_microbatches=plan.n_microbatches,
                parallelize=Planner(PlannerOptions(), plan=plan, compile=compile))
            pipe.init_weights(seed=seed)
            return pipe

        for i, (pname, plan) in enumerate(plans.items()):
            if dev == "cuda":  # what earlier pipelines left is not this one's
                gc.collect()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated(device)
            pipe = pipeline(plan, 0, compile=pname in COMPILED)
            loss = pipe.step(tokens, target=target)
            grads = {n: _full(p.grad) for n, p in pipe.named_parameters()}
            bf16 = PIPELINES[COMPILED.get(pname, pname)][2]
            rows.append(_parity_row(pname, bf16, loss, grads, refs, pname in COMPILED))
            del grads

            def autopp_step(pipe=pipe):
                pipe.zero_grad()
                pipe.step(tokens, target=target)

            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            step, est = _timed(device, autopp_step, repeats), plan.estimates
            # the pipeline's own peak: the allocator's, less what was held before it was built
            # (the references' gradients)
            peak_bytes = torch.cuda.max_memory_allocated(device) - base if dev == "cuda" else 0
            peak_reserved = torch.cuda.max_memory_reserved(device) if dev == "cuda" else 0
            plain = _plain_step(kind, device, tokens, target, plan.n_microbatches,
                                torch.bfloat16 if bf16 else None)
            plain_s = _timed(device, plain, repeats)
            if trace:
                _trace(device, autopp_step, Path(trace) / f"{pname}_autopp_ops.txt")
                _trace(device, plain, Path(trace) / f"{pname}_plain_ops.txt")
            del plain
            rows.append((f"step {pname}", "measured",
                         f"{plan.schedule}, {plan.n_microbatches} microbatches, "
                         f"{len(plan.fqns_per_stage)} stage(s): median {step * 1e3:.2f} ms of "
                         f"{repeats}; the plan's {est.step_time_s * 1e3:.2f} ms (measured / "
                         f"planned {step / est.step_time_s:.2f}); the plain model in eager "
                         f"torch {plain_s * 1e3:.2f} ms (autopp / plain {step / plain_s:.2f})"))
            if dev == "cuda":
                # the check takes no optimizer step, so the optimizer state the plan counts
                # (Adam's two moments) is never allocated
                optimizer = dict(est.memory_at_peak[0]).get("optimizer", 0)
                planned = est.peak_bytes[0] - optimizer
                rows.append((f"peak {pname}", "measured",
                             f"{peak_bytes / 2**20:.0f} MiB allocated over the timed steps, "
                             f"beyond the {base / 2**20:.0f} MiB held before ("
                             f"{peak_reserved / 2**20:.0f} reserved); planned "
                             f"{planned / 2**20:.0f} MiB without the "
                             f"{optimizer / 2**20:.0f} MiB optimizer state (measured / planned "
                             f"{peak_bytes / planned:.2f})"))
            if i == 0:
                with tempfile.TemporaryDirectory() as tmp:
                    path = os.path.join(tmp, "ckpt")
                    before = pipe.eval(tokens, target=target)
                    pipe.save_checkpoint(path)
                    other = pipeline(plan, 1, compile=pname in COMPILED)
                    other.load_checkpoint(path)
                    after = other.eval(tokens, target=target)
                    del other
                rows.append(("checkpoint", "ok" if abs(after - before) <= 1e-6 else "FAIL",
                             f"eval loss {before:.6f} saved, {after:.6f} loaded"))
            del pipe, autopp_step
            if dev == "cuda":
                torch.cuda.empty_cache()
        if dev != "cuda":
            rows.append(("peak", "skipped", "the CPU allocator keeps no peak"))
    finally:
        dist.destroy_process_group()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true",
                   help="run the checks on CPU (gloo), planning in-process unless --plans")
    p.add_argument("--plans", default=None, metavar="DIR",
                   help="the carried plans' folder (default on CUDA: benchmarks/)")
    p.add_argument("--make-plans", default=None, metavar="DIR",
                   help="make the plans here (HiGHS) and save them in DIR (the GPU model's; "
                        "with --cpu the CPU model's); no checks")
    p.add_argument("--large", action="store_true",
                   help="the larger model (two llama3-70B-wide blocks, seq 8192) on CUDA, "
                        f"pipelines {', '.join(LARGE)}")
    p.add_argument("--only", default=None, help="comma-separated pipelines of "
                   f"{', '.join([*PIPELINES, *COMPILED])} (default: all)")
    p.add_argument("--profile", default="H200", help="profile of --make-plans' GPU plans")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--save-profile", default=None, metavar="PATH",
                   help="store the device's measured profile (row 7) as JSON here")
    p.add_argument("--no-measure", action="store_true", help="leave out row 7")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write the profiler's op tables of each step (autopp's and the plain "
                        "model's) to DIR")
    args = p.parse_args()
    from autopp import PipelinePlan

    kind = "cpu" if args.cpu else "cuda-large" if args.large else "cuda"
    names = args.only.split(",") if args.only else list(LARGE) if args.large \
        else [*PIPELINES, *COMPILED]
    profile = "CPU" if args.cpu else args.profile
    if args.make_plans:
        for name in (n for n in names if n in PIPELINES):
            path = plan_path(name, args.make_plans, kind)
            make_plan(kind, profile, name).save(path)
            print(f"saved the {profile} plan of the check's {name} pipeline to {path}")
        return
    if kind != "cpu" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --cpu for the same checks on CPU")
    t0 = time.perf_counter()
    plan_dir = args.plans or (None if args.cpu else PLAN_DIR)
    made = {}
    for name in names:
        of = COMPILED.get(name, name)
        if of not in made:
            made[of] = PipelinePlan.load(plan_path(of, plan_dir, kind)) if plan_dir \
                else make_plan(kind, profile, of)
    plans = {name: made[COMPILED.get(name, name)] for name in names}
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
    rows = check(kind, plans, args.repeats, args.trace)
    if not args.no_measure:
        rows.append(_profile_row(kind, plans[names[0]].options.profile, args.save_profile))
    width = max(len(r[0]) for r in rows)
    print(f"autopp device check ({kind}, torch {torch.__version__}, "
          f"{time.perf_counter() - t0:.0f} s)")
    for name, result, figures in rows:
        print(f"  {name:{width}}  {result:8}  {figures}")
    if any(r[1] == "FAIL" for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
