"""Sample images from a trained SD 1.x model, and export it to the formats other tools load.

    python SD_ImageGen.py --ckpt PATH --prompt "..." [--negative "..."] [--steps 100] [--cfg 7.5]
                          [--seed 0] [--n 4] [--batch_size 4] [--sampler auto|ddim|dpm++|euler|lcm|flow_euler|flow_heun] [--no_ema]
                          [--height H --width W] [--device auto] --out DIR
    python SD_ImageGen.py --ckpt runs/p7_consolidation --export_diffusers exported/sd1
    python SD_ImageGen.py --ckpt runs/p7_consolidation --export_single_file sd1.safetensors --half
    python SD_ImageGen.py --ckpt runs/style_lora --export_lora style.safetensors [--lora_format kohya|diffusers]
    python SD_ImageGen.py --ckpt sd1_folder --lora style.safetensors:0.7 [--lora other_dir] --prompt "..." --out DIR
    python SD_ImageGen.py --ckpt runs/my_token --export_embedding embeddings/ [--embedding_format a1111|diffusers]
    python SD_ImageGen.py --ckpt sd1_folder --embedding my-cat.safetensors[:<my-cat>] --prompt "a photo of <my-cat>" --out DIR
    python SD_ImageGen.py --ckpt sd1_folder --controlnet runs/canny --control edges.png [--control_scale 1] --prompt "..." --out DIR
    python SD_ImageGen.py --ckpt runs/canny --export_controlnet canny.safetensors [--controlnet_format original|diffusers]

``--ckpt`` is a training checkpoint or run folder of ours (EMA weights unless ``--no_ema``; with ``--best``
the checkpoint of the run's best evaluation, ``keep_best``; with ``--ema_length`` an EMA of any length
rebuilt from the run's post-hoc EMA snapshots, ``posthoc_ema_every``), a
diffusers pipeline folder or hub id, or a single ``.safetensors`` / ``.ckpt`` file in the original
SD layout. Image i of a prompt uses seed ``--seed + i``: the same seed gives the same image whatever
the batch size. Each PNG stores its generation parameters in a ``parameters`` text chunk.
``--sampler lcm`` samples a latent consistency model: 4 steps at ``--cfg 1`` unless they are given;
it is the default (``--sampler auto``) for a run of ours trained with ``distill: lcm``, ``flow_euler`` for
a model trained as a flow (``prediction_type: flow``, or ``flow_matching``: Euler on the flow ODE, as
diffusers' ``FlowMatchEulerDiscreteScheduler``; ``flow_heun`` its Heun), DDIM otherwise. The default step
count suits the sampler: 100 for DDIM and Euler, 25 for DPM++ (second order), 4 for LCM, 50 for flow_euler
and 25 for flow_heun; ``--flow_shift`` defaults to the shift the model records.

``--prediction_type`` and ``--zero_terminal_snr`` default to what the checkpoint records. A model
trained with ``zero_terminal_snr`` (Lin et al. 2023) is sampled on that rescaled schedule with
"trailing" timesteps that start from pure noise, and its exports say so (a diffusers scheduler config
with ``rescale_betas_zero_snr`` and trailing spacing, a single file's ``zero_terminal_snr`` metadata).

LoRA: a LoRA run of ours loads its base (the run's ``init_from``) and its adapter (the EMA adapter
unless ``--no_ema``); a base that is not the one the adapter was trained on is refused unless
``--allow_other_base``. ``--export_lora OUT`` writes that adapter alone: in the kohya layout, one file
``OUT`` (``.safetensors`` added when OUT lacks it; ComfyUI, AUTOMATIC1111, kohya's sd-scripts and
diffusers load it) or, with ``--lora_format diffusers``, a folder ``OUT/pytorch_lora_weights.safetensors``
(diffusers' ``load_lora_weights`` alone). For sampling and the full exports the run's adapter is merged
into the weights at scale 1, and each ``--lora FILE_OR_DIR[:SCALE]`` (either format; scale 1 unless
given) is merged after it, so ``--export_diffusers`` / ``--export_single_file`` write the merged model.
A LoRA holding a NaN or an infinity is refused, naming the tensor and the file.

Textual inversion: a run of ours that learned a token (``embedding_token``) loads its base and the
token (its EMA unless ``--no_ema``), so its prompts can use the token at once. ``--export_embedding OUT``
writes the token alone: ``OUT`` itself when it ends in ``.safetensors``, else a file in the folder OUT,
``<token>.safetensors`` in the layout AUTOMATIC1111 (its ``embeddings/`` folder, prompted by the file's
name), ComfyUI (``embedding:NAME``) and diffusers' ``load_textual_inversion(path, token=...)`` load, or
with ``--embedding_format diffusers`` ``learned_embeds.safetensors`` keyed by the token (diffusers
needs no ``token=``). ``--embedding FILE[:TOKEN]`` adds a token from a file of either layout (or an
AUTOMATIC1111 ``.pt``) to any model for sampling; its name is TOKEN, else the file's key or stem. The
full exports do not take ``--embedding``: a model's vocabulary stays the size other tools expect.

ControlNet: ``--controlnet`` is a ControlNet run or checkpoint of ours (its EMA unless ``--no_ema``), a
diffusers ControlNet folder, or a single file in the original or the diffusers layout; every image is
conditioned on ``--control IMAGE`` (resized to the samples' size, which defaults to the image's own) with
its residuals times ``--control_scale``. A ControlNet run given as ``--ckpt`` samples on its base (the
run's ``init_from``) with itself as the ControlNet. ``--export_controlnet OUT`` writes the ControlNet alone:
one file in the original layout (``control_model.*``: ComfyUI's ControlNet loader and AUTOMATIC1111's
sd-webui-controlnet), or with ``--controlnet_format diffusers`` a folder ``ControlNetModel.from_pretrained``
loads (ComfyUI reads its ``diffusion_pytorch_model.safetensors`` too).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import sys
from pathlib import Path

from safetensors import SafetensorError

import sd.cli
import sd.embedding.formats
import sd.flow
import sd.formats
import sd.imagegen
import sd.lora.formats
import sd.run_folder
import sd.runtime
import sd.sampling

log = logging.getLogger("sd_imagegen")
ERRORS = (KeyError, ValueError, OSError, SafetensorError)  # what a user can fix; the message names the file


def parse_args(argv=None):
    parser = sd.cli.ArgumentParser(description=__doc__)
    parser.add_argument("--ckpt", required=True, help="our checkpoint or run folder, a diffusers folder or hub id, "
                        "or a single .safetensors/.ckpt file")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    parser.add_argument("--prompts_file", help="a text file with one prompt per line")
    parser.add_argument("--negative", default="", help="negative prompt: the unconditional branch of CFG (default: empty)")
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (default: 100 with ddim and euler, "
                        "25 with dpm++, 4 with lcm, which takes 1..50, 50 with flow_euler, 25 with flow_heun)")
    parser.add_argument("--cfg", type=float, default=None, help="classifier-free guidance scale (default: 7.5; 1 with "
                        "--sampler lcm, whose models take 1 to 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of image 0; image i uses seed + i (default: %(default)s)")
    parser.add_argument("--n", type=int, default=4, help="images per prompt (default: %(default)s)")
    parser.add_argument("--batch_size", type=int, default=4, help="images per UNet call (default: %(default)s)")
    parser.add_argument("--sampler", choices=("auto", *sd.sampling.SAMPLERS), default="auto", help="the sampler; "
                        "lcm for a latent consistency model, flow_euler or flow_heun for a flow; auto = lcm for a run of ours "
                        "trained with distill: lcm, flow_euler for a model trained as a flow, else ddim "
                        "(default: %(default)s)")
    parser.add_bool("--no_ema", help="use the live weights of our checkpoints, not the EMA")
    parser.add_argument("--ema_length", type=float, default=None, help="a run trained with posthoc_ema_every: the "
                        "UNet's EMA of this relative length (sigma_rel, e.g. 0.05; the kept ones are 0.05 and 0.10) "
                        "rebuilt from its snapshots, at the newest one up to the checkpoint's step")
    parser.add_bool("--best", help="--ckpt is a run folder trained with keep_best: use the checkpoint of its best "
                    "evaluation, which its best.json names")
    parser.add_argument("--height", type=int, default=None, help="pixels, a multiple of 8 (default: the size the model "
                        "was trained at: our run's latents or DreamBooth image_size, else the UNet's sample_size x 8)")
    parser.add_argument("--width", type=int, default=None, help="pixels, a multiple of 8 (default: as --height)")
    parser.add_argument("--device", default="auto", help="auto (CUDA, then Apple MPS, then CPU), cpu, cuda, mps")
    parser.add_argument("--precision", choices=("auto", *sd.runtime.PRECISIONS), default="auto",
                        help="model precision; auto = bf16 on CUDA, fp16 on MPS, fp32 on CPU")
    parser.add_alias("--dtype", "precision", choices=("auto", *sd.runtime.PRECISIONS))
    parser.add_argument("--compile", choices=sd.sampling.COMPILE_MODES, default="off",
                        help="torch.compile the UNet with this mode (reduce-overhead = CUDA graphs): faster sampling "
                        "after a first batch that compiles, worth it for many images (default: %(default)s)")
    parser.add_argument("--arch", choices=sorted(sd.formats.SINGLE_FILE_ARCHS), default="sd1",
                        help="architecture of a single-file --ckpt (default: %(default)s)")
    parser.add_argument("--prediction_type", choices=("auto", *sd.formats.PREDICTION_TYPES), default="auto",
                        help="what the UNet predicts; auto = what the checkpoint records (its training config, a "
                        "single file's metadata, a diffusers scheduler config), epsilon when it records nothing "
                        "(default: %(default)s)")
    parser.add_argument("--flow_shift", type=float, default=None, help="the flow samplers' time shift (above 1: more "
                        "steps at high noise); default: what the checkpoint records (its training config's flow_shift, "
                        "a single file's metadata, a diffusers FlowMatch scheduler's shift), else 1; in [0.1, 10] as in training")
    parser.add_argument("--zero_terminal_snr", type=sd.cli.parse_auto_bool, default=None, metavar="auto|true|false",
                        help="sample on the zero-terminal-SNR schedule with trailing timesteps (needs v_prediction); "
                        "auto = what the checkpoint records (its training config, a single file's metadata, a "
                        "diffusers scheduler config's rescale_betas_zero_snr), false when it records nothing "
                        "(default: auto)")
    parser.add_argument("--vae", help="override the checkpoint's VAE (hub id, folder or tiny)")
    parser.add_argument("--text_encoder", help="override the checkpoint's text encoder (hub id, folder or tiny)")
    parser.add_argument("--tokenizer", help="override the checkpoint's tokenizer (hub id, folder or tiny)")
    parser.add_argument("--out", help="output folder for the PNGs and the grid (default: samples/NAME, NAME the "
                        "checkpoint's: samples/flow for --ckpt runs/flow)")
    parser.add_argument("--export_diffusers", metavar="DIR", help="write a diffusers StableDiffusionPipeline folder")
    parser.add_argument("--export_single_file", metavar="FILE", help="write one .safetensors in the original SD layout")
    parser.add_bool("--half", help="fp16 weights in --export_single_file")
    parser.add_argument("--export_lora", metavar="OUT", help="write the LoRA adapter of --ckpt (a LoRA run of ours): "
                        "the file OUT (.safetensors added if missing), or with --lora_format diffusers a folder OUT "
                        "holding pytorch_lora_weights.safetensors")
    parser.add_argument("--lora_format", choices=sd.lora.formats.LORA_FORMATS, default=sd.lora.formats.DEFAULT_LORA_FORMAT,
                        help="layout of --export_lora: kohya (lora_unet_...: ComfyUI, AUTOMATIC1111, sd-scripts and "
                        "diffusers load it) or diffusers (PEFT keys: diffusers' load_lora_weights only; the other "
                        "tools skip them) (default: %(default)s)")
    parser.add_bool("--allow_other_base", help="apply a LoRA run's adapter, or a ControlNet run given as --ckpt, even "
                    "to a base that is not the one it was trained on (its init_from now holds other weights); refused "
                    "otherwise")
    parser.add_argument("--lora", action="append", default=[], metavar="FILE_OR_DIR[:SCALE]",
                        help="merge this LoRA (a kohya .safetensors, or a diffusers file or folder) into the weights "
                        "before sampling and the full exports, times SCALE (default 1); repeat for several")
    parser.add_argument("--embedding", action="append", default=[], metavar="FILE[:TOKEN]",
                        help="add a learned token from this embedding file (AUTOMATIC1111 / ComfyUI / diffusers "
                        "layout) for sampling; TOKEN names it (default: the file's key, else its name); repeatable")
    parser.add_argument("--export_embedding", metavar="OUT", help="write the token learned by --ckpt (a textual "
                        "inversion run of ours): OUT.safetensors, or a file in the folder OUT")
    parser.add_argument("--embedding_format", choices=sd.embedding.formats.EMBEDDING_FORMATS,
                        default=sd.embedding.formats.DEFAULT_EMBEDDING_FORMAT,
                        help="layout of --export_embedding: a1111 (emb_params: AUTOMATIC1111, ComfyUI, and diffusers "
                        "with token=) or diffusers (keyed by the token: learned_embeds.safetensors) "
                        "(default: %(default)s)")
    parser.add_argument("--controlnet", metavar="PATH", help="condition the samples with this ControlNet: a ControlNet "
                        "run of ours, a diffusers ControlNet folder, or a single .safetensors (original or diffusers "
                        "layout)")
    parser.add_argument("--control", metavar="IMAGE", action="append", default=[],
                        help="the conditioning image (edges, a mask, ...) of every sample, with --controlnet; repeat "
                        "it once per prompt to give each prompt its own; the samples' size defaults to the first's")
    parser.add_argument("--control_scale", type=float, default=1.0, help="scale of the ControlNet's residuals "
                        "(default: %(default)s)")
    parser.add_argument("--export_controlnet", metavar="OUT", help="write the ControlNet (--controlnet, or --ckpt when "
                        "it is a ControlNet run): one file OUT, or with --controlnet_format diffusers a folder OUT")
    parser.add_argument("--controlnet_format", choices=sd.imagegen.CONTROLNET_FORMATS, default="original",
                        help="layout of --export_controlnet: original (control_model.* keys: ComfyUI, AUTOMATIC1111's "
                        "sd-webui-controlnet) or diffusers (a ControlNetModel folder) (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.ema_length is not None and not 0 < args.ema_length < 12 ** -0.5:
        parser.error(f"--ema_length: a relative length in (0, 0.2887), got {args.ema_length}")
    if args.ema_length is not None and args.no_ema:
        parser.error("--ema_length replaces the EMA by a rebuilt one; drop --no_ema")
    if args.best:
        try:
            args.ckpt = str(sd.run_folder.best_checkpoint(args.ckpt))
        except FileNotFoundError as error:
            parser.error(f"--best: {error}")
    prompts = list(args.prompt)
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.exists():
            parser.error(f"--prompts_file {path} does not exist")
        prompts += [line.strip() for line in path.read_text().splitlines() if line.strip()]
    exporting = (args.export_diffusers or args.export_single_file or args.export_lora or args.export_embedding
                 or args.export_controlnet)
    if not exporting and not prompts:
        parser.error("give --prompt (or --prompts_file) to sample, or an --export_* flag")
    if args.export_lora and args.lora_format == "diffusers" and args.export_lora.endswith(".safetensors"):
        parser.error("--export_lora with --lora_format diffusers is a folder: give it a name without .safetensors, "
                     "or leave out --lora_format for one kohya .safetensors file")
    if args.lora and not (prompts or args.export_diffusers or args.export_single_file):
        parser.error("--lora merges into the weights that are sampled or exported whole (--export_diffusers, "
                     "--export_single_file); --export_lora writes the --ckpt's own adapter alone")
    if args.embedding and (args.export_diffusers or args.export_single_file):
        parser.error("--embedding adds a token for sampling only; the full exports keep the model's vocabulary "
                     "(give the embedding file to the other tool beside the model)")
    for control in args.control:
        if not Path(control).is_file():
            parser.error(f"--control {control} is no file")
    if len(args.control) > 1 and len(args.control) != len(prompts):
        parser.error(f"{len(args.control)} --control images for {len(prompts)} prompts: give one for all, or one "
                     "per prompt in their order")
    if args.control_scale < 0 or not math.isfinite(args.control_scale):
        parser.error("--control_scale must be a number >= 0")
    try:
        loras = tuple(sd.imagegen.parse_lora_spec(spec) for spec in args.lora)
    except ValueError as error:
        parser.error(str(error))
    if any(side is not None and (side % 8 or side <= 0) for side in (args.height, args.width)):
        parser.error("--height and --width must be positive multiples of 8")
    if args.flow_shift is not None:
        try:
            sd.flow.check_shift(args.flow_shift, "--flow_shift")
        except ValueError as error:
            parser.error(str(error))
    if args.sampler == "auto":
        args.sampler = sd.imagegen.auto_sampler(args.ckpt, args.prediction_type)
    steps, cfg = sd.sampling.sampler_defaults(args.sampler, args.steps, args.cfg,
                                              sd.sampling.SAMPLER_STEPS[args.sampler], 7.5)
    for name, value in (("n", args.n), ("batch_size", args.batch_size)):
        if value < 1:
            parser.error(f"--{name} must be >= 1")
    if not 0 <= args.seed < 2**63:
        parser.error(f"--seed must be a whole number in [0, 2^63), got {args.seed}")
    problem = sd.sampling.settings_error(args.sampler, steps, cfg)
    if problem:
        parser.error(f"--sampler {args.sampler}, --steps {steps}, --cfg {cfg:g}: {problem}")
    fields = {f.name for f in dataclasses.fields(sd.imagegen.Request)}
    given = {name: value for name, value in vars(args).items() if name in fields}
    out = args.out or (str(sd.imagegen.default_out(args.ckpt)) if prompts else None)
    return sd.imagegen.Request(**{**given, "out": out, "prompt": tuple(prompts), "steps": steps, "cfg": cfg, "lora": loras,
                                  "embedding": tuple(sd.imagegen.parse_embedding_spec(s) for s in args.embedding),
                                  "control": tuple(args.control)})


def main(argv=None) -> int:
    sd.runtime.start_process()
    request = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        return run(request)
    except KeyboardInterrupt as stop:  # loading, exporting (atomic: no file half-written) or sampling
        written = stop.written if isinstance(stop, sd.imagegen.Interrupted) else 0
        said = f"{written} images written to {request.out}" if written else "no image was written"
        print(f"SD_ImageGen.py: interrupted (Ctrl-C); {said}", file=sys.stderr)
        return 128 + signal.SIGINT


def run(request: sd.imagegen.Request) -> int:
    try:
        request = sd.imagegen.controlnet_run_as_ckpt(request)
        model = sd.imagegen.load(request)
    except ERRORS as error:
        hint = " (or --allow_other_base to use it on this base)" if isinstance(error, sd.formats.BaseMismatch) else ""
        print(f"SD_ImageGen.py: cannot load {request.ckpt}: {sd.cli.first_line(error)}{hint}", file=sys.stderr)
        return 2
    try:
        request, controlnet = sd.imagegen.prepare(request, model)
    except ERRORS as error:
        print(f"SD_ImageGen.py: {sd.cli.first_line(error)}", file=sys.stderr)
        return 2
    if request.export_diffusers or request.export_single_file:
        sd.imagegen.export(request, model)
    if not request.prompt:
        return 0
    request = sd.imagegen.sized(request, model)
    try:
        controls = sd.imagegen.control_images(request, controlnet)
    except ValueError as error:
        print(f"SD_ImageGen.py: {sd.cli.first_line(error)}", file=sys.stderr)
        return 2
    sd.imagegen.sample(request, model, controlnet, controls)
    return 0

if __name__ == "__main__":
    sys.exit(main())
