"""Measure a :class:`DeviceProfile` of the machine at hand.

:func:`measure_profile` starts ``world_size`` torch.distributed processes (gloo on CPU, nccl
on CUDA) and times, all ranks at once (on CPU they share the cores, as a pipeline does):
square matmuls in fp32 and bf16 (``flops_fp32`` / ``flops_bf16`` with efficiency 1.0; on
CUDA fp32 again at TF32 for ``flops_tf32``), a large copy (``mem_bw``), the functional
collectives the lowered graphs call at several sizes (one latency per ring step and one
bandwidth fitted on the cost model's steps and wire bytes: the intra-node link), and a
send/recv ping-pong (``p2p_latency``, ``p2p_bw``). Each figure is the median over repeats of
the slowest rank. What one host cannot measure (the inter-node link; on one rank every link)
comes from a built-in profile (``links_from``) and is named in a warning and in
``details["not_measured"]``. On CPU ``memory_bytes`` is the RAM divided by the world size.
The profile is named ``"measured-<hash>"`` (host, device, backend, world size, torch version)
and stored as JSON where :func:`autopp.profiles.lookup.get_profile` finds it later."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import queue as queue_mod
import socket
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from autopp.profiles.link_fit import fitted_links
from autopp.profiles.devices import (
    NCCL_COMMUNICATOR_BYTES,
    MEASURED_PREFIX,
    PROFILES,
    DeviceProfile,
    load_profile,
    profile_cache_dir,
    profile_for_device,
    register_profile,
    save_profile,
)

logger = logging.getLogger("autopp.profiles.measure")

DEFAULT_WORLD_SIZE = 8
"""World size of ``get_profile("measure")``."""

_KIB, _MIB = 1024, 1024 * 1024
MATMUL_SIZES = {"cpu": (512, 1024, 2048), "cuda": (2048, 4096, 8192)}
"""Square matmul sizes tried, smallest first, by device type; the next size is tried only
while its expected time (8 times the last size's) stays under :data:`MATMUL_SECONDS`."""
MATMUL_SECONDS = 0.5
MESSAGE_BYTES = (64 * _KIB, 256 * _KIB, _MIB, 4 * _MIB, 16 * _MIB)
"""Per-rank input sizes of the collectives and sizes of the point-to-point messages."""
COPY_BYTES = {"cpu": 64 * _MIB, "cuda": 512 * _MIB}
"""Size of the tensor copied to measure memory bandwidth, by device type."""
REPEATS = 5
"""Timed repeats per measurement (after one warm-up); figures are their median."""
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


# -- naming --------------------------------------------------------------------------------


def _resolve(backend: str | None, device: str | None) -> tuple[str, str]:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device).type
    if device not in ("cpu", "cuda"):
        raise ValueError(f"measure_profile measures 'cpu' or 'cuda' devices, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch.cuda.is_available() is False; pass "
                         "device='cpu' or run on a machine with a GPU")
    if backend is None:
        backend = "nccl" if device == "cuda" else "gloo"
    return backend, device


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _device_description(device: str) -> str:
    if device == "cuda":
        return f"cuda:{torch.cuda.get_device_name(0)}x{torch.cuda.device_count()}"
    return f"cpu:{_cpu_model()}x{os.cpu_count()}"


