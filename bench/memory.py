"""Benchmark: the largest batch and the peak memory of a full from-scratch training step, ours vs diffusers.

    python bench/memory.py                                     # CPU: tiny UNet, 128 px, process memory
    python bench/memory.py --arch sd1 --resolution 512         # GPU: the card's memory is the limit
    python bench/memory.py --arch sd1 --resolution 512 --limit_gb 22    # would it fit a 24 GB card?

A full step: forward, backward, clipping, the AdamW update and the EMA update, from fresh weights, so
the optimizer state is allocated inside the measurement. Ours is sd.train.step.train_step with its fp32
EMA on the device; the peer is the step of diffusers' train_text_to_image.py with ``--use_ema``
(diffusers' EMAModel) and ``--mixed_precision bf16`` (see bench/train_throughput.py), each with and
without gradient checkpointing.

A batch fits when the step runs and its peak is at most ``--limit_gb``. The search doubles the batch
from 1 until one does not fit, then bisects. Peak memory: on a GPU the allocator's peak reserved
bytes (what the card must hold; allocated is shown too); on a CPU the growth of the process's peak
resident memory over its size before the models were built, each batch measured in a fresh process.
Prints each configuration's largest batch and its peak at ``--batch`` images, the ratios ours/peer,
and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch

import sd.runtime
import sd.train.memory
from bench import harness, train_throughput


def build_step(impl: str, checkpointing: bool, arch: str, device, precision: str):
    if impl == "ours":
        variant = train_throughput.Variant(compile=False, channels_last=False, checkpointing=checkpointing)
        return train_throughput.our_step(arch, variant, device, precision)
    return train_throughput.peer_step(arch, device, precision, ema=True, checkpointing=checkpointing)


def current_rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def cpu_trial(impl: str, checkpointing: bool, batch: int, args) -> dict:
    """One batch in a fresh process, so its peak is its own."""
    command = [sys.executable, __file__, "--_trial", f"{impl},{int(checkpointing)},{batch}", "--arch", args.arch,
               "--resolution", str(args.resolution), "--precision", args.precision, "--trial_steps", str(args.trial_steps),
               "--device", "cpu"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"memory trial {impl} batch {batch} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_trial_here(spec: str, args) -> None:
    """The child side of cpu_trial: build, run ``--trial_steps`` steps, print the memory used."""
    impl, checkpointing, batch = spec.split(",")
    device = torch.device("cpu")
    before = current_rss_gb()
    step = build_step(impl, checkpointing == "1", args.arch, device, args.precision)
    latents, input_ids = harness.synthetic_batch(int(batch), args.resolution // harness.vae_factor(args.arch))
    for _ in range(args.trial_steps):
        step(latents, input_ids)
    print(json.dumps({"peak_gb": round(peak_rss_gb() - before, 3)}))


class GpuTrials:
    """Trials on one built model per configuration: activations are all that change with the batch."""

    def __init__(self, impl: str, checkpointing: bool, args, device):
        self.device, self.args = device, args
        harness.release(device)
        self.step = build_step(impl, checkpointing, args.arch, device, args.precision)

    def __call__(self, batch: int) -> dict:
        latents, input_ids = harness.synthetic_batch(batch, self.args.resolution // harness.vae_factor(self.args.arch))
        torch.cuda.empty_cache()
        harness.reset_peak(self.device)
        try:
            for _ in range(self.args.trial_steps):
                self.step(latents, input_ids)
        except harness.out_of_memory_errors():
            torch.cuda.empty_cache()
            return {"oom": True}
        peaks = harness.peak_gb(self.device)
        return {"peak_gb": peaks["peak_reserved_gb"], "peak_allocated_gb": peaks["peak_allocated_gb"]}


def memoized(trial):
    seen = {}
    return lambda batch: seen[batch] if batch in seen else seen.setdefault(batch, trial(batch))


def largest_batch(trial, limit_gb: float, max_batch: int) -> tuple[int, list[dict]]:
    """Double from 1 until a batch does not fit (out of memory or over the limit), then bisect."""
    tried = []

    def fits(batch: int) -> bool:
        result = {"batch": batch, **trial(batch)}
        result["fits"] = not result.get("oom") and result["peak_gb"] <= limit_gb
        tried.append(result)
        return result["fits"]

    return sd.train.memory.largest_that_fits(fits, 1, max_batch), tried


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = harness.argument_parser(__doc__, cpu_resolution=128)
    parser.add_argument("--impls", default="ours,peer", help="ours and/or peer")
    parser.add_argument("--checkpointing", default="1,0", help="gradient checkpointing settings to measure: 1 and/or 0")
    parser.add_argument("--batch", type=int, default=8, help="the batch whose peak memory is compared (default: 8)")
    parser.add_argument("--limit_gb", type=float, default=None, help="memory a batch may use (default: the GPU's "
                        "memory; on a CPU 0.4 GB)")
    parser.add_argument("--max_batch", type=int, default=512 if cuda else 256, help="largest batch tried")
    parser.add_argument("--trial_steps", type=int, default=2, help="training steps per trial (the first allocates "
                        "the optimizer)")
    parser.add_alias("--steps", "trial_steps", type=int)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16" if cuda else "fp32")
    parser.add_argument("--_trial", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not set(harness.parse_list(args.impls, str)) <= {"ours", "peer"}:
        parser.error("--impls: a list of ours and/or peer")
    if not set(harness.parse_list(args.checkpointing)) <= {0, 1}:
        parser.error("--checkpointing: a list of 1 and/or 0")
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args._trial:
        run_trial_here(args._trial, args)
        return None
    device = sd.runtime.pick_device(args.device)
    sd.runtime.start_process()
    limit = args.limit_gb or (torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda"
                              else 0.4)
    print(f"{args.arch} UNet, {args.resolution} px, {args.precision}, AdamW + EMA, {harness.device_name(device)}; "
          f"a batch fits in {limit:.1f} GB")
    rows = []
    for checkpointing in harness.parse_list(args.checkpointing):
        for impl in harness.parse_list(args.impls, str):
            if device.type == "cuda":
                trial = GpuTrials(impl, bool(checkpointing), args, device)
            else:
                trial = lambda batch, impl=impl, ck=checkpointing: cpu_trial(impl, bool(ck), batch, args)  # noqa: E731
            trial = memoized(trial)
            at_batch = {"batch": args.batch, **trial(args.batch)}
            largest, tried = largest_batch(trial, limit, args.max_batch)
            rows.append({"impl": impl, "checkpointing": bool(checkpointing), "largest_batch": largest,
                         "capped": largest >= args.max_batch, "peak_gb_at_batch": at_batch.get("peak_gb"),
                         "oom_at_batch": bool(at_batch.get("oom")), "trials": tried})
            del trial
            harness.release(device)

    harness.print_table(rows, lambda row: f"{row['impl']} {'with' if row['checkpointing'] else 'without'} "
                        "checkpointing", [("largest_batch", "max batch", "d"),
                                          ("peak_gb_at_batch", f"GB at {args.batch}", ".2f")])
    compared = []
    for checkpointing in (True, False):
        pair = {row["impl"]: row for row in rows if row["checkpointing"] == checkpointing}
        if set(pair) != {"ours", "peer"}:
            continue
        ours, peer = pair["ours"], pair["peer"]
        entry = {"checkpointing": checkpointing,
                 "largest_batch_ratio": round(ours["largest_batch"] / peer["largest_batch"], 3)
                 if peer["largest_batch"] else None,
                 "peak_ratio_at_batch": round(ours["peak_gb_at_batch"] / peer["peak_gb_at_batch"], 3)
                 if ours["peak_gb_at_batch"] and peer["peak_gb_at_batch"] else None}
        compared.append(entry)
        print(f"ratio ours/peer {'with' if checkpointing else 'without'} checkpointing: largest batch "
              f"{ours['largest_batch']}/{peer['largest_batch']} = {entry['largest_batch_ratio']}x; "
              f"peak at batch {args.batch} = {entry['peak_ratio_at_batch']}x")
    result = {"benchmark": "memory", "device": harness.device_name(device), "arch": args.arch,
              "resolution": args.resolution, "precision": args.precision, "limit_gb": round(limit, 2),
              "batch": args.batch, "torch": torch.__version__, "rows": rows, "ratios": compared}
    harness.emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
