"""autopp.search's predicted step times against step times measured on this machine.

    .venv/bin/python benchmarks/search_vs_measured.py       # debugmodel, 16 x 256, 8 configs

Do not wrap the whole script in ``flock``: it takes the lock itself (``--lock``, default
``/tmp/autopp-mp.lock``) around its CPU-heavy phases: while it measures (or reads) the
profile, searches and plans, and around each training launch (``flock LOCK torchrun ...``).

1. The device profile of this machine, ``profile="measure"`` (8 gloo ranks; measured once,
   then read from ``~/.cache/autopp/profiles``).
2. :func:`autopp.search` for llama3 ``--model`` (the example's ``build_model``) on 8 devices,
   global batch ``--batch-size`` x ``--seq-len``, schedules 1F1B, Interleaved1F1B,
   ZBVZeroBubble and GPipe, ``--microbatch-choices`` microbatch counts per layout.
3. ``--configs`` different layouts from its ranking: the search's rank 1, then one per
   equal slice of the rest of the ranking, each the candidate of its slice that adds the
   most variety (a pp x dp x tp, schedule or microbatch count not picked yet). Each is
   planned exactly (``report.plan(i)``) and its plan saved as JSON.
4. Each plan is trained for ``--steps`` steps by ``examples/llama3_pp_dp_tp.py --plan``
   on 8 gloo processes (one launch per configuration, one after the other); the measured
   step is the median of steps 2..N (the first step builds the schedule). It includes the
   gradient clipping and the AdamW step, which the prediction leaves out. A configuration
   that fails is reported and replaced by the next candidate of its slice.
5. A table (configuration, predicted step of the search, of the exact plan, measured
   median, measured / predicted), the Spearman rank correlation between the search's
   predictions and the measurements (average ranks for ties) and whether the search's
   rank-1 configuration is within 10% of the fastest measured; written as markdown to
   ``--out`` and as JSON beside it (same name, ``.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "llama3_pp_dp_tp.py"
WORLD = 8
SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "GPipe")
STEP_RE = re.compile(r"^step\s+(\d+)\s.*step_time\s+([0-9.]+)s", re.M)
DONE_RE = re.compile(r"^done: (\d+) steps, median step ([0-9.]+)s", re.M)
ERROR_RE = re.compile(r"\b[A-Za-z]*(Error|Exception)\b: ")
TOP1_TOLERANCE = 0.10


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="debugmodel")
    p.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=6,
                   help="training steps per configuration (median of steps 2..N)")
    p.add_argument("--configs", type=int, default=8,
                   help="configurations measured (the search's rank 1 and configs - 1 more)")
    p.add_argument("--indices", default=None,
                   help="comma-separated 1-based search ranks to measure instead of the "
                        "automatic pick (rank 1 is always added)")
    p.add_argument("--microbatch-choices", type=int, default=3,
                   help="microbatch counts the search tries per layout")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--out", default="/tmp/search_vs_measured.md",
                   help="markdown table (and JSON beside it, same name with .json)")
    p.add_argument("--workdir", default=None,
                   help="where plans and launch logs go (default: a new temporary folder)")
    p.add_argument("--lock", default="/tmp/autopp-mp.lock",
                   help="file lock held while measuring, searching and each launch runs "
                        "('' for none)")
    p.add_argument("--launch-timeout", type=float, default=300.0,
                   help="seconds before a launch is stopped and counted as failed")
    p.add_argument("--plan-only", action="store_true",
                   help="search, pick and plan, but launch nothing")
    return p.parse_args()


@contextlib.contextmanager
def file_lock(path: str):
    """Hold ``path``'s flock (the lock ``flock(1)`` takes) for the block; no-op for ''."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        t0 = time.perf_counter()
        fcntl.flock(f, fcntl.LOCK_EX)
        waited = time.perf_counter() - t0
        if waited > 1:
            print(f"  (waited {waited:.0f} s for {path})", flush=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# -- statistics ----------------------------------------------------------------------------


def average_ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties given the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's on average ranks (nan if undefined)."""
    if len(xs) != len(ys) or len(xs) < 2:
        return math.nan
    rx, ry = average_ranks(xs), average_ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return math.nan
    return sxy / math.sqrt(sxx * syy)


# -- search, pick, plan --------------------------------------------------------------------


def config_name(c) -> str:
    lay = c.layout
    split = "-".join(map(str, c.layers_per_stage))
    rec = "/".join(sorted(set(c.recompute)))
    return f"{lay} [{split}]" + ("" if rec == "none" else f" rc={rec}")


def pick_slices(n_results: int, n_configs: int, explicit: list[int] | None,
                results) -> list[list[int]]:
    """Groups of 0-based result indices: the first of each group is measured, the others
    stand by (in order) in case it fails to run."""
    if explicit is not None:
        picked = [0] + [i for i in explicit if i != 0]
        rest = [i for i in range(n_results) if i not in picked]
        return [[i] + ([] if k == 0 else rest) for k, i in enumerate(picked)]
    n_configs = min(n_configs, n_results)
    slices: list[list[int]] = [[0]]
    others = list(range(1, n_results))
    n_rest = n_configs - 1
    bounds = [round(k * len(others) / n_rest) for k in range(n_rest + 1)] if n_rest else []
    seen_mesh, seen_sched, seen_m = set(), set(), set()

    def note(i: int) -> None:
        lay = results[i].layout
        seen_mesh.add((lay.pp, lay.dp, lay.tp))
        seen_sched.add(lay.schedule)
        seen_m.add(lay.n_microbatches)

    note(0)
    for k in range(n_rest):
        block = others[bounds[k]:bounds[k + 1]]
        mid = (len(block) - 1) / 2

        def score(i: int, pos: int) -> tuple:
            lay = results[i].layout
            novelty = (2 * ((lay.pp, lay.dp, lay.tp) not in seen_mesh)
                       + (lay.schedule not in seen_sched)
                       + 0.5 * (lay.n_microbatches not in seen_m))
            return (-novelty, abs(pos - mid))

        ranked = [i for _, i in sorted(((score(i, pos), i) for pos, i in enumerate(block)))]
        if ranked:
            note(ranked[0])
            slices.append(ranked)
    return slices


def search_and_plan(args) -> tuple[object, list[list[int]]]:
    """Profile, search and pick; returns (search report, slices of result indices)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import autopp
    from autopp.profiles.lookup import get_profile
    from llama3_pp_dp_tp import build_model

    t0 = time.perf_counter()
    prof = get_profile("measure")
    print(f"profile {prof.name}: fp32 {prof.flops_fp32 / 1e9:.1f} GFLOP/s per rank, "
          f"collectives {prof.intra_node_latency * 1e3:.1f} ms + bytes / "
          f"{prof.intra_node_bw / 1e9:.2f} GB/s, p2p {prof.p2p_latency * 1e3:.2f} ms + bytes / "
          f"{prof.p2p_bw / 1e9:.2f} GB/s ({time.perf_counter() - t0:.1f} s)", flush=True)
    report = autopp.search(build_model(args.model), world_size=WORLD,
                           global_batch=args.batch_size, seq_len=args.seq_len,
                           options=autopp.PlannerOptions(profile=prof.name),
                           schedules=tuple(args.schedules.split(",")),
                           microbatch_choices=args.microbatch_choices)
    print(report, flush=True)
    if not report.results:
        raise SystemExit(report.no_fit_message())
    explicit = None
    if args.indices:
        explicit = [int(x) - 1 for x in args.indices.split(",")]
        bad = [i + 1 for i in explicit if not 0 <= i < len(report.results)]
        if bad:
            raise SystemExit(f"--indices {bad}: the search has {len(report.results)} results")
    slices = pick_slices(len(report.results), args.configs, explicit, report.results)
    return report, slices


def plan_config(report, i: int, workdir: Path) -> dict:
    c = report.results[i]
    t0 = time.perf_counter()
    exact = report.plan(i)
    path = workdir / f"plan_rank{i + 1}.json"
    exact.plan.save(path)
    est = exact.plan.estimates
    return dict(rank=i + 1, config=config_name(c), pp=c.layout.pp, dp=c.layout.dp,
                tp=c.layout.tp, schedule=c.layout.schedule,
                n_microbatches=c.layout.n_microbatches,
                layers_per_stage=list(c.layers_per_stage), recompute=list(c.recompute),
                predicted_search_s=c.step_time_s,
                predicted_plan_s=est.step_time_s if est is not None else math.nan,
                bubble_plan=est.bubble_fraction if est is not None else math.nan,
                plan=str(path), plan_s=time.perf_counter() - t0)


# -- measure -------------------------------------------------------------------------------


def launch(args, cfg: dict, workdir: Path) -> dict:
    """Train with the plan on 8 gloo ranks; the median of steps 2..N, or the error."""
    log = workdir / f"train_rank{cfg['rank']}.log"
    cmd = ([str(ROOT / ".venv" / "bin" / "torchrun")] if (ROOT / ".venv").exists()
           else [sys.executable, "-m", "torch.distributed.run"])
    cmd += ["--standalone", "--nproc-per-node", str(WORLD), str(EXAMPLE),
            "--plan", cfg["plan"], "--model", args.model, "--steps", str(args.steps),
            "--device", "cpu", "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len), "--log-every", "1"]
    if args.lock:
        cmd = ["flock", args.lock] + cmd
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.launch_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # the group this launch started
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = "timeout"
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    steps = {int(k): float(t) for k, t in STEP_RE.findall(text)}
    times = [steps[k] for k in sorted(steps)]
    out = dict(log=str(log), launch_s=wall, step_times_s=times)
    if rc != 0 or len(times) < args.steps:
        lines = text.strip().splitlines()
        errs = ([ln for ln in lines if ERROR_RE.search(ln) and "ChildFailedError" not in ln]
                or [ln for ln in lines if "Error" in ln] or lines[-1:])
        out["error"] = f"exit {rc}, {len(times)}/{args.steps} steps; " + (
            errs[-1].strip() if errs else "no output")
        return out
    out["measured_s"] = statistics.median(times[1:] or times)
    done = DONE_RE.search(text)
    if done:
        out["example_median_s"] = float(done.group(2))
    return out


# -- report --------------------------------------------------------------------------------


def summarise(args, rows: list[dict], failures: list[dict], report) -> dict:
    ok = [r for r in rows if "measured_s" in r]
    for r in ok:
        r["ratio_search"] = r["measured_s"] / r["predicted_search_s"]
        r["ratio_plan"] = r["measured_s"] / r["predicted_plan_s"]
    pred_rank = average_ranks([r["predicted_search_s"] for r in ok])
    meas_rank = average_ranks([r["measured_s"] for r in ok])
    for r, a, b in zip(ok, pred_rank, meas_rank):
        r["predicted_order"], r["measured_order"] = a, b
    rho = spearman([r["predicted_search_s"] for r in ok], [r["measured_s"] for r in ok])
    rho_plan = spearman([r["predicted_plan_s"] for r in ok], [r["measured_s"] for r in ok])
    top = next((r for r in ok if r["rank"] == 1), None)
    fastest = min(ok, key=lambda r: r["measured_s"]) if ok else None
    top1_gap = (top["measured_s"] / fastest["measured_s"] - 1) if top and fastest else math.nan
    ratios = [r["ratio_search"] for r in ok]
    return dict(
        model=args.model, world_size=WORLD, global_batch=args.batch_size,
        seq_len=args.seq_len, steps=args.steps, profile=report.profile,
        schedules=args.schedules.split(","), search_results=len(report.results),
        search_s=report.search_s, rows=rows, failures=failures,
        spearman_search=rho, spearman_plan=rho_plan,
        top1_measured_s=top["measured_s"] if top else None,
        fastest_measured=fastest["config"] if fastest else None,
        fastest_measured_s=fastest["measured_s"] if fastest else None,
        top1_gap=top1_gap, top1_within_10pct=bool(top1_gap <= TOP1_TOLERANCE),
        ratio_median=statistics.median(ratios) if ratios else math.nan,
        ratio_min=min(ratios) if ratios else math.nan,
        ratio_max=max(ratios) if ratios else math.nan,
        acceptance=bool(rho >= 0.8 and top1_gap <= TOP1_TOLERANCE),
    )


def markdown(s: dict) -> str:
    if s["top1_measured_s"] is None or s["fastest_measured_s"] is None:
        fails = "".join(f"\n- failed: rank {f['rank']} {f['config']}: {f['error']}"
                        for f in s["failures"])
        return ("# autopp.search vs measured\n\nthe search's rank 1 (or every configuration) "
                f"failed to run: no comparison{fails}\n")
    head = ("| search rank | configuration | predicted (search) s | predicted (exact plan) s "
            "| simulated bubble | measured median s | measured / predicted (search) "
            "| measured / predicted (plan) | predicted order | measured order |")
    lines = [
        f"# autopp.search vs measured: llama3 {s['model']}, {s['world_size']} gloo ranks, "
        f"global batch {s['global_batch']} x seq {s['seq_len']}",
        "",
        f"profile {s['profile']}; schedules {', '.join(s['schedules'])}; "
        f"{s['search_results']} layouts fit; measured = median of steps 2..{s['steps']} "
        "(includes gradient clipping and AdamW, not in the prediction)",
        "",
        head,
        "|" + "---|" * 10,
    ]
    for r in sorted(s["rows"], key=lambda r: r["rank"]):
        if "measured_s" not in r:
            continue
        lines.append(
            f"| {r['rank']} | {r['config']} | {r['predicted_search_s']:.3f} | "
            f"{r['predicted_plan_s']:.3f} | {r['bubble_plan']:.0%} | {r['measured_s']:.3f} | "
            f"{r['ratio_search']:.2f} | {r['ratio_plan']:.2f} | "
            f"{r['predicted_order']:g} | {r['measured_order']:g} |")
    lines += [
        "",
        f"- Spearman (search prediction vs measured): {s['spearman_search']:.3f}; "
        f"exact-plan prediction vs measured: {s['spearman_plan']:.3f}",
        f"- measured / predicted (search): median {s['ratio_median']:.2f}, range "
        f"{s['ratio_min']:.2f}-{s['ratio_max']:.2f}",
        f"- search's rank 1: measured {s['top1_measured_s']:.3f} s; fastest measured "
        f"{s['fastest_measured']} {s['fastest_measured_s']:.3f} s; rank 1 is "
        f"{s['top1_gap']:+.1%} from it: "
        f"{'within' if s['top1_within_10pct'] else 'NOT within'} 10%",
        f"- acceptance (Spearman >= 0.8 and rank 1 within 10%): "
        f"{'met' if s['acceptance'] else 'NOT met'}",
    ]
    for f in s["failures"]:
        lines.append(f"- failed: rank {f['rank']} {f['config']}: {f['error']} (log {f['log']})")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s %(name)s] %(message)s",
                        datefmt="%H:%M:%S")
    for name in ("autopp.layout_search", "autopp.profiles.measure"):
        logging.getLogger(name).setLevel(logging.INFO)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="search_vs_measured_"))
    workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    with file_lock(args.lock):
        report, slices = search_and_plan(args)
        planned: dict[int, dict] = {}

        def planned_cfg(i: int) -> dict:
            if i not in planned:
                planned[i] = plan_config(report, i, workdir)
            return planned[i]

        for group in slices:
            cfg = planned_cfg(group[0])
            print(f"picked rank {cfg['rank']:>2}: {cfg['config']}: predicted "
                  f"{cfg['predicted_search_s']:.3f} s (search), {cfg['predicted_plan_s']:.3f} s "
                  f"(exact plan, planned in {cfg['plan_s']:.1f} s)", flush=True)
    print(f"plans and logs in {workdir}", flush=True)
    if args.plan_only:
        return

    rows, failures, used = [], [], set()
    for group in slices:
        for i in group:
            if i in used:
                continue
            used.add(i)
            if i not in planned:
                with file_lock(args.lock):
                    planned_cfg(i)
            cfg = dict(planned[i])
            print(f"training rank {cfg['rank']:>2}: {cfg['config']} ...", end=" ", flush=True)
            cfg.update(launch(args, cfg, workdir))
            if "error" in cfg:
                print(f"FAILED ({cfg['error']}); log {cfg['log']}", flush=True)
                failures.append(cfg)
                continue
            print(f"measured {cfg['measured_s']:.3f} s (steps "
                  f"{', '.join(f'{t:.2f}' for t in cfg['step_times_s'])}; launch "
                  f"{cfg['launch_s']:.0f} s)", flush=True)
            rows.append(cfg)
            break

    s = summarise(args, rows, failures, report)
    s["total_s"] = time.perf_counter() - t_start
    text = markdown(s)
    print("\n" + text, flush=True)
    out = Path(args.out)
    json_path = out if out.suffix == ".json" else out.with_suffix(".json")
    if out.suffix != ".json":
        out.write_text(text)
    json_path.write_text(json.dumps(s, indent=1, default=str))
    print(f"written: {out}" + ("" if json_path == out else f" and {json_path}")
          + f"; total {s['total_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
