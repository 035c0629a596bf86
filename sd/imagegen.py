"""``SD_ImageGen.py``'s work: a ``Request`` (its flags, resolved and checked) loaded, exported and sampled.

``load`` reads the checkpoint (a ControlNet run given as the checkpoint: its base, with it as the
ControlNet); ``prepare`` writes the exports of a run's own adapter, token or ControlNet, adds the
requested tokens and merges the requested LoRAs; ``export`` writes whole models; ``sample`` draws
``n`` images a prompt (image i from seed + i), with their PNGs' parameters, a grid and ``images.json``.
Errors a user can fix are ``ValueError`` / ``OSError`` / ``KeyError`` naming the file or flag.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

import sd.controlnet.formats
import sd.controlnet.model
import sd.data.training_data
import sd.embedding.formats
import sd.embedding.tokens
import sd.files
import sd.formats
import sd.lora.adapters
import sd.lora.formats
import sd.metadata
import sd.posthoc_ema
import sd.runtime
import sd.run_folder
import sd.sampling
from sd.sampling import Pipeline

log = logging.getLogger("sd_imagegen")
CONTROLNET_FORMATS = ("original", "diffusers")


@dataclass(frozen=True)
class Request:
    """What ``SD_ImageGen.py`` was asked, by its flags' names, with defaults resolved (``steps``, ``cfg``),
    the prompts file read into ``prompt``, and ``lora`` / ``embedding`` parsed into (path, scale) / (path,
    token) pairs. ``height`` / ``width`` None: the size the model was trained at (``sample``)."""

    ckpt: str
    prompt: tuple[str, ...] = ()
    negative: str = ""
    steps: int = 100
    cfg: float = 7.5
    seed: int = 0
    n: int = 4
    batch_size: int = 4
    sampler: str = "ddim"
    no_ema: bool = False
    height: int | None = None
    width: int | None = None
    device: str = "auto"
    precision: str = "auto"
    compile: str = "off"
    arch: str = "sd1"
    prediction_type: str = "auto"
    zero_terminal_snr: bool | None = None
    flow_shift: float | None = None
    vae: str | None = None
    text_encoder: str | None = None
    tokenizer: str | None = None
    out: str | None = None
    export_diffusers: str | None = None
    export_single_file: str | None = None
    half: bool = False
    export_lora: str | None = None
    lora_format: str = sd.lora.formats.DEFAULT_LORA_FORMAT
    allow_other_base: bool = False
    lora: tuple[tuple[str, float], ...] = ()
    embedding: tuple[tuple[str, str | None], ...] = ()
    export_embedding: str | None = None
    embedding_format: str = sd.embedding.formats.DEFAULT_EMBEDDING_FORMAT
    ema_length: float | None = None
    controlnet: str | None = None
    control: tuple[str, ...] = ()
    control_scale: float = 1.0
    export_controlnet: str | None = None
    controlnet_format: str = "original"

    @property
    def merging(self) -> bool:
        """Whether the base is used whole (sampled or exported), not just a run's adapter."""
        return bool(self.prompt or self.export_diffusers or self.export_single_file)


def parse_lora_spec(spec: str) -> tuple[str, float]:
    """``FILE_OR_DIR[:SCALE]`` -> (path, scale). A path may hold ':' itself (``C:\\x``, ``a:b.safetensors``):
    the text after the last ':' is a scale only when it reads as a number, and never when the whole
    text names an existing file or folder."""
    path, sep, tail = spec.rpartition(":")
    if not sep or Path(spec).exists():
        return spec, 1.0
    try:
        scale = float(tail)
    except ValueError:
        return spec, 1.0
    if not math.isfinite(scale) or not path:
        raise ValueError(f"--lora {spec}: give FILE_OR_DIR[:SCALE] with a finite SCALE")
    return path, scale


def parse_embedding_spec(spec: str) -> tuple[str, str | None]:
    """``FILE[:TOKEN]`` -> (path, token or None); a path that exists as written is taken whole."""
    path, sep, token = spec.rpartition(":")
    if not sep or Path(spec).exists() or not path or "/" in token or "\\" in token:
        return spec, None
    return path, token


