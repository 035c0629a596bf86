"""Benchmark: images/s of sd.train.step.train_step under DDP on every rank vs the same step in one process.

    torchrun --standalone --nproc_per_node 2 bench/ddp_step.py          # CPU: tiny UNet, 64 px, gloo
    torchrun --standalone --nproc_per_node $(nvidia-smi -L | wc -l) bench/ddp_step.py --arch sd1 \\
        --resolution 512 --batch 16 --precision bf16 --compile          # GPUs: NCCL

Ours: the trainer's step (``build_step`` + ``wrap_model``: DistributedDataParallel with gradients as
bucket views, ``torch.compile`` of the DDP module with ``--compile``) on every rank, the per-rank batch
``--batch``, the statistics read once per window of ``--timed_steps`` steps as the loop reads them at
its logging points. The peer: the same step in one process on rank 0's device (no DDP), timed first
while the other ranks wait. Scaling efficiency = DDP images/s (all ranks) / (ranks x the single
process's images/s): 1.0 is perfect; what is lost is the gradient all-reduce that the backward pass
does not hide, and stragglers. Without torchrun (one rank) only the single process is measured.
Prints a table, the efficiency and one JSON line (rank 0).
"""

from __future__ import annotations

import statistics
import time

import torch

import sd.distributed
import sd.model
import sd.runtime
import sd.train.step
from bench import harness
from sd.distributed import Dist
from sd.train.config import TrainConfig


def build(args, d: Dist) -> sd.train.step.Step:
    config = TrainConfig(unet=harness.unet_preset(args.arch), grad_accum=1, precision=args.precision,
                         grad_checkpointing=args.checkpointing, compile=args.compile)
    unet = sd.model.build_unet(config.unet, seed=config.seed, grad_checkpointing=config.grad_checkpointing)
    step = sd.train.step.build_step(config, d, unet.to(d.device).train(), harness.random_text_encoder(args.arch),
                                   harness.empty_prompt_ids(), sd.model.SD1_SCALING_FACTOR)
    sd.train.step.wrap_model(step, config.compile)
    sd.train.step.set_lr(step.optimizer, config.lr)
    return step


def time_step(step, args, d: Dist) -> float:
    """Images/s of this rank: the median of ``--rounds`` windows of ``--timed_steps`` steps, after ``--warmup``."""
    batch = harness.synthetic_batch(args.batch, args.resolution // harness.vae_factor(args.arch), seed=d.rank)
    index = iter(range(10**9))

    def window(steps):
        with sd.model.attention_context(d.device):
            results = [sd.train.step.train_step(step, [batch], next(index)) for _ in range(steps)]
        return sd.train.step.read_results(results) if hasattr(sd.train.step, "read_results") else results

    window(args.warmup)
    seconds = []
    for _ in range(args.rounds):
        sd.distributed.barrier(d)
        sd.runtime.synchronize(d.device)
        start = time.perf_counter()
        window(args.timed_steps)
        sd.runtime.synchronize(d.device)
        seconds.append(time.perf_counter() - start)
    return args.batch * args.timed_steps / statistics.median(seconds)


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--batch", type=int, default=16 if cuda else 4, help="images per rank and step")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16" if cuda else "fp32")
    parser.add_bool("--compile", help="torch.compile the (DDP-wrapped) UNet, as compile: true does")
    parser.add_bool("--checkpointing", help="gradient checkpointing")
    parser.add_argument("--warmup", type=int, default=5 if cuda else 2, help="untimed steps (compilation included)")
    parser.add_argument("--timed_steps", type=int, default=20 if cuda else 4, help="steps a timed window")
    parser.add_argument("--rounds", type=int, default=3, help="timed windows; the median counts")
    return parser.parse_args(argv)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    sd.runtime.start_process()
    d = sd.distributed.setup(args.device)
    try:
        rows = []
        if d.is_main:
            alone = Dist.single(d.device)
            single = build(args, alone)
            rows.append({"impl": "one process", "ranks": 1, "images_per_s": time_step(single, args, alone)})
            del single
            harness.release(d.device)
        sd.distributed.barrier(d)
        if d.world_size > 1:
            rate = time_step(build(args, d), args, d)
            rates = sd.distributed.all_gather_objects(rate, d)
            rows.append({"impl": "DDP", "ranks": d.world_size, "images_per_s": sum(rates),
                         "slowest_rank_images_per_s": min(rates)})
        if not d.is_main:
            return None
        for row in rows:
            row["images_per_s_per_rank"] = row["images_per_s"] / row["ranks"]
        print(f"{args.arch} UNet, {args.resolution} px, batch {args.batch} per rank, {args.precision}, "
              f"{'compiled' if args.compile else 'eager'}, {harness.device_name(d.device)}")
        harness.print_table(rows, lambda row: row["impl"], [
            ("ranks", "ranks", "d"), ("images_per_s", "images/s", ".2f"), ("images_per_s_per_rank", "per rank", ".2f")])
        result = {"benchmark": "ddp_step", "device": harness.device_name(d.device), "arch": args.arch,
                  "resolution": args.resolution, "batch": args.batch, "precision": args.precision,
                  "compile": args.compile, "world_size": d.world_size, "rows": rows}
        if len(rows) == 2:
            result["efficiency"] = round(rows[1]["images_per_s"] / (d.world_size * rows[0]["images_per_s"]), 3)
            print(f"scaling efficiency DDP/({d.world_size} x one process) = {result['efficiency']:.2f}")
        harness.emit(result, args.json)
        return result
    finally:
        sd.distributed.teardown()


if __name__ == "__main__":
    main()
