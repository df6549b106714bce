"""``autopp``: plan a model's pipeline from the command line, on one machine, with no devices.

::

    autopp dry-run llama3:8B --pp 4 --dp 8 --tp 8 --global-batch 64 --seq-len 2048
    autopp search --hf-config qwen3-8b/config.json --world 64 --global-batch 256 --seq-len 8192
    autopp plan llama3:70B --world 512 --global-batch 512 --seq-len 8192 --save plan.json
    autopp show plan.json [--timeline step.png --model llama3:70B]

Four subcommands over the library's own functions (:func:`autopp.dry_run.dry_run`,
:func:`autopp.search`, :func:`autopp.layout_search.exact.plan_ranked`, :class:`autopp.PipelinePlan`)
on a model built on meta by :func:`autopp.models.build_meta_model`: the questions asked before
renting devices need no training script. Invariant: results go to stdout (text, or JSON with
``--json``), progress to stderr; a user error exits 2 with one line naming the fix.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

USER_ERRORS = (ValueError, ImportError, FileNotFoundError)
"""Errors whose message is the fix (printed as one line; AUTOPP_TRACEBACK=1 re-raises)."""


# ---- arguments ---------------------------------------------------------------------------

def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a torchtitan name (llama3:8B, llama3:debugmodel, deepseek_v3:671B, "
                        "qwen3:8B) or module:factory (a function returning the model)")
    p.add_argument("--hf-config", default=None, metavar="CONFIG.json",
                   help="a Hugging Face config.json instead (built on meta with "
                        "AutoModelForCausalLM.from_config, no weights; needs autopp[hf])")


def _batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--global-batch", type=int, required=True,
                   help="sequences per training step, over all dp ranks")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")


def _planner_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="H100",
                   help="device profile of the cost model (H100, H200, A100, A100-40GB, CPU)")
    p.add_argument("--mixed-precision", default="none", choices=["none", "bf16"],
                   help="bf16: bf16 compute, fp32 masters and gradient reduction")
    p.add_argument("--memory-reserve", type=float, default=0.1,
                   help="share of the device memory kept back from the plan")
    p.add_argument("--boundary", default="auto", choices=["auto", "batch", "batch+seq"],
                   help="placement of activations between stages")
    p.add_argument("--loss-parallel", default="auto", choices=["auto", "on", "off"],
                   help="keep the logits split on the vocabulary over tp for the loss")
    p.add_argument("--recompute", default="auto", choices=["auto", "none", "selective", "full"],
                   help="activation recomputation of planned stages (a search chooses its own)")
    p.add_argument("--weight-gathering", default="once_per_step",
                   choices=["once_per_step", "per_block"],
                   help="hold dp-sharded weights gathered for the whole step, or gather them "
                        "block by block as FSDP does (a search chooses per stage)")
    p.add_argument("--token-dispatch", default="auto", choices=["auto", "all_to_all", "all_gather"],
                   help="MoE layers: how tokens reach expert-parallel devices (auto: by price)")
    p.add_argument("--expert-dims", default="auto", choices=["auto", "dp", "tp", "dp*tp"],
                   help="MoE layers: the stage-mesh dims the routed experts are split over "
                        "(auto: the planner chooses)")
    p.add_argument("--expert-imbalance", type=float, default=1.0,
                   help="MoE layers: the busiest expert-parallel device's routed tokens over "
                        "the mean (1: uniform routing)")
    p.add_argument("--optimality-gap", type=float, default=None,
                   help="how close to the best possible a memory-bound stage plan must be "
                        "proven, e.g. 0.05 (default 0.01); larger plans faster")


def _layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--schedule", default="1F1B",
                   help="GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
                        "ZBVZeroBubble, DualPipeV, or a schedule .csv file")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per step (default: the number of stages, at least 1)")
    p.add_argument("--split", default=None,
                   help="stage split: a number of stages or a layout string such as "
                        "'Ettt|tttL' (default: uniform)")


def _output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, metavar="PATH.json",
                   help="write the simulated step as a Chrome/Perfetto trace")
    p.add_argument("--timeline", default=None, metavar="PATH.png",
                   help="draw the simulated step as a PNG timeline (needs autopp[plot])")


def _search_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", type=int, required=True, help="devices in all")
    p.add_argument("--top", type=int, default=10, help="ranked layouts printed")
    p.add_argument("--schedules", default=None,
                   help="comma-separated schedules to consider (default: the search's)")
    p.add_argument("--tp-sizes", default=None, help="comma-separated tp sizes to consider")
    p.add_argument("--pp-sizes", default=None, help="comma-separated pp sizes to consider")


def parser() -> argparse.ArgumentParser:
    """The ``autopp`` argument parser (one sub-parser per subcommand)."""
    top = argparse.ArgumentParser(
        prog="autopp", description="Plan pipeline x data x tensor parallel layouts of a "
        "model on one machine, with no devices (fake process group, simulated schedule).")
    top.add_argument("--json", action="store_true",
                     help="print one JSON document on stdout instead of text")
    top.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("dry-run", help="plan every stage of a given layout and simulate "
                       "its step: time and per-rank memory against the device's")
    _model_args(d)
    _layout_args(d)
    _batch_args(d)
    _planner_args(d)
    _output_args(d)
    d.add_argument("--save", default=None, metavar="PLAN.json", help="also save the plan")

    s = sub.add_parser("search", help="rank the layouts (pp x dp x tp, schedule, "
                       "microbatches, split, recomputation) for a number of devices")
    _model_args(s)
    _search_args(s)
    _batch_args(s)
    _planner_args(s)
    s.add_argument("--save", default=None, metavar="PLAN.json",
                   help="also plan the best layout exactly and save its plan")
    _output_args(s)

    p = sub.add_parser("plan", help="make a plan and save it: of a given layout (--pp/--dp/"
                       "--tp), or of the best layout the search finds (--world)")
    _model_args(p)
    _layout_args(p)
    p.add_argument("--world", type=int, default=None,
                   help="search the layout for this many devices instead of --pp/--dp/--tp")
    _batch_args(p)
    _planner_args(p)
    _output_args(p)
    p.add_argument("--save", required=True, metavar="PLAN.json", help="where to write it")

    w = sub.add_parser("show", help="describe a saved plan; --timeline draws its simulated "
                       "step (the model is needed for that)")
    w.add_argument("plan", help="a plan saved by `autopp plan --save` or report.plan.save")
    w.add_argument("--model", default=None, metavar="MODEL",
                   help="with --timeline: the model the plan was made for (a torchtitan "
                        "name or module:factory)")
    w.add_argument("--hf-config", default=None, metavar="CONFIG.json",
                   help="with --timeline: the model as a Hugging Face config.json")
    w.add_argument("--timeline", default=None, metavar="PATH.png",
                   help="draw the plan's simulated step (give the model too)")
    return top


# ---- helpers ----------------------------------------------------------------------------

def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, e.g. {flag} 1,2,4; got "
                         f"{text!r}") from None


def _model(args: argparse.Namespace) -> Any:
    from autopp.models import build_meta_model

    if args.model is None and args.hf_config is None:
        raise ValueError(f"autopp {args.command}: give the model: a torchtitan name "
                         "(llama3:8B), module:factory, or --hf-config PATH/config.json")
    if os.getcwd() not in sys.path:  # module:factory from the working folder, as python -m
        sys.path.insert(0, os.getcwd())
    return build_meta_model(args.model, hf_config=args.hf_config)


def mixed_precision_policy(name: str) -> Any:
    """torch's ``MixedPrecisionPolicy`` for ``--mixed-precision`` (None for "none")."""
    if name == "none":
        return None
    if name != "bf16":
        raise ValueError(f"--mixed-precision is 'none' or 'bf16', got {name!r}")
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _options(args: argparse.Namespace) -> Any:
    from autopp.plan.options import PlannerOptions

    return PlannerOptions(
        profile=args.profile, boundary=args.boundary,
        loss_parallel={"auto": None, "on": True, "off": False}[args.loss_parallel],
        mixed_precision=mixed_precision_policy(args.mixed_precision),
        memory_reserve=args.memory_reserve, recompute=args.recompute,
        weight_gathering=args.weight_gathering, token_dispatch=args.token_dispatch,
        expert_dims=args.expert_dims, expert_imbalance=args.expert_imbalance,
        optimality_gap=args.optimality_gap)


