"""Benchmark: training images/s, step time, peak memory and MFU of sd.train.step.train_step vs diffusers' loop.

    python bench/train_throughput.py                     # CPU: tiny UNet, 64 px, checks that it all runs
    python bench/train_throughput.py --arch sd1 --resolution 512 --batch_sizes 16,32,48 \\
        --variants eager,compile --channels_last 0,1 --checkpointing 0,1 \\
        --peer_script diffusers/examples/text_to_image/train_text_to_image.py      # GPU

Ours: ``sd.train.step.train_step`` exactly as the training loop calls it (fp16 latents from host memory,
CLIP text encoder forward, CFG dropout, Min-SNR loss, clipping, fused AdamW, EMA update, the step
statistics read from the device every 10 steps as at the trainer's default ``log_every``), on the same-seeded random weights and synthetic latents and token ids,
for every combination of the variants asked for.

The peer, diffusers' ``examples/text_to_image/train_text_to_image.py`` with its defaults and
``--mixed_precision bf16`` (AdamW, no EMA, no gradient checkpointing, MSE loss, loss.item() per step):
* ``peer-unet``: its training step on the identical latents and token ids, in this process;
* ``peer-vae``: the same plus its online VAE encode of the batch's pixels (what the script does);
* ``peer-script``: with ``--peer_script``, the script itself run end to end on an imagefolder of JPEGs
  (needs accelerate, torchvision, datasets and tensorboard, its default tracker). Its images/s come
  from two runs of different length, so start-up, loading and the final save cancel out.

MFU = images/s x training FLOPs per image (forward + backward, counted by FlopCounterMode, see
sd.model.training_flops_per_image) / the device's dense bf16 peak. Prints a table, the ratios of our
best variant to each peer at every batch size, and one JSON line.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import sd.formats
import sd.model
import sd.runtime
import sd.train.config
import sd.train.step
from bench import harness
from sd.distributed import Dist
from sd.train.config import TrainConfig


@dataclass(frozen=True)
class Variant:
    compile: bool
    channels_last: bool
    checkpointing: bool
    mode: str = "default"  # compile_mode
    attention: str = "auto"  # the config's attention
    bf16_weights: bool = False  # the config's bf16_weights

    @property
    def name(self) -> str:
        parts = [("compile" if self.mode == "default" else f"compile:{self.mode}") if self.compile else "eager"]
        parts += ["channels_last"] * self.channels_last + ["checkpointing"] * self.checkpointing
        parts += [f"attention:{self.attention}"] * (self.attention != "auto") + ["bf16_weights"] * self.bf16_weights
        return "+".join(parts)


# ---------------------------------------------------------------------------------------------
# Ours and the peer, one step each
# ---------------------------------------------------------------------------------------------


def step_config(arch: str, variant: Variant, precision: str, batch_size: int = 16) -> TrainConfig:
    """The trainer's settings of the measured step (what bench/gpu_window.py's memory estimates are made for)."""
    return TrainConfig(unet=harness.unet_preset(arch), batch_size=batch_size, grad_accum=1, precision=precision,
                       grad_checkpointing=variant.checkpointing, channels_last=variant.channels_last,
                       compile=variant.compile, compile_mode=variant.mode, attention=variant.attention,
                       bf16_weights=variant.bf16_weights)


def our_step(arch: str, variant: Variant, device: torch.device, precision: str, shapes: int = 1,
             backend: str = "inductor"):
    """``step(latents, input_ids)``: one sd.train.step.train_step on a batch; returns the logged loss.
    ``shapes``: how many latent shapes it will see (compiled as the trainer compiles a bucketed run);
    ``backend``: torch.compile's (another than inductor only to check the graphs are captured, quickly)."""
    config = step_config(arch, variant, precision)
    unet = sd.model.build_unet(config.unet, seed=config.seed, grad_checkpointing=config.grad_checkpointing,
                               channels_last=config.channels_last).to(device).train()
    step = sd.train.step.build_step(config, Dist.single(device), unet, harness.random_text_encoder(arch),
                                   harness.empty_prompt_ids(), sd.model.SD1_SCALING_FACTOR)
    sd.train.step.wrap_model(step, config.compile and backend == "inductor", shapes, config.compile_mode)
    if config.compile and backend != "inductor":
        step.model = torch.compile(step.model, backend=backend)
    sd.train.step.set_lr(step.optimizer, config.lr)
    count, unread = iter(range(10**9)), []

    def run(latents, input_ids):
        with sd.model.attention_context(device, config.attention):
            result = sd.train.step.train_step(step, [(latents, input_ids)], next(count))
        unread.append(result)
        if len(unread) == config.log_every:  # the trainer's one read per log_every steps
            sd.train.step.read_results(unread)
            unread.clear()
        return result

    return run