# ---------------------------------------------------------------------------------------------
# LoRA and learned tokens
# ---------------------------------------------------------------------------------------------


def training_record(source: str | None) -> sd.metadata.TrainingRecord | None:
    """What a run of ours (a run or checkpoint folder) records of its training; None for any other source."""
    try:
        if not source or sd.formats.run_config(source) is None:
            return None
        return sd.metadata.TrainingRecord.read(sd.run_folder.resolve_checkpoint(source))
    except (OSError, ValueError):
        return None


def file_header(kind: str, out: str | Path, model: Pipeline, source: str | None,
                record: sd.metadata.TrainingRecord | None = None) -> dict[str, str]:
    """The ``modelspec`` header of an exported file of ``kind`` (``sd.metadata``), titled by the name ``out``
    gives it, with the resolution and date of ``source``'s training (``record``, when read already) when it is
    a run of ours."""
    record = record or training_record(source)
    resolution = sd.metadata.training_resolution(record.config) if record else None
    return sd.metadata.modelspec(kind, Path(out).name.removesuffix(".safetensors"), model.prediction_type,
                                 resolution, record.saved_at if record else None)


def export_embedding(request: Request, model: Pipeline) -> None:
    layers = sd.embedding.tokens.added_embeddings(model.text_encoder)
    if not layers:
        raise ValueError(f"{request.ckpt} has learned no token to export (--export_embedding takes a textual inversion "
                         "run of ours)")
    layer = layers[0]
    out = sd.embedding.formats.embedding_output(request.export_embedding, layer.tokens[0], request.embedding_format)
    header = file_header("textual-inversion", out if request.embedding_format == "a1111" else out.parent, model,
                         request.ckpt)
    path = sd.embedding.formats.write_embedding(request.export_embedding, layer.tokens[0], layer.vectors,
                                              request.embedding_format, metadata=header)
    log.info("wrote embedding %s of token %s (%d vector(s), %s format)", path, layer.tokens[0],
             layer.vectors.shape[0], request.embedding_format)


def add_embeddings(request: Request, model: Pipeline) -> None:
    for path, token in request.embedding:
        token, vectors = sd.embedding.formats.read_embedding(path, token)
        try:
            sd.embedding.tokens.add_token(model.tokenizer, model.text_encoder, token, vectors)
        except sd.embedding.tokens.EmbeddingError as error:
            raise sd.embedding.tokens.EmbeddingError(f"--embedding {path}: {error}") from error
        log.info("added token %s (%d vector(s)) from %s", token, vectors.shape[0], path)


def export_lora(request: Request, model: Pipeline) -> None:
    if not (sd.lora.adapters.has_lora(model.unet) or sd.lora.adapters.has_lora(model.text_encoder)):
        raise ValueError(f"{request.ckpt} carries no LoRA adapter to export (--export_lora takes a LoRA run of ours; "
                         "--lora merges LoRA files into a model)")
    title = Path(request.export_lora).name.removesuffix(".safetensors")
    record = training_record(request.ckpt)
    header = file_header("lora", title, model, request.ckpt, record)
    if record is not None:
        header.update(sd.metadata.kohya_training_keys(record, title))
    # a pivotal tuning's token (the run's own: --embedding files are added after the exports), bundled in the
    # kohya file for AUTOMATIC1111 and written beside it for ComfyUI and diffusers
    tokens = {layer.tokens[0]: layer.vectors for layer in sd.embedding.tokens.added_embeddings(model.text_encoder)}
    path = sd.lora.formats.lora_output(request.export_lora, request.lora_format)
    beside = {token: sd.embedding.formats.embedding_output(path.parent, token) for token in tokens}
    if path in beside.values():
        raise ValueError(f"--export_lora {path}: the learned token's embedding file would take that name; name the "
                         "LoRA otherwise")
    path = sd.lora.formats.save_model_lora(request.export_lora, model.unet, model.text_encoder, request.lora_format,
                                           metadata=header,
                                           embeddings=tokens if request.lora_format == "kohya" else None)
    log.info("wrote LoRA %s (%s format)%s", path, request.lora_format,
             f" bundling token {', '.join(tokens)}" if tokens and request.lora_format == "kohya" else "")
    for token, vectors in tokens.items():
        out = sd.embedding.formats.write_embedding(beside[token], token, vectors,
                                                   metadata=file_header("textual-inversion", beside[token], model,
                                                                        request.ckpt, record))
        log.info("wrote embedding %s of token %s beside it (ComfyUI, diffusers)", out, token)