def _priced_options(args: argparse.Namespace) -> Any:
    """The options the search prices layouts under (autopp.layout_search.search.SEARCH_PRICES);
    --boundary and --loss-parallel apply when its chosen layout is planned exactly."""
    from autopp.plan.options import PlannerOptions

    o = _options(args)
    return PlannerOptions(profile=o.profile, mixed_precision=o.mixed_precision,
                          memory_reserve=o.memory_reserve, token_dispatch=o.token_dispatch,
                          expert_dims=o.expert_dims, expert_imbalance=o.expert_imbalance)


def _split(text: str | None) -> Any:
    return int(text) if text is not None and text.isdigit() else text


def _need_plot(args: argparse.Namespace) -> None:
    if getattr(args, "timeline", None):
        from autopp.extras import require

        require("plot", for_what="--timeline")


def _dry_run(args: argparse.Namespace, model: Any) -> Any:
    from autopp.dry_run import dry_run

    for flag in ("pp", "dp", "tp"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} is a degree >= 1, got {getattr(args, flag)}")
    return dry_run(model, pp=args.pp, dp=args.dp, tp=args.tp, schedule=args.schedule,
                   n_microbatches=args.microbatches or max(args.pp, 1),
                   global_batch=args.global_batch, seq_len=args.seq_len,
                   split=_split(args.split), trace=args.trace, timeline=args.timeline,
                   options=_options(args))