def peer_step(arch: str, device: torch.device, precision: str, *, online_vae: bool = False, ema: bool = False,
              checkpointing: bool = False):
    """``step(latents, input_ids)``: the step of diffusers' train_text_to_image.py with its defaults.

    As the script: the text encoder (and VAE) cast to the mixed-precision dtype, the UNet in fp32
    under autocast (what accelerate's prepare does), torch AdamW with its default implementation,
    a constant LR schedule from diffusers.optimization, diffusers' EMAModel under ``--use_ema``,
    clip_grad_norm_ and loss.item() every step. With ``online_vae`` the batch's latents come from
    encoding pixels with the VAE, as in the script; the given latents only set the batch size.
    """
    from diffusers import DDPMScheduler
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import EMAModel

    weight_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    unet = sd.model.build_unet(harness.unet_preset(arch), seed=0, grad_checkpointing=checkpointing).to(device)
    unet.train()
    text_encoder = harness.random_text_encoder(arch).to(device, weight_dtype)
    vae = harness.random_vae(arch).to(device, weight_dtype) if online_vae else None
    noise_scheduler = sd.model.build_noise_scheduler("epsilon", DDPMScheduler)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    lr_scheduler = get_scheduler("constant", optimizer=optimizer, num_warmup_steps=500, num_training_steps=10**6)
    ema_unet = EMAModel(unet.parameters()) if ema else None
    amp = torch.autocast(device.type, dtype=weight_dtype, enabled=precision == "bf16")

    def step(latents, input_ids):
        batch = latents.shape[0]
        if vae is not None:
            size = latents.shape[-1] * harness.vae_factor(arch)
            pixels = torch.rand(batch, 3, size, size, device=device, dtype=weight_dtype) * 2 - 1
            latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
        else:
            latents = latents.to(device, weight_dtype) * sd.model.SD1_SCALING_FACTOR
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (batch,), device=device).long()
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
        encoder_hidden_states = text_encoder(input_ids.to(device), return_dict=False)[0]
        with amp:
            model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
        loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")
        value = loss.item()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        if ema_unet is not None:
            ema_unet.step(unet.parameters())
        return value

    return step


# ---------------------------------------------------------------------------------------------
# The peer's own script, end to end
# ---------------------------------------------------------------------------------------------


