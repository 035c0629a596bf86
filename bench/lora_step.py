"""Benchmark: a LoRA step of sd.train.step.train_step vs full fine-tuning and diffusers' LoRA example's step.

    python bench/lora_step.py                  # CPU: tiny UNet, 64 px, batches 4 and 16, 3 + 6 steps a row
    python bench/lora_step.py --arch sd1 --resolution 512 --batch_sizes 1,4 --estimate_only \\
        --precision bf16 --checkpointing 1 --optimizer adamw,adamw8bit --cache_text_embeddings 0,1
    python bench/lora_step.py --options huber,smooth_l1,l1,debiased,block_lr,posthoc_ema,dora,loha,lokr,pivotal \\
        --peer false  # the options
    python bench/lora_step.py --arch sd1 --resolution 512 --batch_sizes 1,4,16 --checkpointing 0,1 \\
        --peer_script diffusers/examples/text_to_image/train_text_to_image_lora.py          # GPU

Rows, for the same synthetic fp16 latents and token ids and the same seeded random base weights
(the UNet with diffusers' default initialisation, as a base to adapt; the text encoder of the arch):
* ``ours-lora``: ``sd.train.step.train_step`` as the trainer runs a LoRA config (``lora_rank``,
  ``lora_targets``, adapters added by ``sd.lora.adapters.apply_settings``: the frozen base stored in bf16 with
  bf16 precision, adapters fp32), with the trainer's loss settings (Min-SNR 5, CFG dropout 0.05,
  clipping at 1.0), fused AdamW or 8-bit AdamW, no EMA unless ``--ema`` (then of the adapter only),
  the text encoder's forward each step unless ``--cache_text_embeddings`` (the batch's prompts
  encoded once, the encoder then off the device, as ``sd.train.run.cache_text_embeddings`` does).
* ``ours-full``: the same with ``lora_rank: 0`` (every UNet parameter trains, fp32 master weights).
* ``ours-lora+NAME`` (``--options``): ours-lora with one more option of ``OPTIONS`` (a loss, debiased
  estimation, block learning rates, the post-hoc EMAs, DoRA, LoHa or LoKr instead of LoRA, a learned token
  beside it: pivotal tuning), compared with ours-lora in the same run: images/s,
  peak, estimate.
* ``peer-lora``: the training step of diffusers' ``examples/text_to_image/train_text_to_image_lora.py``
  with its defaults, in this process. What follows which part of the script:
  - set-up after loading the models: the UNet, VAE and text encoder are frozen with
    ``requires_grad_(False)``; ``weight_dtype`` is fp32, or bf16 under ``--mixed_precision bf16``; a
    ``LoraConfig`` with ``r = lora_alpha = rank``, Gaussian init and the targets to_k, to_q, to_v,
    to_out.0; the models are moved to the device and cast to ``weight_dtype`` *before*
    ``unet.add_adapter``, so the adapter takes the base's dtype (PEFT moves it there); only under
    fp16 does the script cast the trainable parameters back to fp32 (``cast_training_params``), so
    with bf16 its adapter and its AdamW state are bf16. (No VAE is built here: the latents are given.)
  - the trainable parameters are a ``filter`` over ``unet.parameters()``, handed to the optimizer
    (``torch.optim.AdamW``, or ``bitsandbytes.optim.AdamW8bit`` under ``--use_8bit_adam``; lr 1e-4,
    betas 0.9/0.999, weight decay 1e-2, eps 1e-8) and then, already consumed, to
    ``accelerator.clip_grad_norm_``: the script clips an empty parameter list, so no gradient norm
    is computed and nothing is clipped. Reproduced as it is.
  - ``--gradient_checkpointing``: ``unet.enable_gradient_checkpointing()``; the constant LR
    schedule of ``diffusers.optimization.get_scheduler`` (its default), stepped every step.
  - the loop body: latents in ``weight_dtype`` times the scaling factor; ``torch.randn_like`` noise
    (no noise offset by default), ``torch.randint`` timesteps as long, ``noise_scheduler.add_noise``;
    the text encoder's forward on the batch's ids every step; epsilon target; the UNet under the
    autocast that ``accelerator.prepare`` wraps around its forward, its output converted to fp32;
    ``F.mse_loss`` of the fp32 prediction and target (``--snr_gamma`` unset, its default);
    ``accelerator.gather(loss.repeat(batch)).mean().item()`` for the logged train loss (the gather is
    the tensor itself on one process); backward, the clip above, ``optimizer.step()``,
    ``lr_scheduler.step()``, ``optimizer.zero_grad()``; and ``loss.detach().item()`` for the
    progress bar: two host syncs a step. The script has no EMA.
* ``peer-lora-script`` (``--peer_script``): the script itself end to end with ``--rank`` (and
  ``--gradient_checkpointing``, ``--use_8bit_adam`` as the row's setting), through
  ``train_throughput.run_peer_script``: two runs of different length on an imagefolder of JPEGs, so
  start-up and the final save cancel out (its base is that runner's folder: the same seed, output
  projections zeroed, the same cost). It needs accelerate, datasets and torchvision (none on the
  CPU machines here); a short run on a CPU gives noise, as start-up dominates both runs.

Per row: step time (the median of the timed steps, each timed alone by ``harness.time_steps``
after the warm-up), images/s, peak memory (``harness.peak_gb``: the CUDA allocator's peak over the
timed steps, the steady state; nothing on a CPU), the trainable parameters, and for ours the
``sd.train.memory.estimate`` of the same config on CUDA at that batch (allocated bytes at the peak, on
fake tensors: printed for any arch, meaningful for sd1). Memory columns are GiB (2**30 bytes), the
unit ``harness.peak_gb`` reports in. Ratios: ours-lora / peer-lora (images/s, and peak memory where
measured) and ours-lora / ours-full (images/s, measured and predicted peak). ``--estimate_only``
skips the timing and prints the estimate and parameter columns only (SD 1.x at 512 px on a CPU).
On a CPU the rows of a batch are built together and their timed steps alternate (drift on a
shared machine hits every row alike), in one thread (``--threads``); on a GPU each row is built,
timed and freed in turn so its peak is its own. Prints a table, the ratios and one JSON line.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import sd.lora.adapters
import sd.model
import sd.runtime
import sd.train.memory
import sd.train.modes
import sd.train.step
from bench import harness
from sd.distributed import Dist
from sd.train.config import TrainConfig

PEER_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]  # the script's LoraConfig
OPTIONS = {  # --options: the config fields each ours-lora+NAME row adds
    "huber": dict(loss_type="huber"), "smooth_l1": dict(loss_type="smooth_l1", huber_schedule="exponential"),
    "l1": dict(loss_type="l1"), "debiased": dict(debiased_estimation=True),
    "block_lr": dict(down_lr_scale=0.5, up_lr_scale=2.0),
    "posthoc_ema": dict(posthoc_ema_every=1000),  # the two power-function EMAs' updates (snapshots: not a step's)
    "dora": dict(dora=True), "loha": dict(lora_type="loha"), "lokr": dict(lora_type="lokr"),
    "pivotal": dict(embedding_token="<bench>", embedding_init="dog", embedding_vectors=2, embedding_lr=5e-4)}
PEER_LR = 1e-4  # the script's --learning_rate default; ours uses it too (the rate does not change the cost)
GIB = 2**30


@dataclass(frozen=True)
class Setting:
    """What varies between the rows of one kind: the optimizer, checkpointing and the text cache."""

    optimizer: str
    checkpointing: bool
    cache: bool  # ours only: the peer script has no text-embedding cache

    @property
    def name(self) -> str:
        return "+".join([self.optimizer] + ["checkpointing"] * self.checkpointing + ["text_cache"] * self.cache)

    @property
    def peer(self) -> "Setting":
        return Setting(self.optimizer, self.checkpointing, False)


# ---------------------------------------------------------------------------------------------
# Ours and the peer, one step each
# ---------------------------------------------------------------------------------------------


def our_config(arch: str, rank: int, setting: Setting, args, **fields) -> TrainConfig:
    tiny = arch == "tiny"
    return TrainConfig(unet=harness.unet_preset(arch), text_encoder="tiny" if tiny else "sd1",
                       vae="tiny" if tiny else "sd1", datasets=[], grad_accum=1, lr=PEER_LR, precision=args.precision,
                       grad_checkpointing=setting.checkpointing, optimizer=setting.optimizer,
                       cache_text_embeddings=setting.cache, ema_decay=0.9999 if args.ema else 0.0,
                       lora_rank=rank, lora_targets=list(args.lora_targets), **fields)


def our_step(arch: str, config: TrainConfig, device: torch.device, input_ids: torch.Tensor):
    """``(step(latents, input_ids), trainable parameters)``: sd.train.step.train_step as SD_Train.build
    sets it up for ``config``; with the text cache, the prompts of ``input_ids`` are cached first."""
    text_encoder = harness.random_text_encoder(arch)
    unet = sd.model.build_unet(config.unet, from_scratch=False, seed=config.seed,
                               grad_checkpointing=config.grad_checkpointing).to(device).train()
    unet = attach(config, unet, text_encoder)
    step = sd.train.step.build_step(config, Dist.single(device), unet, text_encoder, harness.empty_prompt_ids(),
                                   sd.model.SD1_SCALING_FACTOR)
    if config.cache_text_embeddings:
        step.text_cache = sd.train.step.TextCache.build(step.text_encoder, input_ids, config.precision, device)
        step.text_encoder.to("cpu")
    sd.train.step.wrap_model(step, False)
    sd.train.step.set_lr(step.optimizer, config.lr)
    count = iter(range(10**9))

    def run(latents, input_ids):
        with sd.model.attention_context(device):
            return sd.train.step.train_step(step, [(latents, input_ids)], next(count))["loss"]

    return run, sum(p.numel() for p in step.trainable)


def peer_step(arch: str, device: torch.device, precision: str, rank: int, setting: Setting):
    """``(step(latents, input_ids), trainable parameters)``: the step of train_text_to_image_lora.py
    with its defaults (the module docstring says which part of the script each line follows)."""
    from diffusers import DDPMScheduler
    from diffusers.optimization import get_scheduler
    from peft import LoraConfig

    weight_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    noise_scheduler = sd.model.build_noise_scheduler("epsilon", DDPMScheduler)
    text_encoder = harness.random_text_encoder(arch)
    unet = sd.model.build_unet(harness.unet_preset(arch), from_scratch=False, seed=0)
    unet.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.to(device, dtype=weight_dtype)
    text_encoder.to(device, dtype=weight_dtype)
    with sd.model._seeded(0):
        unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=PEER_TARGETS))
    lora_layers = filter(lambda p: p.requires_grad, unet.parameters())
    trainable = sum(p.numel() for p in unet.parameters() if p.requires_grad)
    if setting.checkpointing:
        unet.enable_gradient_checkpointing()
    if setting.optimizer == "adamw8bit":
        import bitsandbytes

        optimizer_cls = bitsandbytes.optim.AdamW8bit
    else:
        optimizer_cls = torch.optim.AdamW
    optimizer = optimizer_cls(lora_layers, lr=PEER_LR, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    lr_scheduler = get_scheduler("constant", optimizer=optimizer, num_warmup_steps=500, num_training_steps=10**6)
    amp = torch.autocast(device.type, dtype=weight_dtype, enabled=precision == "bf16")
    unet.train()

    def step(latents, input_ids):
        latents = latents.to(device, weight_dtype) * sd.model.SD1_SCALING_FACTOR
        noise = torch.randn_like(latents)
        batch = latents.shape[0]
        timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (batch,), device=device).long()
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
        encoder_hidden_states = text_encoder(input_ids.to(device), return_dict=False)[0]
        with amp:
            model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
        model_pred = model_pred.float()  # accelerate's prepared forward returns fp32 outputs
        loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")
        train_loss = loss.repeat(batch).mean().item()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(lora_layers), 1.0)  # the consumed filter: an empty list
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        loss.detach().item()
        return train_loss

    return step, trainable


def trainable_on_meta(arch: str, config: TrainConfig) -> int:
    """Trainable parameters of ``config``'s UNet (and text adapter), counted on meta tensors."""
    with torch.device("meta"):
        unet = sd.model.build_unet(config.unet, from_scratch=False)
        text_encoder = harness.random_text_encoder(arch)
        unet = attach(config, unet, text_encoder)
    return sd.lora.adapters.trainable_count(unet) + sd.lora.adapters.trainable_count(text_encoder)


