"""Sample images from a trained SD 1.x model, and export it to the formats other tools load.

    python SD_ImageGen.py --ckpt PATH --prompt "..." [--negative "..."] [--steps 100] [--cfg 7.5]
                          [--seed 0] [--n 4] [--batch_size 4] [--sampler ddim|dpm++|euler] [--no_ema]
                          [--height 512 --width 512] [--device auto] --out DIR
    python SD_ImageGen.py --ckpt runs/p7_consolidation --export_diffusers exported/sd1
    python SD_ImageGen.py --ckpt runs/p7_consolidation --export_single_file sd1.safetensors --half

``--ckpt`` is a training checkpoint or run folder of ours (EMA weights unless ``--no_ema``), a
diffusers pipeline folder or hub id, or a single ``.safetensors`` / ``.ckpt`` file in the original
SD layout. Image i of a prompt uses seed ``--seed + i``: the same seed gives the same image whatever
the batch size. Each PNG stores its generation parameters in a ``parameters`` text chunk.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import SD_Files
import SD_Formats
import SD_Model

log = logging.getLogger("sd_imagegen")
SAMPLERS = ("ddim", "dpm++", "euler")
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
# CLIP ViT-L/14's text tower, as SD 1.x uses it.
CLIP_L_TEXT = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                   num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
# What a single file in the original layout holds: (UNet preset, VAE config, text encoder config).
SINGLE_FILE_ARCHS = {"sd1": ("sd1", SD_Model.SD1_VAE, CLIP_L_TEXT),
                     "tiny": ("tiny", SD_Model.TINY_VAE, SD_Model.TINY_TEXT_ENCODER)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="our checkpoint or run folder, a diffusers folder or hub id, "
                        "or a single .safetensors/.ckpt file")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    parser.add_argument("--prompts_file", help="a text file with one prompt per line")
    parser.add_argument("--negative", default="", help="negative prompt: the unconditional branch of CFG (default: empty)")
    parser.add_argument("--steps", type=int, default=100, help="sampler steps (default: %(default)s)")
    parser.add_argument("--cfg", type=float, default=7.5, help="classifier-free guidance scale (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of image 0; image i uses seed + i (default: %(default)s)")
    parser.add_argument("--n", type=int, default=4, help="images per prompt (default: %(default)s)")
    parser.add_argument("--batch_size", type=int, default=4, help="images per UNet call (default: %(default)s)")
    parser.add_argument("--sampler", choices=SAMPLERS, default="ddim", help="(default: %(default)s)")
    parser.add_argument("--no_ema", action="store_true", help="use the live weights of our checkpoints, not the EMA")
    parser.add_argument("--height", type=int, default=512, help="pixels, a multiple of 8 (default: %(default)s)")
    parser.add_argument("--width", type=int, default=512, help="pixels, a multiple of 8 (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="auto (CUDA, then Apple MPS, then CPU), cpu, cuda, mps")
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                        help="model precision (default: bf16 on CUDA, fp16 on MPS, fp32 on CPU)")
    parser.add_argument("--compile", choices=COMPILE_MODES, default="off",
                        help="torch.compile the UNet with this mode (reduce-overhead = CUDA graphs): faster sampling "
                        "after a first batch that compiles, worth it for many images (default: %(default)s)")
    parser.add_argument("--arch", choices=sorted(SINGLE_FILE_ARCHS), default="sd1",
                        help="architecture of a single-file --ckpt (default: %(default)s)")
    parser.add_argument("--vae", help="override the checkpoint's VAE (hub id, folder or tiny)")
    parser.add_argument("--text_encoder", help="override the checkpoint's text encoder (hub id, folder or tiny)")
    parser.add_argument("--tokenizer", help="override the checkpoint's tokenizer (hub id, folder or tiny)")
    parser.add_argument("--out", help="output folder for the PNGs and the grid")
    parser.add_argument("--export_diffusers", metavar="DIR", help="write a diffusers StableDiffusionPipeline folder")
    parser.add_argument("--export_single_file", metavar="FILE", help="write one .safetensors in the original SD layout")
    parser.add_argument("--half", action="store_true", help="fp16 weights in --export_single_file")
    args = parser.parse_args(argv)
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.exists():
            parser.error(f"--prompts_file {path} does not exist")
        args.prompt += [line.strip() for line in path.read_text().splitlines() if line.strip()]
    exporting = args.export_diffusers or args.export_single_file
    if not exporting and not (args.prompt and args.out):
        parser.error("give --prompt (or --prompts_file) and --out to sample, or an --export_* flag")
    if args.height % 8 or args.width % 8 or args.height <= 0 or args.width <= 0:
        parser.error("--height and --width must be positive multiples of 8")
    for name in ("steps", "n", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


@dataclass
class Model:
    unet: torch.nn.Module
    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    tokenizer: object
    prediction_type: str
    source: str


def load_model(ckpt: str, *, use_ema: bool = True, vae: str | None = None, text_encoder: str | None = None,
               tokenizer: str | None = None, arch: str = "sd1") -> Model:
    """UNet, VAE, text encoder and tokenizer from any checkpoint kind; flags override the parts."""
    config = SD_Formats.run_config(ckpt)
    path = Path(ckpt)
    if config is not None:  # ours: the parts named in the training config
        unet = SD_Model.build_unet(config["unet"], from_scratch=False)
        parts = (config["vae"], config["text_encoder"], config.get("tokenizer") or config["text_encoder"])
        prediction_type = config["prediction_type"]
    elif path.is_file():  # a single file holds all three models
        return _load_single_file(path, arch, vae, text_encoder, tokenizer)
    else:  # a diffusers folder or hub id
        from diffusers import UNet2DConditionModel

        unet = UNet2DConditionModel.from_pretrained(ckpt, subfolder="unet")
        SD_Model.use_sdpa_attention(unet)
        parts = (ckpt, ckpt, ckpt)
        prediction_type = SD_Formats.diffusers_prediction_type(ckpt)
    loaded = SD_Formats.load_unet_weights(ckpt, unet, use_ema=use_ema) if config is not None else f"diffusers {ckpt}"
    return Model(unet.eval(), SD_Model.load_vae(vae or parts[0]), SD_Model.load_text_encoder(text_encoder or parts[1]),
                 SD_Model.load_tokenizer(tokenizer or parts[2]), prediction_type, loaded)


def _load_single_file(path: Path, arch: str, vae: str | None, text_encoder: str | None,
                      tokenizer: str | None) -> Model:
    """An original-layout file holds the UNet, VAE and CLIP text encoder weights of ``arch``."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    unet_preset, vae_config, text_config = SINGLE_FILE_ARCHS[arch]
    state = SD_Formats.read_single_file(path)
    unet = SD_Model.build_unet(unet_preset, from_scratch=False)
    unet.load_state_dict(SD_Formats.from_single_file(state, unet, SD_Formats.unet_key_map(unet), "UNet"))
    if vae:
        vae_model = SD_Model.load_vae(vae)
    else:
        vae_model = AutoencoderKL(**vae_config)
        vae_model.load_state_dict(SD_Formats.from_single_file(state, vae_model, SD_Formats.vae_key_map(vae_model), "VAE"))
    if text_encoder:
        encoder = SD_Model.load_text_encoder(text_encoder)
    else:
        encoder = CLIPTextModel(CLIPTextConfig(**text_config))
        encoder.load_state_dict(
            SD_Formats.from_single_file(state, encoder, SD_Formats.text_key_map(encoder), "text encoder"))
    default_tokenizer = "tiny" if arch == "tiny" else SD_Model.DEFAULT_TEXT_ENCODER
    return Model(unet.eval(), vae_model.eval(), encoder.eval(), SD_Model.load_tokenizer(tokenizer or default_tokenizer),
                 "epsilon", f"single file {path}")