def export(request: Request, model: Pipeline) -> None:
    if sd.embedding.tokens.added_embeddings(model.text_encoder):
        log.info("the learned token is not part of the model's files: write it with --export_embedding")
    with sd.embedding.tokens.without_added(model.text_encoder):
        export_models(request, model)


def export_models(request: Request, model: Pipeline) -> None:
    if request.export_diffusers:
        sd.formats.export_diffusers(Path(request.export_diffusers), model.unet, model.vae, model.text_encoder,
                                    model.tokenizer, model.prediction_type, model.zero_terminal_snr, model.flow_shift)
        log.info("wrote diffusers pipeline folder %s", request.export_diffusers)
    if request.export_single_file:
        metadata = {**file_header("checkpoint", request.export_single_file, model, request.ckpt),
                    "prediction_type": model.prediction_type, "zero_terminal_snr": str(model.zero_terminal_snr).lower()}
        if model.prediction_type == "flow" or model.flow_matching:  # read back by sd.formats.recorded_flow
            metadata.update(flow_shift=f"{model.flow_shift:g}", flow_matching=str(model.flow_matching).lower())
        sd.formats.save_single_file(Path(request.export_single_file), model.unet, model.vae, model.text_encoder,
                                    half=request.half, metadata=metadata)
        log.info("wrote single file %s%s", request.export_single_file, " (fp16)" if request.half else "")


def controlnet_run_as_ckpt(request: Request) -> Request:
    """A ControlNet run given as ``--ckpt`` samples on its base with itself as the ControlNet."""
    if not sd.controlnet.model.is_controlnet_run(request.ckpt):
        return request
    if request.controlnet:
        raise ValueError(f"{request.ckpt} is a ControlNet run, and --controlnet {request.controlnet} another "
                         "ControlNet: give one of them")
    base = sd.controlnet.model.run_base(request.ckpt)
    log.info("%s is a ControlNet run: its base %s with it as the ControlNet", request.ckpt, base)
    return dataclasses.replace(request, controlnet=request.ckpt, ckpt=base)


def load_controlnet(request: Request, model: Pipeline):
    """``--controlnet`` for the model's UNet (None without one), after ``--export_controlnet`` wrote it."""
    if not request.controlnet:
        if request.control or request.export_controlnet:
            raise ValueError(f"--{'control' if request.control else 'export_controlnet'} needs a ControlNet: "
                             "--controlnet PATH, or a ControlNet run as --ckpt")
        return None
    if request.prompt and not request.control:
        raise ValueError("a ControlNet conditions every sample on an image: give --control IMAGE")
    controlnet = sd.controlnet.model.load(request.controlnet, model.unet, use_ema=not request.no_ema)
    log.info("ControlNet %s", request.controlnet)
    if request.export_controlnet:
        out = Path(request.export_controlnet)
        if request.controlnet_format == "diffusers":
            sd.controlnet.formats.save_diffusers(controlnet, out)
        else:
            out = out if out.suffix == ".safetensors" else out.with_name(out.name + ".safetensors")
            dtype = torch.float16 if request.half else torch.float32
            sd.controlnet.formats.save_single_file(controlnet, out, dtype=dtype,
                                                   metadata=file_header("controlnet", out, model, request.controlnet))
        log.info("wrote ControlNet %s (%s layout%s)", out, request.controlnet_format, ", fp16" if request.half else "")
    return controlnet


