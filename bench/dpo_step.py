"""Benchmark: the step time and memory of Diffusion-DPO against plain fine-tuning of the same adapter, in one run.

    python bench/dpo_step.py                       # CPU: demo UNet, 64 px, 2 pairs, LoRA rank 4; sd1 estimates at 512
    python bench/dpo_step.py --unet tiny --resolution 32 --whole_unet --no_estimate
    python bench/dpo_step.py --lora_type loha --dora --lora_rank 16 --batch 4
    python bench/dpo_step.py --smoke               # tiny, 32 px, 2 steps, 1 repeat, no estimate: a few seconds
    python bench/dpo_step.py --unet sd1 --resolution 512 --batch 4 --precision bf16      # GPU (the defaults there)

A Diffusion-DPO micro-batch of B pairs (``sd.train.objectives.preference``) runs the UNet on 2B images with
gradients (the preferred and the rejected image of each pair) and on the same 2B without (the frozen reference:
with an adapter, the same UNet with its adapters off; for a whole UNet, a frozen copy in the autocast type).
The same preset and adapter are built twice in this process, each through ``sd.train.step.build_step`` and
timed through ``sd.train.step.train_step`` as the trainer runs them (adapters attached by the config's mode,
fused AdamW, clipping at 1.0, CFG dropout 0.05, no EMA, no Min-SNR weighting: DPO refuses it, and the plain
run drops it too so the two differ by the objective only), on random fp16 latents and token ids built in
memory (``harness.synthetic_batch``; the rejected latents drawn with another seed). Rows:

* ``plain-ADAPTER B``: plain fine-tuning on B images (the preferred latents): the same number of pairs;
* ``plain-ADAPTER 2B``: the same step on 2B images (both latents of each pair): the same images through the
  UNet with gradients as DPO, the fair comparison;
* ``dpo-ADAPTER``: Diffusion-DPO on the B pairs;
* with ``--whole_unet``, the same three with every UNet weight trained (``lora_rank: 0``): ``plain-whole``,
  ``dpo-whole``.

ADAPTER is ``--lora_type`` (lora, loha, lokr), with ``+dora`` under ``--dora``. Per row: the step time, the
median over ``--repeats`` of the mean of ``--steps`` consecutive steps (``harness.time_steps``), after
``--warmup`` untimed steps; the loss of the first step (DPO's is ln 2 = 0.693 exactly where the model starts
as its reference: a LoRA's up-projection is zero, a whole UNet's copy equal); the trainable parameters.
Ratios: DPO / plain at B images, and DPO / plain at 2B images (the reference's forward passes, without
gradients, on top of the 2B-image step).

Memory:
* on CUDA, ``torch.cuda.max_memory_allocated`` over each row's timed steps (the steady state: the peak is reset
  after the warm-up), each configuration built, timed and freed in turn so that its peak is its own;
* everywhere (unless ``--no_estimate``), ``sd.train.memory.estimate`` of each configuration on the
  ``--estimate_unet`` preset (default sd1, its text encoder and VAE) at ``--estimate_resolution`` px and
  ``--estimate_precision``, on fake tensors (no weights, no GPU: about 10 s each for sd1 on a 2-core CPU):
  the predicted CUDA peak allocated, and its parts side by side, the ones that differ from the 2B-image plain
  step marked (the activations; a whole-UNet DPO's ``reference`` copy);
* on the CPU, host memory, labelled so (not a GPU figure): the growth of this process's peak resident set
  (``VmHWM``, reset through ``/proc/self/clear_refs``, after ``malloc_trim``) over each row's last warm-up step
  (``host step``, MiB), and over each configuration's build (``host build``: the weights, the adapter, the
  reference copy). A first build and step are thrown away, so the process's one-time set-up (lazy imports,
  kernels' first use) is no row's; with ``--warmup`` 2 or more every row has made a step before any is measured,
  so the optimizer state is no row's either (with 1, the first row's). Where ``/proc`` does not allow the reset,
  ``None``.
On a CPU the rows are built together and their timed repeats alternate, the order reversed every other repeat
(drift on a shared machine hits every row alike), in ``--threads`` threads (default 1). Prints a table, the
ratios, the estimate's parts, a one-line summary and one JSON line (also to ``--json``).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import sd.cli
import sd.model
import sd.runtime
import sd.train.memory
import sd.train.modes
import sd.train.step
from bench import harness
from sd.distributed import Dist
from sd.train.config import TrainConfig

SMOKE = dict(unet="tiny", resolution=32, steps=2, repeats=1, warmup=1, estimate=False)  # --smoke's defaults
MIB, GIB = 2**20, 2**30
SIDES = {1: "B", 2: "2B"}  # the plain rows, by images a pair: B images (the pairs' count), 2B (DPO's with gradients)


@dataclass(frozen=True)
class Run:
    """One configuration built once: plain or DPO, of an adapter or the whole UNet."""

    dpo: bool
    whole: bool
    adapter: str  # lora, loha, lokr (with +dora), or whole

    @property
    def name(self) -> str:
        return f"{'dpo' if self.dpo else 'plain'}-{self.adapter}"


def runs_of(args) -> list[Run]:
    adapter = args.lora_type + "+dora" * args.dora
    kinds = [(False, adapter)] + [(True, "whole")] * args.whole_unet
    return [Run(dpo, whole, name) for whole, name in kinds for dpo in (False, True)]


def config_of(args, run: Run, unet: str, precision: str) -> TrainConfig:
    """The trainer's config of ``run`` on the ``unet`` preset (its text encoder and VAE: tiny below sd1)."""
    small = unet != "sd1"
    adapter = dict(lora_rank=0) if run.whole else dict(lora_rank=args.lora_rank, lora_type=args.lora_type,
                                                       dora=args.dora)
    config = TrainConfig(unet=unet, text_encoder="tiny" if small else "sd1", vae="tiny" if small else "sd1",
                         datasets=[], batch_size=args.batch, grad_accum=1, precision=precision,
                         grad_checkpointing=args.checkpointing, ema_decay=0.0, min_snr_gamma=0.0,
                         preference={"method": "dpo" if run.dpo else ""}, **adapter)
    config.validate(check_paths=False)  # a combination the trainer refuses is refused here, with its message
    return config