def _search(args: argparse.Namespace, model: Any) -> Any:
    from autopp.layout_search import DEFAULT_SCHEDULES
    from autopp.layout_search.search import search

    schedules = (tuple(x.strip() for x in args.schedules.split(",") if x.strip())
                 if args.schedules else DEFAULT_SCHEDULES)
    return search(model, world_size=args.world, global_batch=args.global_batch,
                  seq_len=args.seq_len, options=_priced_options(args), schedules=schedules,
                  tp_sizes=_ints(args.tp_sizes, "--tp-sizes"),
                  pp_sizes=_ints(args.pp_sizes, "--pp-sizes"), max_results=max(args.top, 1))


def _exact(args: argparse.Namespace, report: Any) -> Any:
    from autopp.layout_search.exact import plan_ranked

    exact = plan_ranked(report, trace=args.trace, timeline=args.timeline,
                        options=_options(args))
    for line in exact.skipped:
        logging.getLogger("autopp.cli").warning("skipped: %s", line)
    if exact.report is None:
        raise ValueError("none of the best-ranked layouts has an exact plan that fits "
                         "(above); raise --world or lower --global-batch / --seq-len")
    return exact


# ---- JSON views --------------------------------------------------------------------------

def dry_run_json(report: Any) -> dict[str, Any]:
    """A dry run's figures as JSON values (seconds, bytes)."""
    return {
        "pp": report.pp, "dp": report.dp, "tp": report.tp, "schedule": report.schedule,
        "n_microbatches": report.n_microbatches, "global_batch": report.global_batch,
        "seq_len": report.seq_len, "profile": report.profile,
        "step_time_s": report.step_time_s, "bubble_fraction": report.bubble_fraction,
        "peak_bytes": list(report.peak_bytes()), "usable_bytes": report.usable_bytes,
        "fits": list(report.fits()),
        "stages": [{"index": s.index, "pp_rank": s.pp_rank, "modules": s.modules,
                    "time_s": s.time_s, "send_bytes": s.send_bytes,
                    "param_bytes_per_device": s.plan.param_bytes_per_device}
                   for s in report.stages],
        "wall_s": report.wall_s,
    }


