"""Memory a rank holds while ``Pipeline.load_pretrained`` reads a Hugging Face checkpoint.

Launch (4 CPU processes, gloo)::

    .venv/bin/torchrun --standalone --nproc-per-node 4 benchmarks/load_pretrained_memory.py

Rank 0 writes a ``save_pretrained`` directory of transformers' Llama with a large vocabulary
(its embedding and head are the largest tensors: ``--vocab`` x ``--hidden`` fp32 each); every
rank then builds a planned pipeline (pp=2 x dp=2, or ``--parallelize replicate``), takes its
parameters' storage, and loads the directory while a thread samples its own
``/proc/self/status`` every half millisecond:

* ``anon`` = the peak of ``RssAnon`` above its level at the call: heap memory (copies of
  tensors, full or partial, made while loading);
* ``rss`` = the peak of ``VmRSS`` above its level at the call: anon plus the pages of the
  memory-mapped safetensors files the rank touched (torch's ``HuggingFaceStorageReader``
  reads slices through safetensors' memory map: file-backed pages, shared with the page
  cache and reclaimable, not held by the process).

Printed per rank next to the largest full parameter and this rank's local parameter bytes;
the claim checked is that a rank holds no full parameter it does not own: ``anon`` stays
below the largest parameter's bytes.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import torch
import torch.distributed as dist

MIB = 2**20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_above_start(fn) -> tuple[int, int]:
    """``(RssAnon, VmRSS)`` peaks above their levels at the start while ``fn()`` runs."""
    start = (_status("RssAnon"), _status("VmRSS"))
    peak = list(start)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _status("RssAnon"))
            peak[1] = max(peak[1], _status("VmRSS"))
            time.sleep(0.0005)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return peak[0] - start[0], peak[1] - start[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--parallelize", default="auto", choices=["auto", "replicate"])
    args = p.parse_args()

    import transformers

    from autopp import build_world_mesh, pipeline_autoparallel
    from tests.harness.models import ce_loss

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2)
    path = [tempfile.mkdtemp(prefix="autopp-hf-") if rank == 0 else None]
    if rank == 0:
        transformers.LlamaForCausalLM(config).save_pretrained(path[0])
    dist.broadcast_object_list(path)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    largest = max(p.numel() * 4 for p in model.parameters())
    mesh = build_world_mesh(pp=2, dp=2, tp=1)
    tokens = torch.zeros(4, 64, dtype=torch.long)
    pipe = pipeline_autoparallel(model, mesh, example_inputs=(tokens,), loss_fn=ce_loss,
                                 schedule="1F1B", n_microbatches=2,
                                 parallelize=None if args.parallelize == "replicate" else "auto")
    pipe.init_weights(seed=0)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4
                for p in pipe.parameters())
    dist.barrier()
    anon, rss = peak_above_start(lambda: pipe.load_pretrained(path[0]))
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (rank, anon, rss, local))
    if rank == 0:
        print(f"transformers Llama, vocab {args.vocab}, hidden {args.hidden}, {args.layers} "
              f"layers, pp2 x dp2, parallelize={args.parallelize}; largest full parameter "
              f"{largest / MIB:.1f} MiB")
        print("rank  anon peak MiB  rss peak MiB  local parameters MiB")
        for r, a, s, n in rows:
            print(f"{r:4d}  {a / MIB:13.1f}  {s / MIB:12.1f}  {n / MIB:20.1f}")
        print("holds no full parameter: " + ("yes" if max(a for _, a, _, _ in rows) < largest
                                              else "NO"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