def prepare_peer_inputs(folder: Path, arch: str, resolution: int, images: int) -> tuple[Path, Path]:
    """A diffusers pipeline folder with our random weights and an imagefolder dataset of JPEGs."""
    import numpy as np
    from PIL import Image

    model_dir, data_dir = folder / "model", folder / "data"
    unet = sd.model.build_unet(harness.unet_preset(arch), seed=0)
    sd.formats.export_diffusers(model_dir, unet, harness.random_vae(arch), harness.random_text_encoder(arch),
                                sd.model.load_tokenizer("tiny"))
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    height, width = int(resolution * 1.25), int(resolution * 1.5)  # resized and cropped by the script
    with open(data_dir / "metadata.jsonl", "w") as meta:
        for i in range(images):
            small = rng.integers(0, 256, size=(height // 16, width // 16, 3), dtype=np.uint8)
            Image.fromarray(small).resize((width, height), Image.BICUBIC).save(data_dir / f"{i:05d}.jpg", quality=90)
            meta.write(json.dumps({"file_name": f"{i:05d}.jpg", "text": f"a photograph number {i}"}) + "\n")
    return model_dir, data_dir


def peer_script_command(script: str, model_dir: Path, data_dir: Path, out_dir: Path, resolution: int, batch: int,
                        steps: int, precision: str, extra_args=()) -> list[str]:
    """The flags the diffusers text-to-image scripts share, then ``extra_args`` (e.g. the LoRA script's --rank)."""
    return [sys.executable, script, "--pretrained_model_name_or_path", str(model_dir), "--train_data_dir",
            str(data_dir), "--resolution", str(resolution), "--train_batch_size", str(batch), "--max_train_steps",
            str(steps), "--mixed_precision", "bf16" if precision == "bf16" else "no", "--output_dir", str(out_dir),
            "--checkpointing_steps", str(10**9), "--seed", "0", *extra_args]


def run_peer_script(script: str, folder: Path, model_dir: Path, data_dir: Path, resolution: int, batch: int,
                    warmup: int, steps: int, precision: str, extra_args=()) -> dict:
    """images/s of the script: (steps) x batch over the wall-time difference of a long and a short run."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    seconds = []
    for count in (warmup, warmup + steps):
        out_dir = folder / f"out_{count}"
        start = time.perf_counter()
        result = subprocess.run(peer_script_command(script, model_dir, data_dir, out_dir, resolution, batch, count,
                                                    precision, extra_args), env=env, capture_output=True, text=True)
        seconds.append(time.perf_counter() - start)
        if result.returncode != 0:
            raise RuntimeError(f"{script} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    step_s = (seconds[1] - seconds[0]) / steps
    return {"impl": "peer-script", "variant": Path(script).name, "batch": batch, "step_ms": 1000 * step_s,
            "images_per_s": batch / step_s, "run_seconds": [round(s, 1) for s in seconds]}


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def measure(entries: list[tuple[str, str, object]], batch: int, device, args, flops: int,
            peak: float | None) -> list[dict]:
    """Time each ``(impl, variant, make_step)`` on one synthetic batch; a row per entry.

    With ``--rounds 1`` each entry is built, timed and freed in turn, and its peak memory covers
    building and stepping. With more rounds all entries are built together, warmed, then timed in
    alternating rounds of ``--timed_steps`` steps, the median round counting (drift on a shared machine
    then hits every entry alike; no peak memory per entry).
    """
    latents, input_ids = harness.synthetic_batch(batch, args.resolution // harness.vae_factor(args.arch))
    rows = [{"impl": impl, "variant": variant, "batch": batch} for impl, variant, _ in entries]

    def build(make_step):
        def made(row):
            harness.reset_peak(device)  # the peak covers building and stepping
            return make_step()
        return made

    def warm(step):
        for _ in range(args.warmup):
            step(latents, input_ids)

    def time_alone(row, step):
        row["step_s"] = [harness.time_steps(lambda: step(latents, input_ids), device, 0, args.timed_steps)]
        row.update(harness.peak_gb(device))

    steps = harness.built_steps([(row, build(make)) for row, (_, _, make) in zip(rows, entries)], device, warm,
                                time_alone if args.rounds == 1 else None)
    for _ in range(args.rounds if args.rounds > 1 else 0):
        for row, step in zip(rows, steps):
            if step is not None:
                row.setdefault("step_s", []).append(
                    harness.time_steps(lambda: step(latents, input_ids), device, 0, args.timed_steps))
    del steps
    harness.release(device)
    for row in rows:
        if "step_s" in row:
            step_s = statistics.median(row.pop("step_s"))
            row.update(step_ms=1000 * step_s, images_per_s=batch / step_s)
            if peak:
                row["mfu"] = row["images_per_s"] * flops / (peak * 1e12)
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """At each batch size, our best variant's images/s over each peer's."""
    out = []
    for batch in sorted({row["batch"] for row in rows}):
        here = [row for row in rows if row["batch"] == batch and row.get("images_per_s")]
        ours = [row for row in here if row["impl"] == "ours"]
        if not ours:
            continue
        best = max(ours, key=lambda row: row["images_per_s"])
        for peer in (row for row in here if row["impl"].startswith("peer")):
            out.append({"batch": batch, "ours": best["variant"], "peer": peer["impl"],
                        "ratio": round(best["images_per_s"] / peer["images_per_s"], 3)})
    return out


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--batch_sizes", default="16,32" if cuda else "4", help="comma-separated per-GPU batches")
    parser.add_bool("--sweep", help="after the listed batches, keep doubling the batch "
                        "until every variant of ours runs out of memory (or --max_batch)")
    parser.add_argument("--max_batch", type=int, default=1024, help="largest batch --sweep tries")
    parser.add_argument("--variants", default="eager,compile" if cuda else "eager", help="eager and/or compile")
    parser.add_argument("--compile_modes", default="default", help="torch.compile modes of the compile variant "
                        "(compile_mode): default, max-autotune-no-cudagraphs, reduce-overhead, max-autotune")
    parser.add_argument("--compile_backend", default="inductor", help="torch.compile backend of the compile "
                        "variant: inductor (what the trainer uses), or aot_eager to check on a CPU that the step's "
                        "graphs are captured without generating kernels")
    parser.add_argument("--attention", default="auto", help="attention kernels of ours (the config's attention), "
                        f"comma-separated, from {', '.join(sd.model.ATTENTION_CHOICES)}")
    parser.add_argument("--bf16_weights", default="0", help="the UNet's weights in bf16 with fp32 masters "
                        "(bf16_weights; with --precision bf16): 0 and/or 1")
    parser.add_argument("--channels_last", default="0,1" if cuda else "0", help="0 and/or 1")
    parser.add_argument("--checkpointing", default="0,1" if cuda else "1", help="gradient checkpointing: 0 and/or 1")
    parser.add_argument("--peers", default="unet,vae", help="in-process peers: unet (its step on our latents) "
                        "and/or vae (with its online VAE encode); empty for none")
    parser.add_bool("--peer_ema", help="the in-process peers with --use_ema (EMAModel)")
    parser.add_argument("--peer_script", default="", help="diffusers' examples/text_to_image/train_text_to_image.py "
                        "to run end to end as well (needs accelerate, torchvision, datasets)")
    parser.add_argument("--peer_images", type=int, default=256, help="images in the peer script's dataset")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16" if cuda else "fp32",
                        help="bf16 autocast (GPU default) or fp32 (CPU default)")
    parser.add_argument("--warmup", type=int, default=5 if cuda else 1, help="untimed steps (compilation included)")
    parser.add_argument("--timed_steps", type=int, default=20 if cuda else 3, help="timed steps (per round)")
    parser.add_alias("--steps", "timed_steps", type=int)
    parser.add_argument("--rounds", type=int, default=1 if cuda else 5, help="1: each configuration built, timed "
                        "and freed in turn, with its peak memory; more: all of one batch built together and timed "
                        "in alternating rounds, the median counting (steadier on a shared CPU; default: 1 on a GPU, "
                        "5 on a CPU)")
    parser.add_argument("--peak_tflops", type=float, default=None, help="dense bf16 peak of the device for MFU "
                        "(default: looked up for known GPUs)")
    args = parser.parse_args(argv)
    for name, allowed in (("variants", {"eager", "compile"}), ("peers", {"unet", "vae"}),
                          ("attention", set(sd.model.ATTENTION_CHOICES)),
                          ("compile_modes", set(sd.train.config.COMPILE_MODES))):
        unknown = set(harness.parse_list(getattr(args, name), str)) - allowed
        if unknown:
            parser.error(f"--{name}: unknown {sorted(unknown)}; choose from {sorted(allowed)}")
    for name in ("channels_last", "checkpointing", "bf16_weights"):
        if not set(harness.parse_list(getattr(args, name))) <= {0, 1}:
            parser.error(f"--{name}: a list of 0 and/or 1")
    if args.resolution % (8 * harness.vae_factor(args.arch)):
        parser.error(f"--resolution must be a multiple of {8 * harness.vae_factor(args.arch)}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = sd.runtime.pick_device(args.device)
    sd.runtime.start_process()
    latent_size = args.resolution // harness.vae_factor(args.arch)
    flops = sd.model.training_flops_per_image(harness.unet_preset(args.arch), latent_size)
    peak = harness.peak_tflops(device, args.peak_tflops)
    variants = [Variant(c == "compile", bool(cl), bool(ck), mode, attention, bool(bf16))
                for c, cl, ck, attention, bf16 in itertools.product(
                    harness.parse_list(args.variants, str), harness.parse_list(args.channels_last),
                    harness.parse_list(args.checkpointing), harness.parse_list(args.attention, str),
                    harness.parse_list(args.bf16_weights))
                for mode in (harness.parse_list(args.compile_modes, str) if c == "compile" else ["default"])]
    print(f"{args.arch} UNet, {args.resolution} px ({latent_size}x{latent_size} latents), {args.precision}, "
          f"{harness.device_name(device)}: {flops / 1e9:,.1f} GFLOP per training image (forward + backward)"
          + (f", peak {peak:.1f} TFLOP/s" if peak else ", MFU not shown (peak unknown: --peak_tflops)"))

    rows, batches, too_big = [], harness.parse_list(args.batch_sizes), set()
    peer_label = "diffusers step" + (" +EMAModel" if args.peer_ema else "")
    while batches:
        batch = batches.pop(0)
        entries = [("ours", v.name, lambda v=v: our_step(args.arch, v, device, args.precision,
                                                         backend=args.compile_backend))
                   for v in variants if v not in too_big]  # skipped: out of memory at a smaller batch already
        entries += [(f"peer-{peer}", peer_label, lambda peer=peer: peer_step(
            args.arch, device, args.precision, online_vae=peer == "vae", ema=args.peer_ema))
            for peer in harness.parse_list(args.peers, str)]
        measured = measure(entries, batch, device, args, flops, peak)
        too_big |= {v for v in variants for row in measured if row["impl"] == "ours" and row["variant"] == v.name
                    and row.get("oom")}
        rows += measured
        if args.sweep and not batches and len(too_big) < len(variants) and batch * 2 <= args.max_batch:
            batches.append(batch * 2)
        if args.peer_script:
            with tempfile.TemporaryDirectory() as tmp:
                model_dir, data_dir = prepare_peer_inputs(Path(tmp), args.arch, args.resolution, args.peer_images)
                row = run_peer_script(args.peer_script, Path(tmp), model_dir, data_dir, args.resolution, batch,
                                      args.warmup, args.timed_steps, args.precision)
            if peak:
                row["mfu"] = row["images_per_s"] * flops / (peak * 1e12)
            rows.append(row)

    harness.print_table(rows, lambda row: f"{row['impl']} {row['variant']}",
                        [("batch", "batch", "d"), ("images_per_s", "images/s", ".2f"), ("step_ms", "step ms", ".1f"),
                         ("peak_allocated_gb", "peak GB", ".2f"), ("mfu", "MFU", ".1%")])
    compared = ratios(rows)
    for r in compared:
        print(f"ratio ours/{r['peer']} at batch {r['batch']} = {r['ratio']:.2f}x (ours: {r['ours']})")
    result = {"benchmark": "train_throughput", "device": harness.device_name(device), "arch": args.arch,
              "resolution": args.resolution, "precision": args.precision, "torch": torch.__version__,
              "flops_per_image": flops, "peak_tflops": peak, "rows": rows, "ratios": compared}
    harness.emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