def control_size(request: Request) -> tuple[int, int] | None:
    """``(width, height)`` of the first ``--control`` image when it is a multiple of 8 on both sides, else None."""
    _, _, height, width = sd.controlnet.model.read_control_image(request.control[0]).shape
    return (width, height) if width % 8 == 0 and height % 8 == 0 else None


def auto_sampler(ckpt: str, prediction_type: str = "auto") -> str:
    """``--sampler auto``: lcm for a run of ours distilled to a latent consistency model, flow_euler for a
    model trained as a flow (``sd.sampling.default_sampler``), else ddim. A checkpoint whose records cannot
    be read here gets ddim; loading it names what is wrong."""
    from safetensors import SafetensorError

    try:
        config = sd.formats.run_config(ckpt)
        if config and config.get("distill") == "lcm":
            return "lcm"
        if prediction_type == "auto":
            prediction_type = sd.formats.recorded_prediction_type(ckpt)
        return sd.sampling.default_sampler(prediction_type, sd.formats.recorded_flow(ckpt)[1])
    except (KeyError, ValueError, OSError, SafetensorError):
        return "ddim"


def trained_size(ckpt: str, model: Pipeline) -> tuple[int, str]:
    """The square side a model was trained at, and where it comes from: a DreamBooth run's
    ``image_size``, a run's latents (the square of its largest bucket's pixels), else what its UNet
    config says (``sample_size`` latents, diffusers' own default)."""
    config = sd.formats.run_config(ckpt)
    if config and config.get("instance_dir"):
        return int(config["image_size"]), "the run's DreamBooth image_size"
    if config and config.get("datasets"):
        latents = Path(str(config["datasets"][0]["latents"]))
        try:
            side = sd.data.training_data.resolution_of_latents(sd.data.training_data.read_latents_meta(latents))
        except (OSError, ValueError):  # unreadable or unfinished: the size is not known from there
            side = None
        if side:
            return side, f"the latents in {latents}"
    return int(model.unet.config.sample_size) * 8, "the UNet's sample_size"


def load(request: Request) -> Pipeline:
    """The model ``request.ckpt`` names. Unless ``allow_other_base``, a LoRA run's base is checked against the
    base its adapter was trained on, and so is the base of a ControlNet run of ours that ``--ckpt`` names."""
    model = sd.formats.load_pipeline(request.ckpt, use_ema=not request.no_ema, vae=request.vae,
                                     text_encoder=request.text_encoder, tokenizer=request.tokenizer, arch=request.arch,
                                     prediction_type=None if request.prediction_type == "auto"
                                     else request.prediction_type,
                                     zero_terminal_snr=request.zero_terminal_snr,
                                     check_base=request.merging and not request.allow_other_base,
                                     flow_shift=request.flow_shift)
    flow = model.prediction_type == "flow" or model.flow_matching
    log.info("loaded %s (%s%s%s%s)", model.source, model.prediction_type,
             ", zero terminal SNR" if model.zero_terminal_snr else "",
             ", trained as a flow" if model.flow_matching else "",
             f", flow shift {model.flow_shift:g}" if flow else "")
    if request.prompt and model.prediction_type == "flow" and request.sampler not in sd.sampling.FLOW_SAMPLERS:
        raise ValueError(f"{request.ckpt} is a flow model: sample it with --sampler "
                         f"{' or '.join(sd.sampling.FLOW_SAMPLERS)} (or auto), not {request.sampler}")
    controlnet = request.controlnet
    if (controlnet and not request.allow_other_base and sd.controlnet.model.is_controlnet_run(controlnet)
            and sd.controlnet.model.run_base(controlnet) == request.ckpt):  # the base it records, as loaded now
        sd.formats.check_trained_base(sd.run_folder.resolve_checkpoint(Path(controlnet)), request.ckpt, model.unet,
                                      what="ControlNet")
    if request.ema_length is not None:
        use_posthoc_ema(request, model)
    return model