# ---------------------------------------------------------------------------------------------
# One configuration's step, its micro-batches and its rows
# ---------------------------------------------------------------------------------------------


def built_step(config: TrainConfig, device: torch.device):
    """``(train(micro_batches) -> StepResult, trainable parameters)``: the step SD_Train builds for ``config``
    on seeded random weights, adapters attached by the config's mode."""
    text_encoder = harness.random_text_encoder("sd1" if config.unet == "sd1" else "tiny")
    unet = sd.model.build_unet(config.unet, from_scratch=False, seed=config.seed,
                               grad_checkpointing=config.grad_checkpointing).to(device).train()
    mode = sd.train.modes.mode_of(config)
    mode.estimate_before_data(unet, text_encoder)
    unet = mode.estimate_attach(unet, text_encoder)
    step = sd.train.step.build_step(config, Dist.single(device), unet, text_encoder, harness.empty_prompt_ids(),
                                   sd.model.SD1_SCALING_FACTOR, mode)
    sd.train.step.wrap_model(step, False)
    sd.train.step.set_lr(step.optimizer, config.lr)
    count = iter(range(10**9))

    def train(micro_batches):
        with sd.model.attention_context(device):
            return sd.train.step.train_step(step, micro_batches, next(count))

    return train, sum(p.numel() for p in step.trainable)


def rows_of(run: Run, pairs: int, latent: int, device: torch.device) -> list[dict]:
    """The rows of ``run``, each with the micro-batch it trains on (``batch``, dropped from the result): DPO's
    B pairs (preferred latents, token ids, rejected latents); plain at B images, then at 2B (both of each pair,
    the prompts twice)."""
    preferred, input_ids = harness.synthetic_batch(pairs, latent, seed=0)
    rejected, _ = harness.synthetic_batch(pairs, latent, seed=1)
    on = [t.to(device) for t in (preferred, input_ids, rejected)]
    base = {"dpo": run.dpo, "adapter": run.adapter, "pairs": pairs}
    if run.dpo:
        return [{**base, "name": run.name, "images_with_grad": 2 * pairs, "images_through_unet": 4 * pairs,
                 "batch": [tuple(on)]}]
    both = (torch.cat([on[0], on[2]]), torch.cat([on[1], on[1]]))
    return [{**base, "name": plain_name(run.adapter, n), "images_with_grad": n * pairs,
             "images_through_unet": n * pairs, "batch": [batch]} for n, batch in ((1, tuple(on[:2])), (2, both))]


def plain_name(adapter: str, images_per_pair: int) -> str:
    """The plain row of ``adapter`` at B (1 image a pair) or 2B images."""
    return f"plain-{adapter} {SIDES[images_per_pair]}"


# ---------------------------------------------------------------------------------------------
# Host memory (CPU): the peak resident set, reset per measure
# ---------------------------------------------------------------------------------------------