def search_json(report: Any, top: int) -> dict[str, Any]:
    """A search's ranking as JSON values."""
    return {
        "world_size": report.world_size, "global_batch": report.global_batch,
        "seq_len": report.seq_len, "profile": report.profile,
        "n_evaluated": report.n_evaluated, "search_s": report.search_s,
        "results": [{"rank": i + 1, "layout": str(c.layout), "pp": c.layout.pp,
                     "dp": c.layout.dp, "tp": c.layout.tp, "schedule": c.layout.schedule,
                     "n_microbatches": c.layout.n_microbatches,
                     "layers_per_stage": list(c.layers_per_stage),
                     "recompute": list(c.recompute),
                     "weight_gathering": list(c.weight_gathering), "experts": list(c.experts),
                     "step_time_s": c.step_time_s,
                     "bubble_fraction": c.bubble_fraction,
                     "tokens_per_s_per_device": c.tokens_per_s_per_device, "mfu": c.mfu,
                     "peak_bytes": list(c.peak_bytes), "usable_bytes": c.usable_bytes}
                    for i, c in enumerate(report.results[:top])],
        "rejected": len(report.rejected),
        "no_fit": None if report.results else report.no_fit_message(),
    }


def plan_json(plan: Any) -> dict[str, Any]:
    """A plan's layout and estimates as JSON values (the whole plan: ``plan.to_json()``)."""
    e = plan.estimates
    return {
        "model": plan.model, "pp": plan.pp, "dp": plan.dp, "tp": plan.tp,
        "schedule": plan.schedule, "n_microbatches": plan.n_microbatches,
        "n_stages": plan.n_stages, "fqns_per_stage": [list(f) for f in plan.fqns_per_stage],
        "stage_ranks": list(plan.stage_ranks), "boundaries": list(plan.boundaries),
        "recompute": list(plan.recompute), "profile": plan.options.profile,
        "estimates": None if e is None else {
            "step_time_s": e.step_time_s, "bubble_fraction": e.bubble_fraction,
            "peak_bytes": list(e.peak_bytes), "usable_bytes": e.usable_bytes,
            "fits": list(e.fits)},
    }


# ---- subcommands -------------------------------------------------------------------------

def cmd_dry_run(args: argparse.Namespace) -> dict[str, Any] | str:
    _need_plot(args)
    report = _dry_run(args, _model(args))
    saved = str(report.plan.save(args.save)) if args.save else None
    if args.json:
        return {**dry_run_json(report), "saved": saved, "timeline": args.timeline,
                "trace": args.trace}
    return str(report) + (f"\nplan written to {saved}" if saved else "")


def cmd_search(args: argparse.Namespace) -> dict[str, Any] | str:
    _need_plot(args)
    report = _search(args, _model(args))
    if not report.results:
        raise ValueError(report.no_fit_message())
    exact = _exact(args, report) if args.save else None
    saved = str(exact.report.plan.save(args.save)) if exact else None
    if args.json:
        return {**search_json(report, args.top), "saved": saved,
                "saved_rank": None if exact is None else exact.rank + 1}
    text = f"{report}\n" if args.top == 10 else (str(report).replace(
        report.table(), report.table(args.top)) + "\n")
    if exact is not None:
        text += (f"\nlayout {exact.rank + 1} of the ranking, planned exactly:\n"
                 f"{exact.report}\nplan written to {saved}")
    return text.rstrip("\n")


def cmd_plan(args: argparse.Namespace) -> dict[str, Any] | str:
    _need_plot(args)
    model = _model(args)
    if args.world is not None:
        exact = _exact(args, _search(_with(args, top=10), model))
        report = exact.report
    else:
        report = _dry_run(args, model)
    saved = str(report.plan.save(args.save))
    if args.json:
        return {**plan_json(report.plan), "saved": saved}
    return f"{report.plan.describe()}\nplan written to {saved}"