def pick_device(choice: str) -> torch.device:
    if choice != "auto":
        return torch.device(choice)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(choice: str, device: torch.device) -> torch.dtype:
    if choice != "auto":
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[choice]
    return {"cuda": torch.bfloat16, "mps": torch.float16}.get(device.type, torch.float32)


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------


def compile_unet(unet, mode: str):
    """``unet`` compiled with a ``torch.compile`` mode from COMPILE_MODES; ``"off"`` returns it as it is."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode must be one of {COMPILE_MODES}, got {mode!r}")
    return unet if mode == "off" else torch.compile(unet, mode=None if mode == "default" else mode)


def initial_noise(seeds: list[int], shape: tuple[int, int, int]) -> torch.Tensor:
    """One CPU generator per image: the same seed gives the same noise on any device and batch size."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in seeds])


@torch.no_grad()
def sample_latents(model: Model, noise: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor, *,
                   sampler: str, steps: int, cfg: float) -> torch.Tensor:
    """Denoise unit-variance ``noise`` into scaled latents with DDIM or a diffusers scheduler."""
    if sampler == "ddim":
        return SD_Model.ddim_sample(model.unet, noise, cond, uncond, steps=steps, guidance_scale=cfg,
                                    prediction_type=model.prediction_type)
    from diffusers import DPMSolverMultistepScheduler, EulerDiscreteScheduler

    if sampler == "dpm++":
        scheduler = DPMSolverMultistepScheduler.from_config(
            {**SD_Model.noise_schedule_config(model.prediction_type), "algorithm_type": "dpmsolver++", "solver_order": 2})
    else:
        scheduler = SD_Model.build_noise_scheduler(model.prediction_type, EulerDiscreteScheduler)
    scheduler.set_timesteps(steps, device=noise.device)
    latents = noise * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        model_input = scheduler.scale_model_input(latents, t)
        prediction = SD_Model.guided_prediction(model.unet, model_input, int(t), cond, uncond, cfg)
        latents = scheduler.step(prediction, t, latents).prev_sample
    return latents