def host_status(field: str) -> int | None:
    """``VmRSS`` or ``VmHWM`` of this process in bytes (None without /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def on_host(work, device: torch.device) -> float | None:
    """``work()``, and on a CPU the growth of the host's peak it made (``host_peak_growth``); None on a GPU."""
    if device.type == "cpu":
        return host_peak_growth(work)
    work()
    return None


def host_peak_growth(work) -> float | None:
    """MiB by which this process's peak resident set rose above its resident set before ``work()``. Freed heap
    is handed back first (``malloc_trim``: glibc keeps freed blocks, which would hide a later growth), then the
    peak is reset to the current resident set (writing 5 to ``/proc/self/clear_refs``); None where either is
    not possible (then ``work()`` runs all the same)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        before = host_status("VmRSS")
    except OSError:
        before = None
    work()
    after = host_status("VmHWM")
    return None if before is None or after is None else round((after - before) / MIB, 1)


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def warm_up(train, rows: list[dict], warmup: int, device: torch.device) -> None:
    """``warmup`` untimed steps of each row in turn, the rows alternating: the first step's loss is kept, and on a
    CPU the host memory of the last (with two or more, every row of the configuration has made a step before:
    the optimizer state is no row's)."""
    for index in range(warmup):
        for row in rows:
            def one(row=row, first=index == 0):
                result = train(row["batch"])
                if first:
                    row["first_loss"] = float(result["loss"])

            if index == warmup - 1:
                row["host_step_mib"] = on_host(one, device)
            else:
                one()


def time_row(train, row: dict, device: torch.device, steps: int) -> None:
    """One repeat: the mean seconds of ``steps`` consecutive steps of ``row``, appended to its ``step_s``."""
    row.setdefault("step_s", []).append(harness.time_steps(lambda: train(row["batch"]), device, 0, steps))


def measure(runs: list[Run], args, device: torch.device) -> list[dict]:
    """Every row of ``runs``: on a CPU built together and timed in alternation; on a GPU each configuration
    built, warmed, timed and freed in turn, its peak reset before each row's timed steps."""
    latent = args.resolution // 8  # every preset's VAE: a latent cell for 8x8 pixels
    if device.type == "cpu":
        set_up_once(runs[0], args, latent, device)
    live, rows = [], []
    for run in runs:
        own = rows_of(run, args.batch, latent, device)
        train, trainable, host_build = build_measured(run, args, device)
        for row in own:
            row.update(trainable_params=trainable, host_build_mib=host_build)
        warm_up(train, own, args.warmup, device)
        rows += own
        if device.type == "cpu":
            live += [(train, row) for row in own]
            continue
        for row in own:
            harness.reset_peak(device)
            for _ in range(args.repeats):
                time_row(train, row, device, args.steps)
            row.update(harness.peak_gb(device), peak_allocated_bytes=torch.cuda.max_memory_allocated(device))
        del train  # freed before the next configuration is built: each GPU peak is its own
        harness.release(device)
    for repeat in range(args.repeats if live else 0):
        for train, row in live if repeat % 2 == 0 else live[::-1]:
            time_row(train, row, device, args.steps)
    for row in rows:
        del row["batch"]
        row["step_ms"] = round(1000 * statistics.median(row["step_s"]), 2)
    return rows


def build_measured(run: Run, args, device: torch.device) -> tuple:
    """``(train, trainable parameters, host build MiB)`` of ``run``'s step (``built_step``)."""
    made = []
    host = on_host(lambda: made.append(built_step(config_of(args, run, args.unet, args.precision), device)), device)
    return (*made[0], host)


def set_up_once(run: Run, args, latent: int, device: torch.device) -> None:
    """A build and step of ``run`` thrown away: the process's one-time set-up (lazy imports, the first use of each
    kernel, thread pools) is then no row's host memory."""
    train, _ = built_step(config_of(args, run, args.unet, args.precision), device)
    train(rows_of(run, args.batch, latent, device)[0]["batch"])


def estimates(runs: list[Run], args) -> dict:
    """``sd.train.memory``'s prediction of each row on ``--estimate_unet`` at ``--estimate_resolution``: a
    plain configuration at B and 2B images in one session, DPO at B pairs. ``{row name: Estimate}``."""
    found = {}
    for run in runs:
        config = config_of(args, run, args.estimate_unet, args.estimate_precision)
        started = time.perf_counter()
        with sd.train.memory.session(config, args.estimate_resolution, device="cuda") as step_at:
            sizes = [(run.name, args.batch)] if run.dpo else [(plain_name(run.adapter, n), n * args.batch)
                                                              for n in (1, 2)]
            for name, batch in sizes:
                found[name] = step_at(batch)
        print(f"estimated {run.name} on {args.estimate_unet} at {args.estimate_resolution} px in "
              f"{time.perf_counter() - started:.0f} s")
    return found


def with_estimate(row: dict, estimate) -> dict:
    """``row`` with the predicted peak allocated (bytes and GiB) and its parts (MiB)."""
    return {**row, "estimate_bytes": estimate.allocated, "estimate_gib": round(estimate.allocated / GIB, 4),
            "estimate_parts_mib": {name: round(size / MIB, 1) for name, size in estimate.parts.items()}}


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def ratio(ours, theirs) -> float | None:
    return round(ours / theirs, 3) if ours is not None and theirs else None


def ratios(rows: list[dict]) -> list[dict]:
    """Per adapter: DPO / plain at B images and at 2B images, of the step time, the measured peak and the
    predicted peak (None where either is missing)."""
    by_name = {row["name"]: row for row in rows}
    found = []
    for row in [r for r in rows if r["dpo"]]:
        entry = {"adapter": row["adapter"], "pairs": row["pairs"]}
        for n, side in SIDES.items():
            plain = by_name[plain_name(row["adapter"], n)]
            for key, field in (("step", "step_ms"), ("peak", "peak_allocated_bytes"), ("estimate", "estimate_bytes")):
                entry[f"{key}_vs_plain_{side}"] = ratio(row.get(field), plain.get(field))
        found.append(entry)
    return found


def print_rows(rows: list[dict]) -> None:
    harness.print_table(rows, lambda row: row["name"], [
        ("images_with_grad", "img grad", "d"), ("images_through_unet", "img UNet", "d"), ("step_ms", "step ms", ".1f"),
        ("first_loss", "1st loss", ".4f"), ("peak_allocated_gb", "peak GiB", ".2f"), ("estimate_gib", "est. GiB", ".3f"),
        ("host_build_mib", "host build", ".1f"), ("host_step_mib", "host step", ".1f"),
        ("trainable_params", "trainable", ",d")])
    print("img grad / img UNet: images through the UNet with gradients / in all (DPO's reference: without)")
    if any(row["host_build_mib"] is not None for row in rows):
        print("host build / host step: MiB by which this process's peak resident set grew over the build / the last "
              "warm-up step (host memory, not a GPU's)")


def print_ratios(compared: list[dict]) -> None:
    for entry in compared:
        for n, side in SIDES.items():
            parts = [f"{what} {entry[f'{key}_vs_plain_{side}']:.3f}x" for key, what in
                     (("step", "step time"), ("peak", "measured peak"), ("estimate", "predicted peak"))
                     if entry[f"{key}_vs_plain_{side}"] is not None]
            print(f"ratio dpo-{entry['adapter']}/plain-{entry['adapter']} {side} ({n * entry['pairs']} images): "
                  + ", ".join(parts))


def print_parts(rows: list[dict]) -> None:
    """The estimate's parts (MiB), a column per row; ``*`` marks a part where a DPO row differs from the plain
    2B-image row of its adapter by more than 0.1 MiB."""
    estimated = [row for row in rows if "estimate_parts_mib" in row]
    if not estimated:
        return
    parts = list(dict.fromkeys(part for row in estimated for part in row["estimate_parts_mib"]))
    by_name = {row["name"]: row["estimate_parts_mib"] for row in estimated}

    def differs(part: str) -> bool:
        return any(abs(by_name[row["name"]].get(part, 0) - by_name[plain_name(row["adapter"], 2)].get(part, 0)) > 0.1
                   for row in estimated if row["dpo"])

    width = max(16, *(len(row["name"]) + 2 for row in estimated))
    print("predicted peak (CUDA, allocated) by part, MiB; * where DPO and the plain 2B-image step differ")
    print(f"{'':32}" + "".join(f"{row['name']:>{width}}" for row in estimated))
    for part in parts:
        label = f"{'*' if differs(part) else ' '} {part}"
        print(f"{label:32}" + "".join(f"{by_name[row['name']].get(part, 0.0):>{width}.1f}" for row in estimated))
    print(f"{'  allocated':32}" + "".join(f"{row['estimate_bytes'] / MIB:>{width}.1f}" for row in estimated))


def summary(compared: list[dict]) -> str:
    parts = []
    for entry in compared:
        pairs = entry["pairs"]
        text = (f"dpo-{entry['adapter']} ({pairs} pairs): {entry['step_vs_plain_2B']:.2f}x the step time of plain "
                f"{entry['adapter']} on {2 * pairs} images, {entry['step_vs_plain_B']:.2f}x on {pairs}")
        for key, what in (("peak", "measured peak"), ("estimate", "predicted peak")):
            if entry[f"{key}_vs_plain_2B"] is not None:
                text += f"; {what} {entry[f'{key}_vs_plain_2B']:.2f}x / {entry[f'{key}_vs_plain_B']:.2f}x"
        parts.append(text)
    return "summary: " + " | ".join(parts)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--unet", choices=sorted(sd.model.UNET_PRESETS), default="sd1" if cuda else "demo",
                        help="UNet preset timed (tiny and demo with the tiny text encoder; default: sd1 on a GPU, "
                        "else demo)")
    parser.add_argument("--resolution", type=int, default=512 if cuda else 64, help="image pixels; latents are 1/8")
    parser.add_argument("--batch", type=int, default=4 if cuda else 2, help="pairs per DPO micro-batch B; the plain "
                        "rows train B and 2B images")
    parser.add_argument("--lora_rank", type=int, default=4, help="the adapter's rank")
    parser.add_argument("--lora_type", choices=["lora", "loha", "lokr"], default="lora", help="the adapter's kind")
    parser.add_bool("--dora", help="DoRA: a learned magnitude beside the adapter")
    parser.add_bool("--whole_unet", help="also plain and DPO of the whole UNet (DPO holds a frozen copy)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16" if cuda else "fp32",
                        help="the timed runs' precision (default: bf16 on a GPU, else fp32)")
    parser.add_bool("--checkpointing", help="gradient checkpointing, timed runs and estimates")
    parser.add_argument("--steps", type=int, default=10 if cuda else 4, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3 if cuda else 5, help="timed repeats per row (the median)")
    parser.add_argument("--warmup", type=int, default=3 if cuda else 2, help="untimed steps per row (at least 1)")
    parser.add_argument("--threads", type=int, default=0 if cuda else 1, help="CPU threads; 0 = torch's choice")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_bool("--estimate", default=True, help="sd.train.memory's predicted CUDA peak of each row")
    parser.add_argument("--no_estimate", dest="estimate", action="store_false", help="the same as --estimate false")
    parser.add_argument("--estimate_unet", choices=sorted(sd.model.UNET_PRESETS), default="sd1",
                        help="the preset the estimate builds (on fake tensors)")
    parser.add_argument("--estimate_resolution", type=int, default=512, help="the estimate's image pixels")
    parser.add_argument("--estimate_precision", choices=["fp32", "bf16", "fp16"], default="bf16",
                        help="the estimate's precision")
    parser.add_bool("--smoke", help=f"a quick check: defaults {SMOKE} (flags given still win)")
    parser.add_argument("--json", default="", help="also write the result JSON to this file")
    if parser.parse_known_args(argv)[0].smoke:
        parser.set_defaults(**SMOKE)
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args) -> None:
    for name in ("batch", "lora_rank", "steps", "repeats", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    for flag, preset, pixels in (("--resolution", args.unet, args.resolution),
                                 ("--estimate_resolution", args.estimate_unet, args.estimate_resolution)):
        multiple = 8 * 2 ** (len(sd.model.UNET_PRESETS[preset]["down_block_types"]) - 1)
        if pixels % multiple:
            parser.error(f"{flag} must be a multiple of {multiple} for the {preset} UNet, got {pixels}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = sd.runtime.pick_device(args.device)
    sd.runtime.start_process(threads=args.threads or None)
    runs = runs_of(args)
    print(f"{args.unet} UNet, {args.resolution} px, {args.precision}, {harness.device_name(device)} "
          f"({torch.get_num_threads()} threads): {args.batch} pairs, {runs[0].adapter} rank {args.lora_rank}"
          + (" and the whole UNet" if args.whole_unet else "") + (", checkpointing" if args.checkpointing else "") + f"; {args.warmup} warm-up steps, median of "
          f"{args.repeats} x {args.steps} steps")
    rows = measure(runs, args, device)
    if args.estimate:
        predicted = estimates(runs, args)
        rows = [with_estimate(row, predicted[row["name"]]) for row in rows]
    print_rows(rows)
    compared = ratios(rows)
    print_ratios(compared)
    print_parts(rows)
    line = summary(compared)
    print(line)
    result = {"benchmark": "dpo_step", "device": harness.device_name(device), "unet": args.unet,
              "resolution": args.resolution, "precision": args.precision, "pairs": args.batch,
              "lora_rank": args.lora_rank, "lora_type": args.lora_type, "dora": args.dora,
              "checkpointing": args.checkpointing, "steps": args.steps, "repeats": args.repeats,
              "warmup": args.warmup, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "estimate_unet": args.estimate_unet if args.estimate else None,
              "estimate_resolution": args.estimate_resolution if args.estimate else None,
              "rows": rows, "ratios": compared, "summary": line}
    harness.emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