def _with(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def cmd_show(args: argparse.Namespace) -> dict[str, Any] | str:
    from autopp.plan.value import PipelinePlan

    if not os.path.isfile(args.plan):
        raise FileNotFoundError(f"{args.plan}: no such plan file; write one with "
                                "`autopp plan MODEL ... --save PLAN.json`")
    plan = PipelinePlan.load(args.plan)
    drawn = None
    if args.timeline:
        _need_plot(args)
        if args.model is None and args.hf_config is None:
            raise ValueError("show --timeline re-simulates the plan's step from its stages: "
                             "give the model it was made for too (--model MODEL or --hf-config PATH)")
        drawn = str(timeline_of_plan(plan, _model(args), args.timeline))
    if args.json:
        return {**plan_json(plan), "timeline": drawn}
    return plan.describe() + (f"\nsimulated step drawn in {drawn}" if drawn else "")


def timeline_of_plan(plan: Any, model: Any, path: str | os.PathLike) -> Any:
    """Simulate ``plan``'s step from its stages (lowered on a fake world, as the dry run
    prices them) and draw it as a PNG at ``path``."""
    import torch.distributed as dist

    from autopp.estimate.pipeline import simulate_stages, stage_estimate
    from autopp.mesh import build_world_mesh, init_fake_world, stage_sub_mesh
    from autopp.plan.value import structure_difference
    from autopp.schedules import write_timeline_png
    from autopp.stage_split import build_stage_module

    if plan.mismatches(model=model):
        raise ValueError(f"the plan was made for another model: "
                         f"{structure_difference(plan.model_structure, model) or plan.model}; "
                         "give the model it was made for")
    created = not dist.is_initialized()
    if created:
        init_fake_world(plan.pp * plan.dp * plan.tp)
    try:
        sub_mesh = stage_sub_mesh(build_world_mesh(pp=plan.pp, dp=plan.dp, tp=plan.tp,
                                                   device_type="cpu"))
        memo: dict = {}
        costs = [stage_estimate(build_stage_module(model, list(f), allow_tied=True), splan,
                                sub_mesh, plan.stage_example_inputs(s), plan.n_microbatches,
                                mode="graphs", loss_s=splan.loss_s,
                                send_bytes=plan.send_bytes[s], memo=memo)[1]
                 for s, (f, splan) in enumerate(zip(plan.fqns_per_stage, plan.stage_plans))]
    finally:
        if created:
            dist.destroy_process_group()
    sim = simulate_stages(plan.schedule, costs, pp=plan.pp, n_microbatches=plan.n_microbatches,
                          stage_ranks=plan.stage_ranks, profile=plan.options.profile,
                          mesh_shape=(plan.pp, plan.dp, plan.tp))
    return write_timeline_png(sim, path)


def skip_exit_collection() -> None:
    """Leave the interpreter's final garbage collections nothing to walk (``gc.freeze``).
    Why: planning leaves about a million objects (traces, plans, caches), and collecting
    them at exit takes seconds after the answer is printed. Call it last in a process that
    ends when planning does: frozen objects are never finalized (the OS takes the memory;
    autopp writes its files in ``with`` blocks, and logging flushes at exit regardless)."""
    gc.freeze()


COMMANDS = {"dry-run": cmd_dry_run, "search": cmd_search, "plan": cmd_plan, "show": cmd_show}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``autopp`` with ``argv`` (default: the process's); returns the exit status."""
    args = parser().parse_args(argv)
    if not args.quiet:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="[autopp %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    try:
        out = COMMANDS[args.command](args)
    except USER_ERRORS as e:
        if os.environ.get("AUTOPP_TRACEBACK"):
            raise
        print(f"autopp {args.command}: error: {e}", file=sys.stderr)
        return 2
    if isinstance(out, dict):
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(out)
    sys.stdout.flush()
    if argv is None:  # the process's own command: it ends here
        skip_exit_collection()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