def use_posthoc_ema(request: Request, model: Pipeline) -> None:
    """``--ema_length``: the trained weights (the UNet's, and a text adapter's or learned token's) replaced by the
    EMA of that length rebuilt from the run's post-hoc EMA snapshots (``sd.posthoc_ema``), at the newest
    snapshot up to the checkpoint's step."""
    if sd.formats.run_config(request.ckpt) is None:
        raise ValueError(f"--ema_length rebuilds an EMA from a run of ours; {request.ckpt} is none")
    checkpoint = sd.run_folder.resolve_checkpoint(request.ckpt)
    run_dir, at = checkpoint.parent.parent, sd.run_folder.checkpoint_step(checkpoint)
    steps = [s for s, _ in sd.posthoc_ema.snapshots(run_dir) if s <= at]
    if not steps:
        raise ValueError(f"--ema_length: {run_dir / sd.posthoc_ema.FOLDER} holds no snapshot up to step {at} "
                         "(train with posthoc_ema_every)")
    for step in reversed(steps):  # the newest snapshot that can be read
        try:
            weights, step = sd.posthoc_ema.reconstruct(run_dir, request.ema_length, step)
            break
        except sd.posthoc_ema.DamagedSnapshot as error:
            log.warning("--ema_length: %s; the EMA is rebuilt at an earlier snapshot", error)
    else:
        raise ValueError(f"--ema_length: no snapshot in {run_dir / sd.posthoc_ema.FOLDER} up to step {at} can be read")
    params = dict(model.unet.named_parameters())
    params.update({sd.run_folder.EMA_TEXT_PREFIX + name: p for name, p in model.text_encoder.named_parameters()})
    missing = [name for name in weights if name not in params]
    if missing:
        raise ValueError(f"--ema_length: the snapshots hold weights the model lacks, e.g. {missing[:2]}")
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    text = any(name.startswith(sd.run_folder.EMA_TEXT_PREFIX) for name in weights)
    log.info("the UNet's%s EMA of length %g rebuilt from %d post-hoc EMA snapshots at step %d",
             " and the text encoder's" if text else "", request.ema_length, len([s for s in steps if s <= step]), step)


def prepare(request: Request, model: Pipeline) -> tuple[Request, torch.nn.Module | None]:
    """The exports of the checkpoint's own adapter, token and ControlNet; the requested tokens added and
    LoRAs merged; the ControlNet (or None), and the request with the control image's size when it sets it."""
    if request.export_lora:
        export_lora(request, model)
    if request.export_embedding:
        export_embedding(request, model)
    add_embeddings(request, model)
    if request.merging:  # the plain, merged weights
        sd.lora.formats.merge_adapters(model, list(request.lora))
    controlnet = load_controlnet(request, model)
    if controlnet is not None and request.prompt and (request.height is None or request.width is None):
        size = control_size(request)
        if size is None:
            raise ValueError(f"--control {request.control[0]} is not a multiple of 8 pixels on each side: give "
                             "--height and --width (it is resized to them)")
        request = dataclasses.replace(request, width=request.width or size[0], height=request.height or size[1])
        log.info("sampling at %dx%d (the control image's size)", request.width, request.height)
    return request, controlnet


def sized(request: Request, model: Pipeline) -> Request:
    """The request with the samples' size: as given, else the size the model was trained at."""
    if request.height is not None and request.width is not None:
        return request
    side, why = trained_size(request.ckpt, model)
    request = dataclasses.replace(request, height=request.height or side, width=request.width or side)
    log.info("sampling at %dx%d (%s; --height and --width set it)", request.width, request.height, why)
    return request


def control_images(request: Request, controlnet) -> list:
    """Each prompt's conditioning image at the samples' size (None without a ControlNet); a file that does
    not decode is a ValueError naming it."""
    if controlnet is None:
        return [None] * len(request.prompt)
    read = [sd.controlnet.model.read_control_image(path, request.width, request.height) for path in request.control]
    return read * len(request.prompt) if len(read) == 1 else read


