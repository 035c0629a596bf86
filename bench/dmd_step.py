"""Benchmark: the step time and memory of DMD distillation against LCM distillation of the same adapter, in one run.

    python bench/dmd_step.py                       # CPU: demo UNet, 64 px, 2 images, LoRA rank 4; sd1 estimates at 512
    python bench/dmd_step.py --unet tiny --resolution 32 --whole_unet --no_estimate
    python bench/dmd_step.py --fake_updates 10 --gan_weight 1e-3 --dmd_steps 4 --lora_rank 16 --batch 4
    python bench/dmd_step.py --smoke               # tiny, 32 px, 2 fake updates, 2 steps, 1 repeat, no estimate
    python bench/dmd_step.py --unet sd1 --resolution 512 --batch 4 --precision bf16      # GPU (the defaults there)

Both distill a teacher (``init_from``; here the seeded random UNet itself) into a few-step model. An LCM step
(``distill.method: lcm``, ``sd.train.objectives.lcm``) on B images runs the student once with gradients, the
teacher without on 2B (the conditional and unconditional prompts, one solver step) and the target (an EMA of the
student) without on B. A DMD step (``distill.method: dmd``, ``sd.train.objectives.dmd``) on B prompts first
updates the fake score ``dmd.fake_updates`` times (each: the generator's images drawn without gradients, the fake
score's loss with them, its own AdamW step), then the generator draws its images with gradients and both scores
predict them noised again without (the teacher on 2B under guidance); with ``dmd.gan_weight`` > 0 a critic on the
fake score's middle-block features adds passes through the down and middle blocks (two per fake update, with
gradients: the generator's images and the data's latents; one in the generator's loss). With an adapter the
teacher is the UNet with its adapters off, and LCM's target and DMD's fake score are second sets of adapter
weights on the same UNet; a whole UNet keeps a frozen teacher copy in the autocast type beside them (LCM's target:
a float32 EMA; DMD's fake score: a whole float32 copy with its AdamW state).

Each configuration is built through ``sd.train.step.build_step`` and timed through ``sd.train.step.train_step`` as
the trainer runs them (adapters attached by the config's mode, fused AdamW, clipping at 1.0, no EMA, no Min-SNR
weighting: DMD refuses it, and LCM drops it too so the two differ by the objective only), on random fp16 latents
and token ids built in memory (``harness.synthetic_batch``). Rows:

* ``lcm-ADAPTER``: the LCM step on B images;
* ``dmd-ADAPTER``: the DMD step on B prompts with ``dmd.fake_updates`` = ``--fake_updates`` and no GAN term
  (data-free);
* ``dmd-ADAPTER+gan``: the same with ``dmd.gan_weight`` = ``--gan_weight`` (the critic, trained on the latents);
* ``dmd-ADAPTER fake update`` and ``dmd-ADAPTER+gan fake update``: one fake-score update alone
  (``DistributionMatching.update_fake``) of the same built step, on the same prompts (encoded once, as the loss
  encodes them once for all its updates) and latents;
* with ``--whole_unet``, the same with every UNet weight trained (``lora_rank: 0``): ``lcm-whole``,
  ``dmd-whole``, ``dmd-whole+gan`` and their fake updates.

ADAPTER is ``--lora_type`` (lora, loha, lokr), with ``+dora`` under ``--dora``. Per row: the step time (the median
over ``--repeats`` of the mean of ``--steps`` consecutive steps, ``harness.time_steps``, after ``--warmup`` untimed
steps); the loss of the first step; the trainable parameters; the images through the whole UNet (with gradients,
and in all) and through its down and middle blocks only (the critic's features, with gradients). The generator's
part of a DMD step, its passes after the fake updates, is derived, not timed: the step's time less
``fake_updates`` times one update's (a fake update cannot be left out of a step: ``dmd.fake_updates`` is at least
1). Ratios: DMD / LCM and DMD+GAN / LCM of each adapter's step time, measured and predicted peak.

Memory:
* on CUDA, ``torch.cuda.max_memory_allocated`` over each row's timed steps (the steady state: the peak is reset
  after the warm-up), each configuration built, timed and freed in turn so that its peak is its own;
* everywhere (unless ``--no_estimate``), ``sd.train.memory.estimate`` of each configuration on the
  ``--estimate_unet`` preset (default sd1, its text encoder and VAE) at ``--estimate_resolution`` px and
  ``--estimate_precision``, on fake tensors (no weights, no GPU): the predicted CUDA peak allocated and its ratio
  to LCM's, and its parts side by side, the ones where DMD differs from LCM marked; ``distillation`` is what the
  objective holds besides the step's model (LCM: its target network, and a whole UNet's teacher copy; DMD: the
  fake score's weights, the critic's and their AdamW moments, and a whole UNet's teacher copy). The DMD steps are
  estimated with ``--estimate_fake_updates`` (default 1): each update frees its activations before the next, so
  the peak is the same for any count, while each costs the estimate about as much as a step (sd1 at 512 px on a
  2-core CPU: about 25 s for LCM, 25 s for DMD with one update, 70 s with five);
* on the CPU, host memory, labelled so (not a GPU figure): the growth of this process's peak resident set
  (``VmHWM``, reset through ``/proc/self/clear_refs``, after ``malloc_trim``) over each row's last warm-up step
  (``host step``, MiB), and over each configuration's build (``host build``: the weights, the adapters, the
  copies). A first build and step are thrown away, so the process's one-time set-up (lazy imports, kernels'
  first use) is no row's; with ``--warmup`` 2 or more every row has made a step before any is measured, so the
  optimizers' state is no row's either (with 1, the first row's). Where ``/proc`` does not allow the reset,
  ``None``.
On a CPU the rows are built together and their timed repeats alternate, the order reversed every other repeat
(drift on a shared machine hits every row alike), in ``--threads`` threads (default 1). Prints a table, the
ratios, the per-pass costs, the estimate's parts, a one-line summary and one JSON line (also to ``--json``).
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
from sd.train.objectives.base import scaled_latents

SMOKE = dict(unet="tiny", resolution=32, steps=2, repeats=1, warmup=1, fake_updates=2, estimate=False)  # --smoke's
MIB, GIB = 2**20, 2**30
FAKE = " fake update"  # the suffix of a DMD configuration's fake-update row


@dataclass(frozen=True)
class Run:
    """One configuration built once: LCM or DMD (with or without the GAN term), of an adapter or the whole UNet."""

    method: str  # lcm or dmd
    whole: bool
    adapter: str  # lora, loha, lokr (with +dora), or whole
    gan: bool = False

    @property
    def name(self) -> str:
        return f"{self.method}-{self.adapter}" + "+gan" * self.gan


def runs_of(args) -> list[Run]:
    adapter = args.lora_type + "+dora" * args.dora
    kinds = [(False, adapter)] + [(True, "whole")] * args.whole_unet
    return [Run(method, whole, name, gan) for whole, name in kinds
            for method, gan in (("lcm", False), ("dmd", False), ("dmd", True))]


def config_of(args, run: Run, unet: str, precision: str, fake_updates: int = 0) -> TrainConfig:
    """The trainer's config of ``run`` on the ``unet`` preset (its text encoder and VAE: tiny below sd1), with
    ``fake_updates`` (0: ``--fake_updates``). The teacher, ``init_from``, is not read: the paths are not checked
    (the UNet's own seeded weights stand in)."""
    small = unet != "sd1"
    adapter = dict(lora_rank=0) if run.whole else dict(lora_rank=args.lora_rank, lora_type=args.lora_type,
                                                       dora=args.dora)
    method = {"distill": {"method": run.method}}
    if run.method == "dmd":  # the validation grid draws in the generator's own steps, unguided
        method.update(dmd={"steps": args.dmd_steps, "guidance": args.guidance,
                           "fake_updates": fake_updates or args.fake_updates,
                           "gan_weight": args.gan_weight if run.gan else 0.0},
                      validation={"steps": args.dmd_steps, "cfg": 1.0})
    config = TrainConfig(unet=unet, text_encoder="tiny" if small else "sd1", vae="tiny" if small else "sd1",
                         datasets=[], batch_size=args.batch, grad_accum=1, precision=precision,
                         grad_checkpointing=args.checkpointing, ema_decay=0.0, min_snr_gamma=0.0, **method, **adapter)
    config.validate(check_paths=False)  # a combination the trainer refuses is refused here, with its message
    return config


def passes(run: Run, args, fake_update: bool = False) -> dict:
    """Images of a row through the whole UNet (with gradients, and in all) and through its down and middle blocks
    only (the critic's features, all with gradients), for B = ``--batch`` images."""
    b, draws = args.batch, args.dmd_steps  # a generator's draw: dmd.steps passes, the last its own
    teacher = 2 * b if args.guidance != 1 else b
    if run.method == "lcm":
        return {"images_with_grad": b, "images_through_unet": 4 * b, "images_critic": 0}
    update = {"images_with_grad": b, "images_through_unet": draws * b + b, "images_critic": 2 * b * run.gan}
    if fake_update:
        return update
    k = args.fake_updates
    return {"images_with_grad": k * b + b, "images_through_unet": k * update["images_through_unet"] + draws * b + b
            + teacher, "images_critic": k * update["images_critic"] + b * run.gan}


# ---------------------------------------------------------------------------------------------
# One configuration's step, its calls and its rows
# ---------------------------------------------------------------------------------------------


def built_step(config: TrainConfig, device: torch.device):
    """``(train(micro_batches) -> StepResult, the step, trainable parameters)``: the step SD_Train builds for
    ``config`` on seeded random weights, adapters attached by the config's mode."""
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

    return train, step, sum(p.numel() for p in step.trainable)


def fake_update_of(step, batch: tuple, device: torch.device):
    """``update()``: one fake-score update of ``step``'s DMD objective alone, as its loss runs each: on the prompts
    of ``batch`` (encoded here once, as the loss encodes them once for all its updates) and its latents (the
    critic's real images), drawing from the step's noise generator."""
    latents, input_ids = batch
    context = sd.train.step.loss_context(step)
    with torch.no_grad(), sd.runtime.autocast(context.settings.precision, device):
        hidden = context.prompts(input_ids, None)
    real = scaled_latents(context, latents)

    def update():
        with sd.model.attention_context(device):
            step.objective.update_fake(context, hidden, real, step.noise_generator)

    return update


def rows_of(run: Run, train, step, args, latent: int, device: torch.device) -> list[dict]:
    """The rows of ``run``, each with what one of its steps calls (``call``, dropped from the result): the step on
    B images (or prompts), and for DMD one fake-score update of the same step alone."""
    latents, input_ids = harness.synthetic_batch(args.batch, latent, seed=0)
    batch = (latents.to(device), input_ids.to(device))
    base = {"method": run.method, "adapter": run.adapter, "gan": run.gan, "config": run.name, "images": args.batch}
    rows = [{**base, "name": run.name, "part": "step", **passes(run, args), "call": lambda: train([batch])}]
    if run.method == "dmd":
        rows.append({**base, "name": run.name + FAKE, "part": "fake_update", **passes(run, args, True),
                     "call": fake_update_of(step, batch, device)})
    return rows


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


def warm_up(rows: list[dict], warmup: int, device: torch.device) -> None:
    """``warmup`` untimed calls of each row in turn, the rows alternating (a DMD step before its fake update): the
    first step's loss is kept, and on a CPU the host memory of the
    last call (with two or more, every row of the configuration has made a call before: the optimizers' state is
    no row's)."""
    for index in range(warmup):
        for row in rows:
            def one(row=row, first=index == 0):
                result = row["call"]()
                if first and result is not None:
                    row["first_loss"] = float(result["loss"])

            if index == warmup - 1:
                row["host_step_mib"] = on_host(one, device)
            else:
                one()


def time_row(row: dict, device: torch.device, steps: int) -> None:
    """One repeat: the mean seconds of ``steps`` consecutive calls of ``row``, appended to its ``step_s``."""
    row.setdefault("step_s", []).append(harness.time_steps(row["call"], device, 0, steps))


def measure(runs: list[Run], args, device: torch.device) -> list[dict]:
    """Every row of ``runs``: on a CPU built together and timed in alternation; on a GPU each configuration
    built, warmed, timed and freed in turn, its peak reset before each row's timed steps."""
    latent = args.resolution // 8  # every preset's VAE: a latent cell for 8x8 pixels
    if device.type == "cpu":
        set_up_once(runs[0], args, latent, device)
    live, rows = [], []
    for run in runs:
        train, step, trainable, host_build = build_measured(run, args, device)
        own = rows_of(run, train, step, args, latent, device)
        del train, step  # held by the rows' calls only: freed with them
        for row in own:
            row.update(trainable_params=trainable, host_build_mib=host_build)
        warm_up(own, args.warmup, device)
        rows += own
        if device.type == "cpu":
            live += own
            continue
        for row in own:
            harness.reset_peak(device)
            for _ in range(args.repeats):
                time_row(row, device, args.steps)
            row.update(harness.peak_gb(device), peak_allocated_bytes=torch.cuda.max_memory_allocated(device))
        for row in own:  # freed before the next configuration is built: each GPU peak is its own
            del row["call"]
        harness.release(device)
    for repeat in range(args.repeats if live else 0):
        for row in live if repeat % 2 == 0 else live[::-1]:
            time_row(row, device, args.steps)
    for row in rows:
        row.pop("call", None)
        row["step_ms"] = round(1000 * statistics.median(row["step_s"]), 2)
    return rows


def build_measured(run: Run, args, device: torch.device) -> tuple:
    """``(train, step, trainable parameters, host build MiB)`` of ``run``'s step (``built_step``)."""
    made = []
    host = on_host(lambda: made.append(built_step(config_of(args, run, args.unet, args.precision), device)), device)
    return (*made[0], host)


def set_up_once(run: Run, args, latent: int, device: torch.device) -> None:
    """A build and step of ``run`` thrown away: the process's one-time set-up (lazy imports, the first use of each
    kernel, thread pools) is then no row's host memory."""
    train, step, _ = built_step(config_of(args, run, args.unet, args.precision), device)
    rows_of(run, train, step, args, latent, device)[0]["call"]()


def estimates(runs: list[Run], args) -> dict:
    """``sd.train.memory``'s prediction of each configuration's step on ``--estimate_unet`` at
    ``--estimate_resolution`` and B = ``--batch``, DMD's with ``--estimate_fake_updates``: ``{configuration name:
    Estimate}``."""
    found = {}
    for run in runs:
        config = config_of(args, run, args.estimate_unet, args.estimate_precision, args.estimate_fake_updates)
        started = time.perf_counter()
        with sd.train.memory.session(config, args.estimate_resolution, device="cuda") as step_at:
            found[run.name] = step_at(args.batch)
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


def steps_of(rows: list[dict]) -> dict:
    """The step rows (no fake updates) by name."""
    return {row["name"]: row for row in rows if row["part"] == "step"}


def ratios(rows: list[dict]) -> list[dict]:
    """Per DMD configuration: its step time, measured and predicted peak, and its predicted ``distillation``
    part, over those of the LCM configuration of its adapter (None where either is missing)."""
    by_name = steps_of(rows)
    found = []
    for row in [r for r in by_name.values() if r["method"] == "dmd"]:
        lcm = by_name[f"lcm-{row['adapter']}"]
        entry = {"name": row["name"], "adapter": row["adapter"], "gan": row["gan"], "images": row["images"]}
        for key, field in (("step", "step_ms"), ("peak", "peak_allocated_bytes"), ("estimate", "estimate_bytes")):
            entry[f"{key}_vs_lcm"] = ratio(row.get(field), lcm.get(field))
        entry["distillation_mib"], entry["lcm_distillation_mib"] = (
            r.get("estimate_parts_mib", {}).get("distillation") for r in (row, lcm))
        found.append(entry)
    return found


def per_pass(rows: list[dict], args) -> list[dict]:
    """Per DMD configuration: one fake update's time (measured alone), ``fake_updates`` of them, and the generator's
    part of the step (derived: the step's time less those), each also over the LCM step of its adapter."""
    by_name, updates = {row["name"]: row for row in rows}, args.fake_updates
    found = []
    for row in [r for r in steps_of(rows).values() if r["method"] == "dmd"]:
        fake, lcm = by_name[row["name"] + FAKE]["step_ms"], by_name[f"lcm-{row['adapter']}"]["step_ms"]
        generator = round(row["step_ms"] - updates * fake, 2)
        found.append({"name": row["name"], "fake_updates": updates, "fake_update_ms": fake,
                      "fake_updates_ms": round(updates * fake, 2), "fake_share": ratio(updates * fake, row["step_ms"]),
                      "generator_ms_derived": generator, "fake_update_vs_lcm": ratio(fake, lcm),
                      "generator_vs_lcm_derived": ratio(generator, lcm)})
    return found


def print_rows(rows: list[dict]) -> None:
    harness.print_table(rows, lambda row: row["name"], [
        ("images_with_grad", "img grad", "d"), ("images_through_unet", "img UNet", "d"),
        ("images_critic", "img critic", "d"), ("step_ms", "step ms", ".1f"), ("first_loss", "1st loss", ".4f"),
        ("peak_allocated_gb", "peak GiB", ".2f"), ("estimate_gib", "est. GiB", ".3f"),
        ("host_build_mib", "host build", ".1f"), ("host_step_mib", "host step", ".1f"),
        ("trainable_params", "trainable", ",d")])
    print("img grad / img UNet: images through the whole UNet with gradients / in all; img critic: through its down "
          "and middle blocks only (the critic's features), with gradients; a fake update's row: one update alone")
    if any(row["host_build_mib"] is not None for row in rows):
        print("host build / host step: MiB by which this process's peak resident set grew over the build / the last "
              "warm-up call (host memory, not a GPU's)")


def print_ratios(compared: list[dict]) -> None:
    for entry in compared:
        parts = [f"{what} {entry[f'{key}_vs_lcm']:.3f}x" for key, what in
                 (("step", "step time"), ("peak", "measured peak"), ("estimate", "predicted peak"))
                 if entry[f"{key}_vs_lcm"] is not None]
        print(f"ratio {entry['name']}/lcm-{entry['adapter']} ({entry['images']} images): " + ", ".join(parts))


def print_per_pass(found: list[dict]) -> None:
    for entry in found:
        updates = entry["fake_updates"]
        print(f"per pass {entry['name']}: one fake-score update {entry['fake_update_ms']:.1f} ms (measured alone, "
              f"{entry['fake_update_vs_lcm']:.3f}x the LCM step), {updates} of them {entry['fake_updates_ms']:.1f} ms "
              f"({100 * entry['fake_share']:.0f}% of the step); the generator's part "
              f"{entry['generator_ms_derived']:.1f} ms (derived: the step less {updates} x one update; "
              f"{entry['generator_vs_lcm_derived']:.3f}x the LCM step)")


def print_parts(rows: list[dict], compared: list[dict], args) -> None:
    """The estimate's parts (MiB), a column per configuration; ``*`` marks a part where a DMD configuration differs
    from the LCM one of its adapter by more than 0.1 MiB. Then each DMD configuration's predicted peak and
    distillation part beside LCM's."""
    estimated = [row for row in steps_of(rows).values() if "estimate_parts_mib" in row]
    if not estimated:
        return
    parts = list(dict.fromkeys(part for row in estimated for part in row["estimate_parts_mib"]))
    by_name = {row["name"]: row["estimate_parts_mib"] for row in estimated}

    def differs(part: str) -> bool:
        return any(abs(by_name[row["name"]].get(part, 0) - by_name[f"lcm-{row['adapter']}"].get(part, 0)) > 0.1
                   for row in estimated if row["method"] == "dmd")

    width = max(16, *(len(row["name"]) + 2 for row in estimated))
    updates = args.estimate_fake_updates or args.fake_updates
    print(f"predicted peak (CUDA, allocated) by part, MiB, DMD stepped with {updates} fake update{'s' * (updates > 1)} "
          "(the peak does not depend on their count); * where DMD and the LCM step of its adapter differ")
    print(f"{'':32}" + "".join(f"{row['name']:>{width}}" for row in estimated))
    for part in parts:
        label = f"{'*' if differs(part) else ' '} {part}"
        print(f"{label:32}" + "".join(f"{by_name[row['name']].get(part, 0.0):>{width}.1f}" for row in estimated))
    print(f"{'  allocated':32}" + "".join(f"{row['estimate_bytes'] / MIB:>{width}.1f}" for row in estimated))
    gib = {row["name"]: row["estimate_gib"] for row in estimated}
    for entry in compared:
        lcm = f"lcm-{entry['adapter']}"
        print(f"predicted {entry['name']}: {gib[entry['name']]:.3f} GiB, {entry['estimate_vs_lcm']:.3f}x {lcm}'s "
              f"{gib[lcm]:.3f} GiB; distillation (held besides the model) {entry['distillation_mib'] or 0.0:.1f} MiB, "
              f"{lcm}'s {entry['lcm_distillation_mib'] or 0.0:.1f} MiB")


def summary(compared: list[dict], found: list[dict]) -> str:
    shares = {entry["name"]: entry for entry in found}
    parts = []
    for entry in compared:
        text = (f"{entry['name']} ({entry['images']} images): {entry['step_vs_lcm']:.2f}x the step time of "
                f"lcm-{entry['adapter']}, {100 * shares[entry['name']]['fake_share']:.0f}% of it in "
                f"{shares[entry['name']]['fake_updates']} fake updates")
        for key, what in (("peak", "measured peak"), ("estimate", "predicted peak")):
            if entry[f"{key}_vs_lcm"] is not None:
                text += f"; {what} {entry[f'{key}_vs_lcm']:.2f}x"
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
    parser.add_argument("--batch", type=int, default=4 if cuda else 2, help="images (prompts) per micro-batch B")
    parser.add_argument("--lora_rank", type=int, default=4, help="the adapter's rank")
    parser.add_argument("--lora_type", choices=["lora", "loha", "lokr"], default="lora", help="the adapter's kind")
    parser.add_bool("--dora", help="DoRA: a learned magnitude beside the adapter")
    parser.add_bool("--whole_unet", help="also LCM and DMD of the whole UNet (each holds a frozen teacher copy)")
    parser.add_argument("--fake_updates", type=int, default=5, help="dmd.fake_updates: fake-score updates per "
                        "generator update")
    parser.add_argument("--gan_weight", type=float, default=1e-3, help="dmd.gan_weight of the +gan rows")
    parser.add_argument("--dmd_steps", type=int, default=1, help="dmd.steps: the generator's steps (2-4: backward "
                        "simulation, its earlier steps without gradients)")
    parser.add_argument("--guidance", type=float, default=1.75, help="dmd.guidance: the teacher's guidance in the "
                        "real score (1: one teacher pass on B, else on 2B)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16" if cuda else "fp32",
                        help="the timed runs' precision (default: bf16 on a GPU, else fp32; DMD refuses fp16)")
    parser.add_bool("--checkpointing", help="gradient checkpointing, timed runs and estimates")
    parser.add_argument("--steps", type=int, default=10 if cuda else 4, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3 if cuda else 5, help="timed repeats per row (the median)")
    parser.add_argument("--warmup", type=int, default=3 if cuda else 2, help="untimed steps per row (at least 1)")
    parser.add_argument("--threads", type=int, default=0 if cuda else 1, help="CPU threads; 0 = torch's choice")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_bool("--estimate", default=True, help="sd.train.memory's predicted CUDA peak of each configuration")
    parser.add_argument("--no_estimate", dest="estimate", action="store_false", help="the same as --estimate false")
    parser.add_argument("--estimate_unet", choices=sorted(sd.model.UNET_PRESETS), default="sd1",
                        help="the preset the estimate builds (on fake tensors)")
    parser.add_argument("--estimate_resolution", type=int, default=512, help="the estimate's image pixels")
    parser.add_argument("--estimate_precision", choices=["fp32", "bf16"], default="bf16",
                        help="the estimate's precision")
    parser.add_argument("--estimate_fake_updates", type=int, default=1, help="dmd.fake_updates of the estimate's DMD "
                        "steps (each update frees its activations before the next: the peak is the same for any "
                        "count, and each costs the estimate as much as a step); 0 = --fake_updates")
    parser.add_bool("--smoke", help=f"a quick check: defaults {SMOKE} (flags given still win)")
    parser.add_argument("--json", default="", help="also write the result JSON to this file")
    if parser.parse_known_args(argv)[0].smoke:
        parser.set_defaults(**SMOKE)
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args) -> None:
    for name in ("batch", "lora_rank", "steps", "repeats", "warmup", "fake_updates", "dmd_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.estimate_fake_updates < 0:
        parser.error(f"--estimate_fake_updates must be 0 (--fake_updates) or more, got {args.estimate_fake_updates}")
    if args.gan_weight <= 0:
        parser.error(f"--gan_weight must be above 0 (the +gan rows), got {args.gan_weight:g}")
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
          f"({torch.get_num_threads()} threads): {args.batch} images, {runs[0].adapter} rank {args.lora_rank}"
          + (" and the whole UNet" if args.whole_unet else "") + (", checkpointing" if args.checkpointing else "")
          + f"; DMD: {args.fake_updates} fake updates, {args.dmd_steps} step{'s' * (args.dmd_steps > 1)}, guidance "
          f"{args.guidance:g}, GAN weight {args.gan_weight:g} (+gan); {args.warmup} warm-up steps, median of "
          f"{args.repeats} x {args.steps} steps")
    rows = measure(runs, args, device)
    if args.estimate:
        predicted = estimates(runs, args)
        rows = [with_estimate(row, predicted[row["name"]]) if row["part"] == "step" else row for row in rows]
    print_rows(rows)
    compared = ratios(rows)
    print_ratios(compared)
    found = per_pass(rows, args)
    print_per_pass(found)
    print_parts(rows, compared, args)
    line = summary(compared, found)
    print(line)
    result = {"benchmark": "dmd_step", "device": harness.device_name(device), "unet": args.unet,
              "resolution": args.resolution, "precision": args.precision, "images": args.batch,
              "lora_rank": args.lora_rank, "lora_type": args.lora_type, "dora": args.dora,
              "fake_updates": args.fake_updates, "gan_weight": args.gan_weight, "dmd_steps": args.dmd_steps,
              "guidance": args.guidance, "checkpointing": args.checkpointing, "steps": args.steps,
              "repeats": args.repeats, "warmup": args.warmup, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "estimate_unet": args.estimate_unet if args.estimate else None,
              "estimate_resolution": args.estimate_resolution if args.estimate else None,
              "estimate_fake_updates": (args.estimate_fake_updates or args.fake_updates) if args.estimate else None,
              "rows": rows, "ratios": compared, "per_pass": found, "summary": line}
    harness.emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
