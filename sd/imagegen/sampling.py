"""The samples ``SD_ImageGen.py`` draws: its prompts, the sampler, steps and guidance (their defaults suit the
sampler, ``auto`` the model), seeds, size, device and precision, and where the PNGs go. Image i of a prompt uses
seed ``--seed + i`` and is saved as its batch ends."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import sd.files
import sd.formats
import sd.model
import sd.runtime
import sd.sampling
from sd.sampling import Pipeline

log = logging.getLogger("sd_imagegen")


@dataclass(frozen=True)
class Settings:
    prompt: tuple[str, ...] = ()
    negative: str = ""
    steps: int = 100
    cfg: float = 7.5
    seed: int = 0
    n: int = 4
    batch_size: int = 4
    sampler: str = "ddim"
    height: int | None = None  # None: the size the model was trained at (``sized``)
    width: int | None = None
    device: str = "auto"
    precision: str = "auto"
    compile: str = "off"
    out: str | None = None


def add_flags(parser) -> None:
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    parser.add_argument("--prompts_file", help="a text file with one prompt per line")
    parser.add_argument("--negative", default="", help="negative prompt: the unconditional branch of CFG "
                        "(default: empty)")
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (default: "
                        + ", ".join(f"{n} with {s}" for s, n in sd.sampling.SAMPLER_STEPS.items())
                        + "; lcm takes 1..50; onestep 1..4, by default the steps a DMD generator was trained for)")
    parser.add_argument("--cfg", type=float, default=None, help="classifier-free guidance scale (default: 7.5; 1 with "
                        "--sampler lcm, whose models take 1 to 2, and onestep, whose generators have it folded in)")
    parser.add_argument("--seed", type=int, default=0, help="seed of image 0; image i uses seed + i "
                        "(default: %(default)s)")
    parser.add_argument("--n", type=int, default=4, help="images per prompt (default: %(default)s)")
    parser.add_argument("--batch_size", type=int, default=4, help="images per UNet call (default: %(default)s)")
    parser.add_argument("--sampler", choices=("auto", *sd.sampling.SAMPLERS), default="auto", help="the sampler; "
                        "lcm for a latent consistency model, onestep for a DMD generator, flow_euler or flow_heun for a "
                        "flow; auto = lcm for a run of ours trained with distill: lcm, onestep for distill: dmd (and a "
                        "file exported from one), flow_euler for a model trained as a flow, else ddim "
                        "(default: %(default)s)")
    parser.add_argument("--height", type=int, default=None, help="pixels, a multiple of 8 (default: the size the "
                        "model was trained at: our run's latents or DreamBooth image_size, else the UNet's "
                        "sample_size x 8)")
    parser.add_argument("--width", type=int, default=None, help="pixels, a multiple of 8 (default: as --height)")
    parser.add_argument("--device", default="auto", help="auto (CUDA, then Apple MPS, then CPU), cpu, cuda, mps")
    parser.add_argument("--precision", choices=("auto", *sd.runtime.PRECISIONS), default="auto",
                        help="model precision; auto = bf16 on CUDA, fp16 on MPS, fp32 on CPU")
    parser.add_alias("--dtype", "precision", choices=("auto", *sd.runtime.PRECISIONS))
    parser.add_argument("--compile", choices=sd.sampling.COMPILE_MODES, default="off",
                        help="torch.compile the UNet with this mode (reduce-overhead = CUDA graphs): faster sampling "
                        "after a first batch that compiles, worth it for many images (default: %(default)s)")
    parser.add_argument("--out", help="output folder for the PNGs and the grid (default: samples/NAME, NAME the "
                        "checkpoint's: samples/flow for --ckpt runs/flow)")


def settings(args, error, ckpt: str, prediction_type: str) -> Settings:
    """The sampling flags checked; ``--sampler auto`` is what ``ckpt`` records (read before it is loaded)."""
    prompts = list(args.prompt)
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.exists():
            error(f"--prompts_file {path} does not exist")
        prompts += [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if any(side is not None and (side % 8 or side <= 0) for side in (args.height, args.width)):
        error("--height and --width must be positive multiples of 8")
    sampler = sd.formats.recorded_default_sampler(ckpt, prediction_type) if args.sampler == "auto" else args.sampler
    try:  # onestep: the steps the generator was trained for
        steps, cfg = sd.formats.sampling_defaults(ckpt, sampler, args.steps, args.cfg,
                                                  sd.sampling.SAMPLER_STEPS[sampler], 7.5)
    except (KeyError, ValueError, OSError) as problem:
        error(f"--sampler {sampler}: {problem}")
    for name, value in (("n", args.n), ("batch_size", args.batch_size)):
        if value < 1:
            error(f"--{name} must be >= 1")
    if not 0 <= args.seed < 2**63:
        error(f"--seed must be a whole number in [0, 2^63), got {args.seed}")
    problem = sd.sampling.settings_error(sampler, steps, cfg)
    if problem:
        error(f"--sampler {sampler}, --steps {steps}, --cfg {cfg:g}: {problem}")
    out = args.out or (str(default_out(ckpt)) if prompts else None)
    return Settings(tuple(prompts), args.negative, steps, cfg, args.seed, args.n, args.batch_size, sampler,
                    args.height, args.width, args.device, args.precision, args.compile, out)


def default_out(ckpt: str) -> Path:
    """Where samples go without ``--out``: ``samples/NAME``, NAME the run's, file's or model's
    (``runs/flow`` -> ``samples/flow``, ``runs/x/checkpoints/step_00000500`` -> ``samples/x_step_00000500``,
    ``sd-v1-5.safetensors`` -> ``samples/sd-v1-5``, a hub id ``org/model`` -> ``samples/model``)."""
    path = Path(ckpt.rstrip("/"))
    name = path.stem if path.suffix in (".safetensors", ".ckpt") else path.name
    if path.parent.name == "checkpoints":
        name = f"{path.parent.parent.name}_{name}"
    return Path("samples") / (name or "model")


def checked(settings: Settings, model: Pipeline, ckpt: str) -> None:
    """A ValueError when the model cannot be sampled with the sampler asked for (a flow model with DDIM)."""
    problem = model.sampler_error(settings.sampler)
    if problem:
        raise ValueError(f"{ckpt} is {problem}")


def sized(settings: Settings, model: Pipeline, size: tuple[int, int] | None = None, why: str = "") -> Settings:
    """The settings with the samples' size: as given, else ``size`` (``why`` says whose), else the size the model
    was trained at."""
    if settings.height is not None and settings.width is not None:
        return settings
    width, height = size or (model.trained_size[0],) * 2
    settings = dataclasses.replace(settings, height=settings.height or height, width=settings.width or width)
    log.info("sampling at %dx%d (%s%s)", settings.width, settings.height, why or model.trained_size[1],
             "" if size else "; --height and --width set it")
    return settings


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while sampling, after ``written`` images were saved (each is saved as its batch is done)."""

    def __init__(self, written: int):
        super().__init__(written)
        self.written = written


