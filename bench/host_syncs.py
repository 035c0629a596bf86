"""Benchmark: host syncs and dispatched operators per optimizer step of sd.train.step.train_step.

    python bench/host_syncs.py                                        # CPU: tiny UNet, 64 px
    python bench/host_syncs.py --arch sd1 --resolution 512 --batch 16  # GPU

The step is bench/train_throughput.py's (``step_config``: fused AdamW, EMA on the device, Min-SNR,
CFG dropout, clipping, the text encoder's forward). After ``--warmup`` steps, a window of ``--steps``
optimizer steps runs as the training loop makes them between two of its logging points, then the
loop's one read of the step statistics:

* ``syncs_per_step``: on a GPU, every place the host waited for the device inside the window (a
  value read, a blocking copy, a synchronize), each one a warning under
  ``torch.cuda.set_sync_debug_mode("warn")``; on a CPU, where nothing waits, the reads of a
  tensor's value instead (bench/step_overhead.py's count). The statistics' read after the window is
  counted apart (``reads_at_logging``).
* ``ops_per_step``: ATen operators dispatched per step below autograd (forward, backward, clipping,
  the optimizer and the EMA), views and bare allocations left out: on a GPU each is one kernel launch
  (or one host-side call a fused kernel replaces), the fixed per-step cost the host pays whatever the
  batch. ``top_ops`` lists the most frequent.

Prints the counts and where each sync happened, and one JSON line.
"""

from __future__ import annotations

import collections
import warnings

import torch

import sd.model
import sd.runtime
import sd.train.step
from bench import harness
from bench.step_overhead import counting_mode
from bench.train_throughput import Variant, step_config
from sd.distributed import Dist


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--batch", type=int, default=16 if cuda else 2, help="images per optimizer step")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16" if cuda else "fp32",
                        help="bf16 autocast (GPU default) or fp32")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the window (optimizer state made)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps in the counted window")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = sd.runtime.pick_device(args.device)
    sd.runtime.start_process()
    config = step_config(args.arch, Variant(compile=False, channels_last=False, checkpointing=False), args.precision)
    unet = sd.model.build_unet(config.unet, seed=config.seed).to(device).train()
    step = sd.train.step.build_step(config, Dist.single(device), unet, harness.random_text_encoder(args.arch),
                                   harness.empty_prompt_ids(), sd.model.SD1_SCALING_FACTOR)
    latents, input_ids = harness.synthetic_batch(args.batch, args.resolution // harness.vae_factor(args.arch))
    if device.type == "cuda":
        latents, input_ids = latents.pin_memory(), input_ids.pin_memory()
    index = iter(range(10**9))

    def window(steps: int) -> list:
        with sd.model.attention_context(device):
            return [sd.train.step.train_step(step, [(latents, input_ids)], next(index)) for _ in range(steps)]

    sd.train.step.read_results(window(args.warmup))
    sd.runtime.synchronize(device)
    sites = collections.Counter()
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                results = window(args.steps)
                inside = len(caught)
                sd.train.step.read_results(results)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for warning in caught[:inside]:
            sites[str(warning.message).splitlines()[0][:160]] += 1
        at_logging = len(caught) - inside
        count_ops = counting_mode(harness.ROOT)
        try:
            with count_ops:
                sd.train.step.read_results(window(args.steps))
        finally:
            count_ops.uninstall()
    else:
        count_ops = counting_mode(harness.ROOT)
        try:
            with count_ops:
                results = window(args.steps)
                inside = sum(count_ops.syncs.values())
                sites.update(count_ops.syncs)
                sd.train.step.read_results(results)
        finally:
            count_ops.uninstall()
        at_logging = sum(count_ops.syncs.values()) - inside
    losses = [result["loss"] for result in results]
    ops_per_step = sum(count_ops.ops.values()) / args.steps
    how = "set_sync_debug_mode('warn') warnings" if device.type == "cuda" else "host reads of a tensor's value"
    print(f"{args.arch} UNet, {args.resolution} px, batch {args.batch}, {args.precision}, "
          f"{harness.device_name(device)}: {inside / args.steps:g} syncs per optimizer step ({how}) over "
          f"{args.steps} steps, {at_logging} at the logging read after them; {ops_per_step:,.0f} operators "
          f"dispatched per step")
    for site, count in sites.most_common():
        print(f"  {count} x {site}")
    result = {"benchmark": "host_syncs", "device": harness.device_name(device), "arch": args.arch,
              "resolution": args.resolution, "batch": args.batch, "precision": args.precision,
              "torch": torch.__version__, "steps": args.steps, "counted_by": how,
              "syncs_per_step": inside / args.steps, "reads_at_logging": at_logging, "sync_sites": dict(sites),
              "ops_per_step": ops_per_step, "top_ops": dict(count_ops.ops.most_common(12)),
              "losses_finite": all(loss == loss and abs(loss) != float("inf") for loss in losses)}
    harness.emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