@torch.no_grad()
def generate(model: Model, prompt: str, negative: str, seeds: list[int], *, steps: int, cfg: float, sampler: str,
             height: int, width: int, batch_size: int, device: torch.device, dtype: torch.dtype) -> list[np.ndarray]:
    """RGB uint8 images ``(H, W, 3)``, one per seed."""
    ids = SD_Model.tokenize(model.tokenizer, [prompt, negative])
    embeddings = SD_Model.encode_prompt_ids(model.text_encoder, ids).float()
    cond, uncond = embeddings[:1], embeddings[1:]
    factor = float(model.vae.config.scaling_factor)
    images = []
    for start in range(0, len(seeds), batch_size):
        chunk = seeds[start : start + batch_size]
        noise = initial_noise(chunk, (model.unet.config.in_channels, height // 8, width // 8)).to(device)
        with SD_Model.attention_context(device):
            latents = sample_latents(model, noise, cond.expand(len(chunk), -1, -1), uncond.expand(len(chunk), -1, -1),
                                     sampler=sampler, steps=steps, cfg=cfg)
            pixels = model.vae.decode(SD_Model.unscale_latents(latents, factor).to(dtype)).sample
        pixels = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        images += list(pixels.permute(0, 2, 3, 1).cpu().numpy())
    return images


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def parameters_text(prompt: str, negative: str, seed: int, args, source: str) -> str:
    """The A1111-style ``parameters`` chunk: prompt, negative prompt, then the settings on one line."""
    return (f"{prompt}\nNegative prompt: {negative}\nSteps: {args.steps}, Sampler: {args.sampler}, "
            f"CFG scale: {args.cfg}, Seed: {seed}, Size: {args.width}x{args.height}, Model: {source}")


def save_png(path: Path, image: np.ndarray, parameters: str) -> None:
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("parameters", parameters)
    SD_Files.write_atomic(path, lambda tmp: Image.fromarray(image).save(tmp, format="PNG", pnginfo=info))


def read_parameters(path: Path) -> str:
    from PIL import Image

    with Image.open(path) as image:
        return image.text["parameters"]


def save_grid(path: Path, rows: list[tuple[str, list[np.ndarray]]]) -> None:
    """One row per prompt with its text above it."""
    from PIL import Image, ImageDraw

    height, width = rows[0][1][0].shape[:2]
    columns = max(len(images) for _, images in rows)
    label = 16
    grid = Image.new("RGB", (columns * width, len(rows) * (height + label)), "white")
    draw = ImageDraw.Draw(grid)
    for r, (prompt, images) in enumerate(rows):
        top = r * (height + label)
        draw.text((2, top + 2), prompt[: max(10, columns * width // 6)], fill="black")
        for c, image in enumerate(images):
            grid.paste(Image.fromarray(image), (c * width, top + label))
    SD_Files.write_atomic(path, lambda tmp: grid.save(tmp, format="PNG"))


def export(args, model: Model) -> None:
    if args.export_diffusers:
        SD_Formats.export_diffusers(Path(args.export_diffusers), model.unet, model.vae, model.text_encoder,
                                    model.tokenizer, model.prediction_type)
        log.info("wrote diffusers pipeline folder %s", args.export_diffusers)
    if args.export_single_file:
        SD_Formats.save_single_file(Path(args.export_single_file), model.unet, model.vae, model.text_encoder,
                                    half=args.half, metadata={"source": model.source,
                                                              "prediction_type": model.prediction_type})
        log.info("wrote single file %s%s", args.export_single_file, " (fp16)" if args.half else "")


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        model = load_model(args.ckpt, use_ema=not args.no_ema, vae=args.vae, text_encoder=args.text_encoder,
                           tokenizer=args.tokenizer, arch=args.arch)
    except (FileNotFoundError, KeyError, ValueError, OSError) as error:
        print(f"SD_ImageGen.py: cannot load {args.ckpt}: {error}", file=sys.stderr)
        return 2
    log.info("loaded %s (%s)", model.source, model.prediction_type)
    if args.export_diffusers or args.export_single_file:
        export(args, model)
    if not args.prompt:
        return 0
    device, dtype = pick_device(args.device), pick_dtype(args.dtype, pick_device(args.device))
    for part in (model.unet, model.vae, model.text_encoder):
        part.to(device=device, dtype=dtype)
    model.unet = compile_unet(model.unet, args.compile)
    out = Path(args.out)
    rows, records = [], []
    for p, prompt in enumerate(args.prompt):
        seeds = [args.seed + i for i in range(args.n)]
        images = generate(model, prompt, args.negative, seeds, steps=args.steps, cfg=args.cfg, sampler=args.sampler,
                          height=args.height, width=args.width, batch_size=args.batch_size, device=device, dtype=dtype)
        for seed, image in zip(seeds, images):
            path = out / f"{p:03d}_{seed:06d}.png"
            save_png(path, image, parameters_text(prompt, args.negative, seed, args, model.source))
            records.append({"file": path.name, "prompt": prompt, "negative": args.negative, "seed": seed})
        rows.append((prompt, images))
    save_grid(out / "grid.png", rows)
    SD_Files.write_text_atomic(out / "images.json", json.dumps(records, indent=1) + "\n")
    log.info("wrote %d images and grid.png to %s", len(records), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