def measured_name(*, world_size: int = DEFAULT_WORLD_SIZE, backend: str | None = None,
                  device: str | None = None,
                  links_from: str | DeviceProfile | None = None) -> str:
    """The name :func:`measure_profile` gives this machine's profile: ``"measured-"`` and a
    hash of the host name, the device, the backend, the world size, torch's version and the
    profile the unmeasured links come from. Arguments as for :func:`measure_profile`."""
    backend, device = _resolve(backend, device)
    key = {"host": socket.gethostname(), "device": _device_description(device),
           "backend": backend, "world_size": world_size, "torch": torch.__version__,
           "links_from": _base_name(links_from)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return MEASURED_PREFIX + digest


def _base_name(links_from: str | DeviceProfile | None) -> str | None:
    return links_from.name if isinstance(links_from, DeviceProfile) else links_from


def _base_profile(links_from: str | DeviceProfile | None, device: str) -> DeviceProfile | None:
    """The profile whose links stand for those one host cannot measure: ``links_from`` (a
    built-in or registered name, or a profile), else this device's built-in profile; None
    when this device has none (an unknown GPU)."""
    if isinstance(links_from, DeviceProfile):
        return links_from
    if links_from is not None:
        from autopp.profiles.devices import registered_profile

        if links_from in PROFILES:
            return PROFILES[links_from]
        if registered_profile(links_from) is not None:
            return registered_profile(links_from)
        raise ValueError(f"links_from={links_from!r} is no built-in or registered profile; "
                         f"choose one of {sorted(PROFILES)} or pass a DeviceProfile")
    try:
        return PROFILES[profile_for_device(device)]
    except ValueError:
        return None


def _memory_bytes(device: str, world_size: int) -> float:
    if device == "cuda":
        return float(torch.cuda.get_device_properties(0).total_memory)
    try:
        import psutil  # type: ignore[import-not-found]

        total = float(psutil.virtual_memory().total)
    except ImportError:
        total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return total / world_size


# -- the measuring processes ---------------------------------------------------------------


class _Rank:
    """One measuring process: its device and the timing helpers."""

    def __init__(self, rank: int, world_size: int, device: str, report: Callable[[str], None]):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" \
            else torch.device("cpu")
        self.report = report
        self._flag = torch.zeros(1, device=self.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def align(self) -> None:
        """All ranks leave together (as nearly as the backend allows), device idle."""
        self.sync()
        self.dist.all_reduce(self._flag)
        self.sync()

    def slowest(self, values: list[float]) -> list[float]:
        """Element-wise max of ``values`` over the ranks."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.cpu().tolist()

    def everywhere(self, ok: bool) -> bool:
        """True when ``ok`` is true on every rank."""
        return self.slowest([0.0 if ok else 1.0])[0] == 0.0

    def time_all(self, fn: Callable[[], Any], repeats: int) -> list[float]:
        """Seconds of each of ``repeats`` runs of ``fn`` on every rank at once (after one
        warm-up): the slowest rank's time per run."""
        fn()
        self.sync()
        times = []
        for _ in range(repeats):
            self.align()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return self.slowest(times)


def _matmul_rates(r: _Rank) -> dict[str, Any]:
    out: dict[str, Any] = {}
    labels = [("fp32", (torch.float32,)), ("bf16", (torch.bfloat16, torch.float16))]
    if r.device.type == "cuda":  # fp32 on TF32 tensor cores: a rate of its own
        labels.insert(1, ("tf32", (torch.float32,)))
    before = torch.get_float32_matmul_precision()
    for label, dtypes in labels:
        torch.set_float32_matmul_precision("high" if label == "tf32" else "highest")
        try:
            out[label] = _matmul_rate(r, label, dtypes)
        finally:
            torch.set_float32_matmul_precision(before)
    return out


def _matmul_rate(r: _Rank, label: str, dtypes: tuple[torch.dtype, ...]) -> dict[str, Any]:
    """One matmul rate: the first of ``dtypes`` that runs on every rank, at growing sizes."""
    for dtype in dtypes:
        try:
            a = torch.randn(64, 64, device=r.device).to(dtype)
            _ = a @ a
            ok = True
        except RuntimeError:  # e.g. no bf16 matmul on this device: try fp16
            ok = False
        if r.everywhere(ok):
            break
    else:
        raise RuntimeError(f"no {label} matmul runs on {r.device}: cannot measure its rate")
    sizes: dict[int, float] = {}
    for n in MATMUL_SIZES[r.device.type]:
        a = torch.randn(n, n, device=r.device).to(dtype)
        b = torch.randn(n, n, device=r.device).to(dtype)
        c = torch.empty(n, n, device=r.device, dtype=dtype)
        sizes[n] = statistics.median(r.time_all(lambda: torch.mm(a, b, out=c), REPEATS))
        if 8 * sizes[n] > MATMUL_SECONDS:  # the next size (2x) takes ~8x as long
            break
    n = max(sizes)
    rate = {"dtype": str(dtype), "size": n, "flops": 2 * n**3 / sizes[n],
            "seconds_by_size": {str(k): v for k, v in sizes.items()}}
    r.report(f"matmul {label} ({dtype}, {n}x{n}): {rate['flops'] / 1e9:.1f} GFLOP/s "
             "per rank")
    return rate


def _copy_rate(r: _Rank) -> dict[str, Any]:
    nbytes = COPY_BYTES[r.device.type]
    src = torch.ones(nbytes // 4, device=r.device)
    dst = torch.empty_like(src)
    times = r.time_all(lambda: dst.copy_(src), REPEATS)
    med = statistics.median(times)
    r.report(f"copy {nbytes / _MIB:.0f} MiB: {2 * nbytes / med / 1e9:.1f} GB/s per rank")
    return {"bytes": nbytes, "seconds": med, "bytes_per_s": 2 * nbytes / med}


def _collectives(r: _Rank) -> dict[str, Any]:
    ops = torch.ops._c10d_functional
    n, group = r.world_size, r.dist.group.WORLD.group_name
    calls = {
        "all_gather_into_tensor": lambda x: ops.all_gather_into_tensor(x, n, group),
        "reduce_scatter_tensor": lambda x: ops.reduce_scatter_tensor(x, "sum", n, group),
        "all_reduce": lambda x: ops.all_reduce(x, "sum", group),
    }
    out: dict[str, Any] = {"points": {}, "unsupported": {}}
    for name in COLLECTIVES:
        call = calls[name]
        error = None
        try:  # a backend without this collective: the lowered graphs could not run it either
            ops.wait_tensor(call(torch.ones(4 * n, device=r.device)))
            r.sync()
        except (RuntimeError, NotImplementedError) as e:
            error = f"{type(e).__name__}: {e}"[:300]
        if not r.everywhere(error is None):
            out["unsupported"][name] = error or "failed on another rank"
            r.report(f"{name}: not supported by this backend ({out['unsupported'][name]})")
            continue
        points = []
        for nbytes in MESSAGE_BYTES:
            numel = max(n, nbytes // 4 // n * n)
            x = torch.ones(numel, device=r.device)
            med = statistics.median(r.time_all(lambda: ops.wait_tensor(call(x)), REPEATS))
            points.append((numel * 4, med))
        out["points"][name] = points
        r.report(f"{name}: " + ", ".join(f"{b // _KIB} KiB {t * 1e3:.2f} ms" for b, t in points))
    return out


def _p2p(r: _Rank) -> list[tuple[int, float]]:
    """Ping-pong between ranks 0 and 1 (the others wait): half a round trip per size."""
    points = []
    for nbytes in MESSAGE_BYTES:
        buf = torch.ones(nbytes // 4, device=r.device)
        times = []
        for i in range(REPEATS + 1):
            r.align()
            t0 = time.perf_counter()
            if r.rank == 0:
                r.dist.send(buf, 1)
                r.dist.recv(buf, 1)
            elif r.rank == 1:
                r.dist.recv(buf, 0)
                r.dist.send(buf, 0)
            r.sync()
            if i:  # the first is the warm-up; rank 0 timed the round trip
                times.append((time.perf_counter() - t0) / 2 if r.rank == 0 else 0.0)
        points.append((nbytes, statistics.median(r.slowest(times))))
    r.report("send/recv: " + ", ".join(f"{b // _KIB} KiB {t * 1e3:.2f} ms" for b, t in points))
    return points


def _worker(rank: int, world_size: int, port: int, backend: str, device: str,
            threads: int, matmul_precision: str, queue: Any) -> None:
    """One measuring process; rank 0 puts ``("result", dict)`` on ``queue``, any rank
    ``("error", traceback)`` on failure, and rank 0 ``("progress", line)`` as it goes."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    torch.set_float32_matmul_precision(matmul_precision)

    def report(line: str) -> None:
        if rank == 0:
            queue.put(("progress", line))

    try:
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        r = _Rank(rank, world_size, device, report)
        result = {"matmul": _matmul_rates(r), "copy": _copy_rate(r)}
        if world_size > 1:  # one rank has no link to measure
            result.update(collectives=_collectives(r), p2p=_p2p(r))
        r.align()
        if rank == 0:
            queue.put(("result", result))
    except BaseException:  # noqa: BLE001 - the parent reports the worker's traceback
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(world_size: int, backend: str, device: str, timeout_s: float) -> dict[str, Any]:
    import torch.multiprocessing as mp

    # forkserver: the server imports torch and this module once and forks every rank from
    # it (spawn would import them once per rank, seconds each on a small machine). The
    # server is one per process: keep the modules others asked it to preload.
    if "forkserver" in mp.get_all_start_methods():
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        asked = list(getattr(forkserver._forkserver, "_preload_modules", None) or [])
        ctx.set_forkserver_preload(
            list(dict.fromkeys([*asked, "torch", "torch.distributed", __name__])))
    else:
        ctx = mp.get_context("spawn")
    threads = 1 if device == "cuda" else max(1, (os.cpu_count() or 1) // world_size)
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, daemon=False,
                         args=(rank, world_size, port, backend, device, threads,
                               torch.get_float32_matmul_precision(), q))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                kind, payload = q.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"measuring ranks {dead} exited with codes "
                        f"{[procs[i].exitcode for i in dead]} before reporting; run again, "
                        "or with a smaller world_size if the machine ran out of memory"
                    ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"profile measurement took over {timeout_s:.0f} s; the machine may be "
                        "busy with other jobs: run again when it is idle, or with a smaller "
                        "world_size"
                    ) from None
                continue
            if kind == "progress":
                logger.info("%s", payload)
            elif kind == "error":
                raise RuntimeError(f"profile measurement failed on {payload}")
            else:
                result = payload
                break
        for p in procs:
            p.join(timeout=60)
        return result
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


# -- the profile ---------------------------------------------------------------------------


def measure_profile(*, world_size: int = DEFAULT_WORLD_SIZE, backend: str | None = None,
                    device: str | None = None, cache: bool = True,
                    timeout_s: float = 600.0,
                    links_from: str | DeviceProfile | None = None) -> DeviceProfile:
    """This machine's profile, measured on ``world_size`` processes (see the module doc).

    Args:
        world_size: processes to measure with, as many as will run pipelines here; on CPU each
            gets ``cpu_count // world_size`` threads and the RAM divided by ``world_size``.
        backend: default ``"nccl"`` on CUDA, ``"gloo"`` on CPU.
        device: ``"cpu"`` or ``"cuda"`` (rank ``r`` uses GPU ``r % device_count``).
        cache: read a stored measurement of this machine and store a new one; False: always
            measure, store nothing. Either way the profile is registered under its name.
        timeout_s: give up (RuntimeError) when the measurement takes longer.
        links_from: the profile whose links stand for what this host cannot measure; default
            this device's built-in one (an unknown GPU on one rank is an error naming it).

    Processes on one host asking at once share one measurement (a file lock). Ranks start with
    forkserver or spawn: a measuring script keeps its top level under ``__main__``."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: measuring needs at least 1 process")
    backend, device = _resolve(backend, device)
    base = _base_profile(links_from, device)
    if base is None and world_size == 1:
        raise ValueError("one rank measures no link, and this GPU has no built-in profile to "
                         "take them from: pass links_from= (one of "
                         f"{sorted(PROFILES)} or a DeviceProfile), or world_size >= 2")
    if device == "cuda" and backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"world_size={world_size} > {torch.cuda.device_count()} GPUs: nccl "
                         "needs one GPU per rank; pass a smaller world_size")
    name = measured_name(world_size=world_size, backend=backend, device=device,
                         links_from=links_from)
    if not cache:
        return register_profile(_measure(name, world_size, backend, device, timeout_s,
                                         base)[0])
    from autopp.disk_cache import cached_file

    directory = profile_cache_dir()
    (profile, _), hit = cached_file(
        directory, name, lambda: _measure(name, world_size, backend, device, timeout_s, base),
        lambda path: (load_profile(path), None),
        lambda value, path: save_profile(value[0], path, value[1]))
    logger.info("measured profile %s %s %s", name, "read from" if hit else "stored in",
                directory / f"{name}.json")
    return register_profile(profile)


def _measure(name: str, world_size: int, backend: str, device: str, timeout_s: float,
             base: DeviceProfile | None = None) -> tuple[DeviceProfile, dict[str, Any]]:
    logger.info("measuring device profile %s: %d %s ranks over %s (takes tens of seconds)",
                name, world_size, device, backend)
    start = time.perf_counter()
    raw = _run_world(world_size, backend, device, timeout_s)
    seconds = time.perf_counter() - start

    links, fits, not_measured = fitted_links(raw, world_size, base, COLLECTIVES)
    for what in not_measured:
        logger.warning("profile %s: not measured: %s", name, what)

    profile = DeviceProfile(
        name=name,
        flops_fp32=raw["matmul"]["fp32"]["flops"],
        flops_tf32=raw["matmul"]["tf32"]["flops"] if "tf32" in raw["matmul"] else None,
        flops_bf16=raw["matmul"]["bf16"]["flops"],
        mem_bw=raw["copy"]["bytes_per_s"],
        memory_bytes=_memory_bytes(device, world_size),
        compute_efficiency=1.0,
        **links,
        shared_cores=(os.cpu_count() if device == "cpu" and world_size > (os.cpu_count() or 1)
                      else None),
        communicator_bytes=NCCL_COMMUNICATOR_BYTES if backend == "nccl" else 0.0,
        device_type=device,
    )
    details = {
        "host": socket.gethostname(), "device": _device_description(device),
        "backend": backend, "world_size": world_size, "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": seconds,
        "repeats": REPEATS, "raw": raw, **fits, "not_measured": not_measured,
    }
    links_line = "links not measured (one rank)" if world_size == 1 else (
        "collectives %.1f us + bytes / %.2f GB/s (rel. rms %.0f%%), send/recv %.1f us + "
        "bytes / %.2f GB/s (rel. rms %.0f%%)" % (
            profile.intra_node_latency * 1e6, profile.intra_node_bw / 1e9,
            fits["collective_fit"]["rel_rms"] * 100, profile.p2p_latency * 1e6,
            profile.p2p_bw / 1e9, fits["p2p_fit"]["rel_rms"] * 100))
    logger.info("measured %s in %.1f s: fp32 %.1f GFLOP/s, bf16 %.1f GFLOP/s, copy %.1f GB/s, "
                "%s", name, seconds, profile.flops_fp32 / 1e9, profile.flops_bf16 / 1e9,
                profile.mem_bw / 1e9, links_line)
    return profile, details