def sample(settings: Settings, model: Pipeline, controls: list, records: list[dict], control_scale: float = 1.0):
    """``n`` images a prompt (``sized``) into ``out``: ``PPP_SEED.png`` with its parameters, saved as each batch
    is done, ``images.json`` (what is saved so far, after each batch) and ``grid.png`` at the end; ``controls``:
    each prompt's conditioning image (or None), ``records``: what each prompt's images record besides (the
    ControlNet's). Ctrl-C raises ``Interrupted`` with the count saved."""
    from tqdm.auto import tqdm

    device = sd.runtime.pick_device(settings.device)
    model.to(device, sd.runtime.resolve_precision(settings.precision, device))
    model.unet = sd.sampling.compile_unet(model.unet, settings.compile)
    out, rows, written = Path(settings.out), [], []
    batches = -(-settings.n // settings.batch_size)  # the bar counts denoising steps: it moves within a batch too
    bar = tqdm(total=len(settings.prompt) * batches * settings.steps,
               desc=f"sample ({settings.steps} steps, {settings.width}x{settings.height}, "
                    f"{len(settings.prompt) * settings.n} images)", unit="step")

    def step_done() -> bool:
        bar.update(1)
        return False  # never a stop: Ctrl-C raises KeyboardInterrupt by itself
    try:
        for p, prompt in enumerate(settings.prompt):
            seeds, images = [settings.seed + i for i in range(settings.n)], []
            for start in range(0, len(seeds), settings.batch_size):  # generate's own batches, saved as they end
                chunk = seeds[start : start + settings.batch_size]
                drawn = sd.sampling.generate(model, prompt, settings.negative, chunk, steps=settings.steps,
                                             cfg=settings.cfg, sampler=settings.sampler, height=settings.height,
                                             width=settings.width, batch_size=settings.batch_size, device=device,
                                             control=controls[p], control_scale=control_scale, stop=step_done)
                written += [save_image(settings, model, out, p, seed, image, records[p])
                            for seed, image in zip(chunk, drawn)]
                sd.files.write_text_atomic(out / "images.json", json.dumps(written, indent=1) + "\n")
                images += drawn
            rows.append((prompt, images))
    except KeyboardInterrupt:
        raise Interrupted(len(written)) from None
    finally:
        bar.close()
    sd.sampling.save_grid(out / "grid.png", rows)
    log.info("wrote %d images and grid.png to %s", len(written), out)


def save_image(settings: Settings, model: Pipeline, out: Path, p: int, seed: int, image, extra: dict) -> dict:
    """Image ``seed`` of prompt ``p`` as ``PPP_SEED.png`` with its parameters; its ``images.json`` record."""
    prompt = settings.prompt[p]
    path = out / f"{p:03d}_{seed:06d}.png"
    sd.sampling.save_png(path, image, sd.sampling.parameters_text(prompt, settings.negative, seed, settings,
                                                                  model.source, sd.model.clip_skip_of(model.text_encoder)))
    return {"file": path.name, "prompt": prompt, "negative": settings.negative, "seed": seed, **extra}
