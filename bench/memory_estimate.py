"""Benchmark: sd.train.memory's predicted peak against measured peaks, on the CPU and against published GPU figures.

    python bench/memory_estimate.py                       # CPU grid (tiny 64 px, demo 128 px) + SD 1.x predictions
    python bench/memory_estimate.py --grid demo:128:8:1   # one point: preset:resolution:batch:checkpointing
    python bench/memory_estimate.py --grid "" --sd1 false --cards 8,12,16,24,48,80   # the README's VRAM table

1. CPU calibration. For each grid point, a real training run is measured in a fresh process: the
   trainer's models (tiny text encoder and VAE, the preset's UNet) built and two steps of
   ``sd.train.step.train_step`` (bf16 autocast, fused AdamW, EMA on the device) on random latents,
   under the PyTorch profiler with ``profile_memory``: every allocation and free of the CPU allocator,
   those inside an operator included, summed into live bytes over time at the microsecond steps of
   PyTorch's memory timeline (what ``export_memory_timeline`` draws, without its categories); the
   measure is its peak. A first build and step at batch 1 runs before the record (imports, kernel
   set-up). Beside
   it, ``sd.train.memory.estimate(..., device="cpu")``: the same two steps on fake tensors (the CPU's own
   autocast), allocated bytes at the peak. The error is estimate / measured - 1. (The process's
   resident memory is no measure at this size: glibc keeps freed blocks and the libraries' caches
   add tens of MB that no GPU run has on the card.)
2. SD 1.x on CUDA, predicted (``device="cuda"``), for the configurations with published figures; the
   figures and where they come from are printed beside the predictions (BENCHMARKS.md discusses the
   differences).
3. ``--cards``: for each card size, the largest micro-batch at 512 px predicted for the settings in
   CARD_SETTINGS (README's VRAM table; ``--card_settings`` picks columns).
Prints a table per part and one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import sd.cli
import sd.model
import sd.train.memory
import sd.train.step

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_GRID = ("tiny:64:2:0,tiny:64:8:0,tiny:64:8:1,demo:128:2:0,demo:128:8:0,demo:128:8:1,demo:128:16:0,"
                "demo:128:16:1")
# (label, config fields, resolution, published peak in GB or None, where the figure comes from)
PUBLISHED = [
    ("reference from-scratch run: batch 24, bf16, checkpointing, fused AdamW, fp32 EMA on the GPU",
     dict(batch_size=24, precision="bf16", grad_checkpointing=True, ema_decay=0.9999, ema_device="same"), 512, 25.3,
     "the reference curriculum's from-scratch run, as its log reports it"),
    ("DreamBooth-style: batch 1, fp16, checkpointing, AdamW, no EMA",
     dict(batch_size=1, precision="fp16", grad_checkpointing=True, ema_decay=0.0), 512, 15.79,
     "ShivamShrirao/diffusers examples/dreambooth README table, Tesla T4 (VAE and text encoder outputs cached and "
     "the models freed; xformers attention)"),
    ("batch 1, bf16, checkpointing, no EMA", dict(batch_size=1, precision="bf16", grad_checkpointing=True,
                                                  ema_decay=0.0), 512, None, ""),
    ("batch 1, bf16, checkpointing, EMA on the CPU", dict(batch_size=1, precision="bf16", grad_checkpointing=True,
                                                          ema_decay=0.9999, ema_device="cpu"), 512, None, ""),
    ("batch 8, bf16, checkpointing, EMA on the GPU", dict(batch_size=8, precision="bf16", grad_checkpointing=True,
                                                          ema_decay=0.9999), 512, None, ""),
    ("batch 8, bf16, no checkpointing, EMA on the GPU", dict(batch_size=8, precision="bf16", grad_checkpointing=False,
                                                             ema_decay=0.9999), 512, None, ""),
]


CARD_SETTINGS = {  # name: (label, config fields) of the VRAM table's columns
    "scratch": ("from scratch: EMA on the GPU", dict(ema_decay=0.9999, ema_device="same")),
    "finetune": ("fine-tuning: EMA on the CPU", dict(ema_decay=0.9999, ema_device="cpu")),
    "finetune8bit": ("fine-tuning: 8-bit AdamW, EMA on the CPU, cached prompts",
                     dict(ema_decay=0.9999, ema_device="cpu", optimizer="adamw8bit", cache_text_embeddings=True)),
    "lora": ("LoRA rank 16 on attention, no EMA, cached prompts",
             dict(ema_decay=0.0, lora_rank=16, cache_text_embeddings=True)),
    "dreambooth_lora": ("DreamBooth LoRA rank 16 with prior preservation (batch = instance images; as many class "
                        "images beside them)", dict(ema_decay=0.0, lora_rank=16, cache_text_embeddings=True,
                                                    class_dir="class")),
}


def config_for(preset: str, batch: int, checkpointing: bool, **fields):
    from sd.train.config import TrainConfig

    tiny = preset != "sd1"
    return TrainConfig(**{"unet": preset, "text_encoder": "tiny" if tiny else "sd1", "vae": "tiny" if tiny else "sd1",
                          "batch_size": batch, "grad_accum": 1, "grad_checkpointing": checkpointing,
                          "precision": "bf16", "datasets": [], **fields})


def measure(preset: str, resolution: int, batch: int, checkpointing: bool, grad_accum: int = 1,
            sharding: str = "none") -> dict:
    """In this (fresh) process: the peak of the CPU allocator's live bytes over building the models and
    two real steps, from the profiler's record of every allocation and free. In a process group of
    several ranks (``measure_ddp``), the steps of this rank of a DDP run, as the trainer wraps it
    (``sharding``: the config's, zero1 or fsdp)."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from sd.distributed import Dist

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0

    def run(batch: int) -> None:
        torch.manual_seed(0)
        config = config_for(preset, batch, checkpointing, grad_accum=grad_accum, sharding=sharding)
        latent = resolution // 8
        batches = [(torch.randn(batch, 4, latent, latent).half(), torch.randint(0, 49407, (batch, 77)))
                   for _ in range(grad_accum)]
        text_encoder, vae = sd.model.load_text_encoder("tiny"), sd.model.load_vae("tiny")
        unet = sd.model.build_unet(preset, grad_checkpointing=checkpointing).train()
        step = sd.train.step.build_step(config, Dist(rank, world_size, 0, torch.device("cpu"), rank == 0), unet,
                                       text_encoder, torch.full((1, 77), 49407, dtype=torch.long),
                                       sd.model.SD1_SCALING_FACTOR)
        sd.train.step.wrap_model(step, compile=False)  # DDP on several ranks
        with sd.model.attention_context(torch.device("cpu")):
            for index in range(2):
                sd.train.step.train_step(step, batches, index)

    run(1)  # imports and the kernels' first use, outside the record
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run(batch)
    return {"measured_bytes": peak_live_bytes(prof, torch.device("cpu"))}


def measure_ddp(points: list[tuple], world_size: int = 2, then=None) -> tuple[list[list[int]], list]:
    """``measure`` at each point ``(preset, resolution, batch, checkpointing, grad_accum, sharding)`` in
    turn, on each rank of one ``world_size``-rank gloo group of fresh processes (one thread each; one
    start-up for all the points): per point, the measured peak bytes of every rank. Then, by rank, the
    value of ``then(rank)`` (a picklable function returning a JSON value, run after the measurements in
    the same group; None without it). A point measures the same after others as first (``measure``
    warms up before its record, and ``peak_live_bytes`` leaves out the frees of an earlier point's
    blocks): DDP at 64 px 33746700 bytes on rank 0 and zero1 at 128 px 36520108, either way; fsdp's
    peak varies by up to about 1 MB from run to run in fresh processes too."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_measure_rank, args=(world_size, folder, points, then), nprocs=world_size,
                           start_method="spawn")
        ranks = [json.loads(Path(folder, f"rank{rank}.json").read_text()) for rank in range(world_size)]
    return [[r["measured_bytes"][i] for r in ranks] for i in range(len(points))], [r["then"] for r in ranks]


def _measure_rank(rank: int, world_size: int, folder: str, points: list[tuple], then) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(str(Path(folder, "store")), world_size), rank=rank,
                            world_size=world_size)
    try:
        result = {"measured_bytes": [measure(*point)["measured_bytes"] for point in points]}
        result["then"] = then(rank) if then is not None else None
        Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def peak_live_bytes(prof, device) -> int:
    """The peak of the bytes live on ``device`` over a ``profile_memory`` record: its allocations and
    frees in time order, summed after each microsecond's events as PyTorch's memory timeline sums them
    (``torch.profiler._memory_profiler``, which also sorts every tensor into a category: 20 s of
    Python for the tiny UNet's two steps, and the peak does not need it). Blocks made before the record
    are not counted, as in the timeline: the CPU allocator reports no free of them, except of those made
    in an earlier record (a point ``measure_ddp`` measured before in the same process, its garbage
    collected now), and such frees are left out here.

    The record holds only what the profiled thread does: a block freed by another thread has no free
    in it. DDP's broadcast of the weights at its wrap stages them in one flat block
    (``aten::flatten_dense_tensors``), and gloo's worker thread now and then drops the last reference
    to it: without a correction one rank of the 2-rank DDP run measured a copy of the weights more,
    3.2 MB of 33.7, from the wrap to the end. Such a block with no free in the record is counted as
    freed when the op that made it ends (the broadcast and the copy back into the weights allocate
    nothing after it, so this is where the profiled thread's own free would fall in the order of
    allocations). Besides, when the allocator hands out an address that the record still holds a
    block at, that block was freed before: it is counted as freed then, the latest moment it can have
    been."""
    import numpy as np
    from torch._C._profiler import _EventType

    events, staging = [], {}  # staging: (time, address) of a collective's flat block -> when its op ended
    stack = [(root, root) for root in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, root = stack.pop()
        stack.extend((child, root) for child in event.children)
        if event.typed[0] == _EventType.Allocation and event.typed[1].device == device:
            events.append((event.start_time_ns, event.typed[1].alloc_size, event.typed[1].ptr))
            if root.name == "aten::flatten_dense_tensors" and event.typed[1].alloc_size > 0:
                staging[event.start_time_ns, event.typed[1].ptr] = (root.end_time_ns, event.typed[1].alloc_size)
    later_at: dict[int, list[int]] = {}  # address -> times of its allocations and frees
    for time_ns, _, ptr in events:
        later_at.setdefault(ptr, []).append(time_ns)
    for (made_ns, ptr), (end_ns, size) in staging.items():
        if max(later_at[ptr]) == made_ns:  # nothing seen at its address after it: neither its free nor a reuse
            events.append((end_ns, -size, ptr))
    events.sort(key=lambda e: e[:2])  # at one instant, frees before allocations
    held: dict[int, int] = {}  # address -> size of the block the record holds there
    times, sizes = [], []
    for time_ns, size, ptr in events:
        if size == 0:
            continue
        if size > 0:
            unseen_free = held.pop(ptr, 0)
            if unseen_free:
                times.append(time_ns)
                sizes.append(-unseen_free)
            held[ptr] = size
        elif held.pop(ptr, None) is None:  # a block made before the record
            continue
        times.append(time_ns)
        sizes.append(size)
    if not sizes:
        return 0
    live = np.cumsum(sizes)
    microseconds = np.array(times) // 1000
    last_of_each = np.append(microseconds[1:] != microseconds[:-1], True)
    return int(live[last_of_each].max())


def run_measure(point: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, __file__, "--measure", point], cwd=ROOT, env=env, capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise RuntimeError(f"measuring {point} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def parse_point(point: str) -> tuple[str, int, int, bool]:
    preset, resolution, batch, checkpointing = point.split(":")
    return preset, int(resolution), int(batch), checkpointing == "1"


def main(argv=None) -> int:
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--grid", default=DEFAULT_GRID,
                        help="CPU points preset:resolution:batch:checkpointing, comma-separated (default: %(default)s)")
    parser.add_argument("--sd1", default="true", help="also predict the SD 1.x configurations (true/false)")
    parser.add_argument("--cards", default="",
                        help="card sizes in GiB (e.g. 8,12,16,24,48,80): the largest batch of each CARD_SETTINGS")
    parser.add_argument("--card_settings", default=",".join(CARD_SETTINGS),
                        help="which CARD_SETTINGS columns (default: all: %(default)s)")
    parser.add_argument("--json", default="", help="also write the result JSON to this file")
    parser.add_argument("--measure", default="", help=__import__("argparse").SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(*parse_point(args.measure))))
        return 0
    from bench import harness

    rows = []
    print(f"{'point':<16}{'measured MB':>13}{'estimate MB':>13}{'error':>9}")
    for point in [p for p in args.grid.split(",") if p.strip()]:
        preset, resolution, batch, checkpointing = parse_point(point)
        measured = run_measure(point)["measured_bytes"]
        estimate = sd.train.memory.estimate(config_for(preset, batch, checkpointing), resolution=resolution, device="cpu")
        row = {"point": point, "measured_mb": round(measured / 2**20, 1),
               "estimate_mb": round(estimate.allocated / 2**20, 1), "error": round(estimate.allocated / measured - 1, 4),
               "parts_mb": {k: round(v / 2**20, 1) for k, v in estimate.parts.items()}}
        rows.append(row)
        print(f"{point:<16}{row['measured_mb']:>13.1f}{row['estimate_mb']:>13.1f}{row['error']:>+9.1%}", flush=True)
    worst = max((abs(row["error"]) for row in rows), default=0.0)
    print(f"largest error on the CPU grid: {worst:.1%}")
    predictions = []
    if args.sd1.lower() in ("1", "true", "yes"):
        print("\nSD 1.x at 512 px on CUDA, predicted")
        for label, fields, resolution, published, source in PUBLISHED:
            fields = dict(fields)
            config = config_for("sd1", fields.pop("batch_size"), fields.pop("grad_checkpointing"), **fields)
            estimate = sd.train.memory.estimate(config, resolution=resolution, device="cuda")
            item = {"label": label, **estimate.as_dict(), "published_gb": published, "source": source}
            predictions.append(item)
            versus = f"; published {published} GB ({source}): {estimate.peak_gb / published - 1:+.1%}" if published else ""
            print(f"  {label}: allocated {item['allocated_gb']:.2f} GB, card {item['peak_gb']:.2f} GB{versus}")
            print("    " + ", ".join(f"{k} {v:.2f}" for k, v in item["parts_gb"].items()))
    cards = []
    if args.cards:
        print("\nLargest micro-batch at 512 px, predicted (SD 1.x UNet, bf16 autocast, gradient checkpointing, fused "
              "AdamW)")
        for card in [float(c) for c in args.cards.split(",") if c.strip()]:
            usable = card * 2**30 / 1e9  # a "24 GB" card holds 24 GiB
            for name in [n.strip() for n in args.card_settings.split(",") if n.strip()]:
                if name not in CARD_SETTINGS:
                    parser.error(f"--card_settings: {name!r} is none of {', '.join(CARD_SETTINGS)}")
                label, fields = CARD_SETTINGS[name]
                config = config_for("sd1", 1, True, **fields)
                batch, at_batch = sd.train.memory.max_batch(config, usable, resolution=512)
                cards.append({"card_gib": card, "settings": label, "max_batch": batch,
                              "peak_gb": round(at_batch.peak_gb, 2) if at_batch else None})
                print(f"  {card:g} GiB, {label}: {batch or 'does not fit'}"
                      + (f" (peak {at_batch.peak_gb:.2f} GB of {usable:.2f})" if at_batch else ""), flush=True)
    result = {"cpu_grid": rows, "largest_cpu_error": worst, "sd1": predictions, "cards": cards,
              "reserve_factor": sd.train.memory.RESERVE_FACTOR, "context_gb": sd.train.memory.CONTEXT_GB}
    harness.emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
