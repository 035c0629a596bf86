"""Sample images from a trained SD 1.x model, and export it to the formats other tools load.

    python SD_ImageGen.py --ckpt PATH --prompt "..." [--negative "..."] [--steps 100] [--cfg 7.5]
                          [--seed 0] [--n 4] [--batch_size 4] [--sampler auto|ddim|dpm++|euler|lcm|onestep|flow_euler|flow_heun] [--no_ema]
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
it is the default (``--sampler auto``) for a run of ours trained with ``distill: lcm``. ``--sampler onestep``
samples a DMD generator (``distill: dmd``) in the steps it was trained for (1 to 4: from pure noise at
999, its image noised again for each further step) at ``--cfg 1``; it is the default for such a run and
for a single file exported from one (its header records ``generator_timesteps``). ``flow_euler`` is the default for
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

import logging
import signal
import sys

import sd.cli
import sd.imagegen
import sd.runtime


def parse_args(argv=None) -> sd.imagegen.Request:
    parser = sd.cli.ArgumentParser(description=__doc__)
    sd.imagegen.add_flags(parser)  # each piece declares the flags it reads
    return sd.imagegen.request_of(parser.parse_args(argv), parser.error)


def main(argv=None) -> int:
    sd.runtime.start_process()
    request = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        sd.imagegen.run(request)
    except sd.imagegen.CannotLoad as error:
        print(f"SD_ImageGen.py: {error}", file=sys.stderr)
        return 2
    except sd.imagegen.ERRORS as error:
        print(f"SD_ImageGen.py: {sd.cli.first_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # loading, exporting (atomic: no file half-written) or sampling
        written = stop.written if isinstance(stop, sd.imagegen.Interrupted) else 0
        said = f"{written} images written to {request.sampling.out}" if written else "no image was written"
        print(f"SD_ImageGen.py: interrupted (Ctrl-C); {said}", file=sys.stderr)
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