def default_out(ckpt: str) -> Path:
    """Where samples go without ``--out``: ``samples/NAME``, NAME the run's, file's or model's
    (``runs/flow`` -> ``samples/flow``, ``runs/x/checkpoints/step_00000500`` -> ``samples/x_step_00000500``,
    ``sd-v1-5.safetensors`` -> ``samples/sd-v1-5``, a hub id ``org/model`` -> ``samples/model``)."""
    path = Path(ckpt.rstrip("/"))
    name = path.stem if path.suffix in (".safetensors", ".ckpt") else path.name
    if path.parent.name == "checkpoints":
        name = f"{path.parent.parent.name}_{name}"
    return Path("samples") / (name or "model")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while sampling, after ``written`` images were saved (each is saved as its batch is done)."""

    def __init__(self, written: int):
        super().__init__(written)
        self.written = written


def sample(request: Request, model: Pipeline, controlnet, controls: list) -> None:
    """``n`` images a prompt (``sized``) into ``out``: ``PPP_SEED.png`` with its parameters, saved as each
    batch is done, ``images.json`` (what is saved so far, after each batch) and ``grid.png`` at the end; with a
    ControlNet, each prompt's image of ``controls``. Ctrl-C raises ``Interrupted`` with the count saved."""
    from tqdm.auto import tqdm

    device = sd.runtime.pick_device(request.device)
    dtype = sd.runtime.resolve_precision(request.precision, device)
    if controlnet is not None:
        model.unet = sd.controlnet.model.ControlledUNet(model.unet, controlnet)
    model.to(device, dtype)
    model.unet = sd.sampling.compile_unet(model.unet, request.compile)
    out = Path(request.out)
    rows, records = [], []
    # The bar counts denoising steps (asked before each one: ``stop``), so it moves within a batch too.
    batches = -(-request.n // request.batch_size)
    bar = tqdm(total=len(request.prompt) * batches * request.steps,
               desc=f"sample ({request.steps} steps, {request.width}x{request.height}, "
                    f"{len(request.prompt) * request.n} images)", unit="step")

    def step_done() -> bool:
        bar.update(1)
        return False  # never a stop: Ctrl-C raises KeyboardInterrupt by itself
    try:
        for p, prompt in enumerate(request.prompt):
            seeds = [request.seed + i for i in range(request.n)]
            images = []
            for start in range(0, len(seeds), request.batch_size):  # generate's own batches, saved as they end
                chunk = seeds[start : start + request.batch_size]
                drawn = sd.sampling.generate(model, prompt, request.negative, chunk, steps=request.steps,
                                             cfg=request.cfg, sampler=request.sampler, height=request.height,
                                             width=request.width, batch_size=request.batch_size, device=device,
                                             control=controls[p], control_scale=request.control_scale, stop=step_done)
                records += [save_image(request, model, out, p, seed, image, controls[p] is not None)
                            for seed, image in zip(chunk, drawn)]
                sd.files.write_text_atomic(out / "images.json", json.dumps(records, indent=1) + "\n")
                images += drawn
            rows.append((prompt, images))
    except KeyboardInterrupt:
        raise Interrupted(len(records)) from None
    finally:
        bar.close()
    sd.sampling.save_grid(out / "grid.png", rows)
    log.info("wrote %d images and grid.png to %s", len(records), out)


def save_image(request: Request, model: Pipeline, out: Path, p: int, seed: int, image, controlled: bool) -> dict:
    """Image ``seed`` of prompt ``p`` as ``PPP_SEED.png`` with its parameters; its ``images.json`` record."""
    prompt = request.prompt[p]
    path = out / f"{p:03d}_{seed:06d}.png"
    sd.sampling.save_png(path, image, sd.sampling.parameters_text(prompt, request.negative, seed, request, model.source))
    record = {"file": path.name, "prompt": prompt, "negative": request.negative, "seed": seed}
    if controlled:
        record.update(controlnet=request.controlnet, control=request.control[p if len(request.control) > 1 else 0],
                      control_scale=request.control_scale)
    return record