def attach(config: TrainConfig, unet, text_encoder):
    """What ``config``'s training mode trains, attached as the trainer attaches it (a LoRA's adapters; with a
    learned token, pivotal tuning, its rows too: zeros, which the bench's prompts never use, but the text
    encoder then runs with gradients as in such a run)."""
    mode = sd.train.modes.mode_of(config)
    mode.estimate_before_data(unet, text_encoder)
    return mode.estimate_attach(unet, text_encoder)


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def row_of(impl: str, setting: Setting, batch: int) -> dict:
    return {"impl": impl, "setting": setting.name, "batch": batch, "optimizer": setting.optimizer,
            "checkpointing": setting.checkpointing, "text_cache": setting.cache}


def measure(entries: list, batch: int, device: torch.device, args) -> list[dict]:
    """Time each ``(impl, setting, make)`` on one synthetic batch; ``make(input_ids)`` returns
    ``(step, trainable)``. With ``--interleave`` all are built and warmed first, then each timed step
    goes to every entry in turn, the order reversed every other step (no peak memory then: the entries
    share the device)."""
    latents, input_ids = harness.synthetic_batch(batch, args.resolution // harness.vae_factor(args.arch))
    rows = [{**row_of(impl, setting, batch), "step_s": []} for impl, setting, _ in entries]

    def build(make):
        def made(row):
            step, row["trainable_params"] = make(input_ids)
            return step
        return made

    def warm(step):
        for _ in range(args.warmup):
            step(latents, input_ids)
        harness.reset_peak(device)  # the steady state, as sd.train.memory predicts it: not the build or first step

    def time_alone(row, step):
        for _ in range(args.timed_steps):
            row["step_s"].append(harness.time_steps(lambda: step(latents, input_ids), device, 0, 1))
        row.update(harness.peak_gb(device))

    steps = harness.built_steps([(row, build(make)) for row, (_, _, make) in zip(rows, entries)], device, warm,
                                None if args.interleave else time_alone)
    for i in range(args.timed_steps if args.interleave else 0):
        pairs = list(zip(rows, steps))
        for row, step in pairs if i % 2 == 0 else reversed(pairs):  # no row always first or last
            if step is not None:
                row["step_s"].append(harness.time_steps(lambda: step(latents, input_ids), device, 0, 1))
    del steps
    harness.release(device)
    for row in rows:
        times = row.pop("step_s")
        if times:
            step_s = statistics.median(times)
            row.update(step_ms=1000 * step_s, images_per_s=batch / step_s)
    return rows


def add_estimates(rows: list[dict], configs: dict, batches: list[int], resolution: int) -> None:
    """sd.train.memory's CUDA prediction (allocated at the peak, and its parts) on every row of ours;
    ``configs``: ``{(impl, setting name): TrainConfig}``, one estimate session each."""
    for (impl, setting), config in configs.items():
        with sd.train.memory.session(config, resolution, "cuda") as run:
            predicted = {batch: run(batch) for batch in batches}
        for row in rows:
            if (row["impl"], row["setting"]) == (impl, setting):
                estimate = predicted[row["batch"]]
                row["estimate_gb"] = round(estimate.allocated / GIB, 4)
                row["estimate_breakdown_gb"] = {k: round(v / GIB, 4) for k, v in estimate.parts.items()}


def ratio(a, b, digits: int = 3):
    return round(a / b, digits) if a is not None and b else None


def ratios(rows: list[dict], settings: list[Setting]) -> list[dict]:
    """For every ours-lora row: its images/s and peak over ours-full's (same setting) and peer-lora's
    (same optimizer and checkpointing)."""
    peer_of = {s.name: s.peer.name for s in settings}

    def find(impl, batch, setting):
        return next((r for r in rows if (r["impl"], r["batch"], r["setting"]) == (impl, batch, setting)), {})

    out = []
    for lora in (r for r in rows if r["impl"] == "ours-lora"):
        full = find("ours-full", lora["batch"], lora["setting"])
        peer = find("peer-lora", lora["batch"], peer_of[lora["setting"]])
        out.append({"batch": lora["batch"], "setting": lora["setting"],
                    "lora_vs_full_images_per_s": ratio(lora.get("images_per_s"), full.get("images_per_s")),
                    "lora_vs_full_peak": ratio(lora.get("peak_allocated_gb"), full.get("peak_allocated_gb")),
                    "lora_vs_full_estimate": ratio(lora.get("estimate_gb"), full.get("estimate_gb")),
                    "lora_vs_peer_images_per_s": ratio(lora.get("images_per_s"), peer.get("images_per_s")),
                    "lora_vs_peer_peak": ratio(lora.get("peak_allocated_gb"), peer.get("peak_allocated_gb"))})
    return out


def option_ratios(rows: list[dict]) -> list[dict]:
    """For every ours-lora+NAME row: its images/s, peak and predicted peak over ours-lora's (same batch and
    setting)."""
    out = []
    for row in (r for r in rows if r["impl"].startswith("ours-lora+")):
        plain = next((r for r in rows if (r["impl"], r["batch"], r["setting"]) == ("ours-lora", row["batch"],
                                                                                    row["setting"])), {})
        out.append({"option": row["impl"].removeprefix("ours-lora+"), "batch": row["batch"], "setting": row["setting"],
                    "images_per_s": ratio(row.get("images_per_s"), plain.get("images_per_s")),
                    "peak": ratio(row.get("peak_allocated_gb"), plain.get("peak_allocated_gb")),
                    "estimate": ratio(row.get("estimate_gb"), plain.get("estimate_gb"))})
    return out


def print_ratios(compared: list[dict]) -> None:
    def part(label, value):
        return f"{label} {value:.2f}x" if value is not None else None

    for r in compared:
        for other, parts in (("ours-full", [part("images/s", r["lora_vs_full_images_per_s"]),
                                            part("peak", r["lora_vs_full_peak"]),
                                            part("predicted peak", r["lora_vs_full_estimate"])]),
                             ("peer-lora", [part("images/s", r["lora_vs_peer_images_per_s"]),
                                            part("peak", r["lora_vs_peer_peak"])])):
            parts = [p for p in parts if p]
            if parts:
                print(f"ratio ours-lora/{other} at batch {r['batch']} ({r['setting']}): {', '.join(parts)}")


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--batch_sizes", default="4,16", help="comma-separated per-GPU batches")
    parser.add_argument("--lora_rank", type=int, default=4, help="rank of ours-lora and peer-lora (alpha = rank)")
    parser.add_argument("--lora_targets", default="attention", help="ours-lora's lora_targets, comma-separated "
                        "(the peer always adapts to_q, to_k, to_v, to_out.0: the attention group)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16" if cuda else "fp32",
                        help="bf16 (the peer: --mixed_precision bf16) or fp32 (default: bf16 on a GPU, else fp32)")
    parser.add_argument("--checkpointing", default="0", help="gradient checkpointing: 0 and/or 1")
    parser.add_argument("--optimizer", default="adamw", help="adamw and/or adamw8bit (the peer: --use_8bit_adam)")
    parser.add_argument("--cache_text_embeddings", default="0", help="ours with the text-embedding cache: 0 and/or 1")
    parser.add_bool("--ema", help="ours with an EMA (decay 0.9999; of the adapter only in ours-lora)")
    parser.add_argument("--options", default="", help=f"ours-lora+NAME rows, comma-separated, of {', '.join(OPTIONS)} "
                        "(each against ours-lora in the same run)")
    parser.add_bool("--estimate", default=True, help="sd.train.memory's CUDA prediction for the ours rows")
    parser.add_bool("--estimate_only", help="no timing: trainable parameters and the estimate only")
    parser.add_bool("--peer", default=True, help="the in-process peer-lora rows")
    parser.add_argument("--peer_script", default="", help="diffusers' examples/text_to_image/"
                        "train_text_to_image_lora.py to run end to end as well (needs accelerate, torchvision "
                        "and datasets)")
    parser.add_argument("--peer_images", type=int, default=256, help="images in the peer script's dataset")
    parser.add_argument("--warmup", type=int, default=5 if cuda else 3, help="untimed steps per row")
    parser.add_argument("--timed_steps", type=int, default=20 if cuda else 6, help="timed steps per row")
    parser.add_argument("--threads", type=int, default=0 if cuda else 1, help="CPU threads of this process; 0 = "
                        "torch's choice (default: 1 without a GPU: two threads on a CPU shared with other jobs "
                        "stalled steps 10-60x at their synchronisation points)")
    parser.add_bool("--interleave", default=not cuda, help="build a batch's rows together and alternate their "
                    "timed steps (steadier on a shared CPU; no peak memory per row). Default: on a CPU only")
    args = parser.parse_args(argv)
    args.lora_targets = harness.parse_list(args.lora_targets, str)
    args.optimizers = harness.parse_list(args.optimizer, str)
    args.options = harness.parse_list(args.options, str) if args.options else []
    unknown = [name for name in args.options if name not in OPTIONS]
    if unknown:
        parser.error(f"--options: {', '.join(unknown)} unknown; choose from {', '.join(OPTIONS)}")
    if not args.optimizers or not set(args.optimizers) <= {"adamw", "adamw8bit"}:
        parser.error(f"--optimizer: adamw and/or adamw8bit, got {args.optimizer!r}")
    for name in ("checkpointing", "cache_text_embeddings"):
        values = harness.parse_list(getattr(args, name))
        if not values or not set(values) <= {0, 1}:
            parser.error(f"--{name}: a list of 0 and/or 1")
    if args.lora_rank < 1:
        parser.error("--lora_rank must be >= 1 (ours-full is the lora_rank 0 row)")
    if args.resolution % (8 * harness.vae_factor(args.arch)):
        parser.error(f"--resolution must be a multiple of {8 * harness.vae_factor(args.arch)}")
    return args


def settings_of(args) -> list[Setting]:
    return [Setting(o, bool(c), bool(t)) for o, c, t in itertools.product(
        args.optimizers, harness.parse_list(args.checkpointing), harness.parse_list(args.cache_text_embeddings))]


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = sd.runtime.pick_device(args.device)
    sd.runtime.start_process(threads=args.threads or None)
    settings, batches = settings_of(args), harness.parse_list(args.batch_sizes)
    configs = {(impl, s): our_config(args.arch, rank, s, args) for s in settings
               for impl, rank in (("ours-lora", args.lora_rank), ("ours-full", 0))}
    configs.update({(f"ours-lora+{name}", s): our_config(args.arch, args.lora_rank, s, args, **OPTIONS[name])
                    for s in settings for name in args.options})
    print(f"{args.arch} UNet, {args.resolution} px, {args.precision}, {harness.device_name(device)}: LoRA rank "
          f"{args.lora_rank} on {','.join(args.lora_targets)}" + (", EMA" if args.ema else "")
          + ("" if args.lora_targets == ["attention"] else "; the peer adapts the attention projections only"))

    rows = []
    for batch in batches:
        if args.estimate_only:
            rows += [{**row_of(impl, s, batch), "trainable_params": trainable_on_meta(args.arch, config)}
                     for (impl, s), config in configs.items()]
            continue
        entries = [(impl, s, lambda ids, config=config: our_step(args.arch, config, device, ids))
                   for (impl, s), config in configs.items()]
        if args.peer:
            peers = dict.fromkeys(s.peer for s in settings)
            entries += [("peer-lora", p, lambda ids, p=p: peer_step(args.arch, device, args.precision, args.lora_rank,
                                                                    p)) for p in peers]
        rows += measure(entries, batch, device, args)
        if args.peer_script:
            rows += [run_peer_script(args, batch, s) for s in dict.fromkeys(s.peer for s in settings)]
    if args.estimate or args.estimate_only:
        add_estimates(rows, {(impl, s.name): c for (impl, s), c in configs.items()}, batches, args.resolution)

    harness.print_table(rows, lambda row: f"{row['impl']} {row['setting']}",
                        [("batch", "batch", "d"), ("images_per_s", "images/s", ".2f"), ("step_ms", "step ms", ".1f"),
                         ("peak_allocated_gb", "peak GiB", ".2f"), ("estimate_gb", "est. GiB", ".3f"),
                         ("trainable_params", "trainable", ",d")])
    compared = ratios(rows, settings)
    print_ratios(compared)
    options = option_ratios(rows)
    for r in options:
        parts = [f"{label} {r[key]:.3f}x" for key, label in (("images_per_s", "images/s"), ("peak", "peak"),
                                                               ("estimate", "predicted peak")) if r[key] is not None]
        print(f"ratio ours-lora+{r['option']}/ours-lora at batch {r['batch']} ({r['setting']}): {', '.join(parts)}")
    result = {"benchmark": "lora_step", "device": harness.device_name(device), "arch": args.arch,
              "resolution": args.resolution, "precision": args.precision, "torch": torch.__version__,
              "threads": torch.get_num_threads(),
              "lora_rank": args.lora_rank, "lora_targets": args.lora_targets, "ema": args.ema,
              "estimate_only": args.estimate_only, "rows": rows, "ratios": compared, "option_ratios": options}
    harness.emit(result, args.json)
    return result


def run_peer_script(args, batch: int, setting: Setting) -> dict:
    """The LoRA script end to end: train_throughput's runner with the LoRA script's extra flags."""
    from bench import train_throughput

    extra = ["--rank", str(args.lora_rank)] + ["--gradient_checkpointing"] * setting.checkpointing
    extra += ["--use_8bit_adam"] * (setting.optimizer == "adamw8bit")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data_dir = train_throughput.prepare_peer_inputs(Path(tmp), args.arch, args.resolution,
                                                                   args.peer_images)
        row = train_throughput.run_peer_script(args.peer_script, Path(tmp), model_dir, data_dir, args.resolution,
                                               batch, args.warmup, args.timed_steps, args.precision, extra)
    row.pop("variant", None)
    return {**row, **row_of("peer-lora-script", setting, batch)}


if __name__ == "__main__":
    main()
