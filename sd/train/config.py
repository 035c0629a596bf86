"""The training config: one dataclass, loaded from a phase YAML and overridden by ``--field value``.

Every field carries a one-line doc (it is the ``--help`` text). A YAML may name a base file with
``extends: base.yaml`` (relative to itself); its fields are read first and the YAML's own override
them, so the phase recipes share one base. Values are converted to the field's type; unknown fields,
abbreviated flags and bad values stop before any work with a message naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import sd.cli
import sd.flow
import sd.model
import sd.sampling
import sd.train.modes
import sd.train.objectives
from sd.cli import ConfigError, load_yaml
from sd.run_folder import read_saved_config


@dataclass(frozen=True)
class Range:
    """The values a numeric field allows: an interval with finite ends, so inf and nan never fit."""

    low: float
    high: float = math.inf
    low_open: bool = False  # low itself is out
    high_open: bool = True  # high itself is out

    def allows(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self, kind: str = "float") -> str:
        """``>= 1``, ``in [0, 1)``, ``> 0 and finite`` (a float with no upper end)."""
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}{' and finite' if kind == 'float' else ''}"
        return (f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                f"{')' if self.high_open else ']'}")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


POSITIVE, NON_NEGATIVE, COUNT = Range(0, low_open=True), Range(0), Range(1)
FRACTION, BELOW_ONE = Range(0, 1, high_open=False), Range(0, 1)


def _doc(text, default=dataclasses.MISSING, default_factory=dataclasses.MISSING, allowed: Range | None = None):
    """A field with its one-line doc; ``allowed``: the range of a numeric field (every int and float has one)."""
    metadata = {"help": text, "allowed": allowed}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class TrainConfig:
    """One phase's settings. Frozen: what resolves later (``batch_size: auto``, ``ema_warmup: auto``)
    is a new config made with ``dataclasses.replace``, so no part of the run sees a value change."""

    # -- data -------------------------------------------------------------------------------
    datasets: list = _doc("[{dataset: DIR, latents: DIR, weight: 1.0}, ...]: caption datasets "
                          "(05_build_hf_dataset.py) joined to latent folders (encode_latents.py), mixed by weight",
                          default_factory=list)
    epoch_size: int = _doc("samples per epoch across all datasets; 0 = every sample once", 0,
                           allowed=NON_NEGATIVE)
    data_threads: int = _doc("threads that read latent files into the page cache at start", 16, allowed=COUNT)
    mmap_latents: bool = _doc("read latent shards from storage on demand instead of reading them all once at "
                              "start (for latent sets larger than RAM)", False)
    allow_missing_latents: bool = _doc("drop captions without a latent (reported) instead of stopping", False)
    flip: bool = _doc("train each sample on the latents of its mirrored image with probability 1/2 (a coin "
                      "fixed by seed, epoch and position); needs latents from encode_latents.py --flip", False)
    masked_loss: bool = _doc("weight each sample's loss by its mask (photo_mask.png beside photo.jpg at import, "
                             "NNNNN.mask.npy from encode_latents.py): black pixels teach nothing, white ones in "
                             "full; samples without a mask weigh 1", False)
    shuffle_tags: float = _doc("tag captions: probability that a sample's tags after the first keep_tokens are "
                               "shuffled, drawn anew at every step; 0 = off (0.5: half the samples)", 0.0,
                               allowed=FRACTION)
    keep_tokens: int = _doc("tag captions: tags at the front of each caption that shuffle_tags and tag_dropout "
                            "leave in place", 0, allowed=NON_NEGATIVE)
    tag_dropout: float = _doc("tag captions: probability that each tag after the first keep_tokens is left out of "
                              "a sample's caption at a step; 0 = off", 0.0, allowed=FRACTION)
    tag_separator: str = _doc("tag captions: what joins the tags; captions are split on its non-blank part (on "
                              "blanks if it is blank)", ", ")
    # -- models -----------------------------------------------------------------------------
    unet: str = _doc("UNet preset: sd1, demo or tiny (with init_from a run of ours: that run's)", "sd1")
    vae: str = _doc("VAE hub id, local folder or tiny (used for validation images; with init_from a run of "
                    "ours: that run's)", sd.model.DEFAULT_VAE)
    text_encoder: str = _doc("CLIP text encoder hub id, local folder or tiny (with init_from a run of ours: that "
                             "run's)", sd.model.DEFAULT_TEXT_ENCODER)
    tokenizer: str = _doc("CLIP tokenizer; empty = the text encoder's (with init_from a run of ours: that run's)",
                          "")
    prediction_type: str = _doc("epsilon, v_prediction or flow (rectified flow: the UNet predicts the velocity "
                                "noise - image of the straight path between them; see docs/training.md)", "epsilon")
    flow_matching: bool = _doc("train an epsilon or v_prediction model (init_from) as a flow through the diff2flow "
                               "mapping: the first step starts from all it knows, and its files stay epsilon or v "
                               "models; sampled with flow_euler by default", False)
    reflow: bool = _doc("a flow model (prediction_type: flow, or flow_matching: true): train on the (noise, image) "
                        "pairs of SD_Reflow.py (each latent with "
                        "the noise it was drawn from: its folder's NNNNN.noise.npy) instead of fresh noise, which "
                        "straightens the model's paths for 1-2 step sampling", False)
    flow_density: str = _doc("flow: how the training sigmas (noise fractions) are drawn: logit_normal "
                             "(sigmoid of N(flow_logit_mean, flow_logit_std), SD3's) or uniform", "logit_normal")
    flow_logit_mean: float = _doc("flow, logit_normal: the mean (below 0: more training at low noise)", 0.0,
                                  allowed=Range(-10, 10, high_open=False))
    flow_logit_std: float = _doc("flow, logit_normal: the standard deviation", 1.0, allowed=Range(0, 10, low_open=True,
                                                                                                     high_open=False))
    flow_shift: float = _doc("flow: SD3's time shift of the training sigmas, shift s / (1 + (shift - 1) s) (above 1: "
                             "more at high noise), and the flow samplers' default; recorded in the files", 1.0,
                             allowed=Range(*sd.flow.SHIFT_RANGE, high_open=False))
    init_from: str = _doc("start from these weights (a checkpoint or run folder) with a fresh optimizer "
                          "and schedule; ignored when out_dir already holds a checkpoint to resume", "")
    # -- fine-tuning: LoRA, DreamBooth -------------------------------------------------------
    lora_rank: int = _doc("LoRA rank of the adapters trained instead of the full UNet; 0 = full fine-tuning. "
                          "Needs init_from (the base weights, which stay unchanged)", 0, allowed=NON_NEGATIVE)
    lora_alpha: float = _doc("LoRA alpha: the adapter's output is scaled by lora_alpha / lora_rank; 0 = lora_rank "
                             "(scale 1)", 0.0, allowed=NON_NEGATIVE)
    lora_dropout: float = _doc("dropout on the adapter's input during training", 0.0, allowed=BELOW_ONE)
    lora_targets: list = _doc("UNet layers that get an adapter: groups attention (q/k/v/out projections), "
                              "transformer (+ feed-forward and proj_in/out), resnet (the convolutions: LoCon), "
                              "or module-name suffixes such as to_q", default_factory=lambda: ["attention"])
    lora_conv_rank: int = _doc("LoRA rank of the convolutions with a kernel larger than 1x1 that lora_targets "
                               "selects (LoCon: the resnet group's 3x3 convolutions; kohya's conv_dim); the 1x1 "
                               "ones take lora_rank, as in kohya's files; 0 = lora_rank", 0, allowed=NON_NEGATIVE)
    lora_conv_alpha: float = _doc("LoRA alpha of those convolutions (kohya's conv_alpha); 0 = lora_alpha (and when "
                                  "that is 0 too, the convolutions' rank: scale 1)", 0.0, allowed=NON_NEGATIVE)
    lora_text_encoder: bool = _doc("also train a LoRA adapter on the text encoder's attention projections", False)
    lora_type: str = _doc("the adapter: lora (up @ down), loha (LyCORIS' Hadamard product of two low-rank products) "
                          "or lokr (LyCORIS' Kronecker product of a small and a low-rank factor); lora_rank, "
                          "lora_alpha and the conv settings apply to each; loha and lokr export in the kohya layout "
                          "only", "lora")
    lora_factor: int = _doc("lokr: how each layer's sides split between the two Kronecker factors, as LyCORIS "
                            "splits them: a divisor of a side gives it and the rest (the smaller first), else the "
                            "divisor nearest the square root and at most this; -1 = nearest the square root", -1,
                            allowed=Range(-1))
    dora: bool = _doc("DoRA: each adapted layer also trains a magnitude per input channel, its weight used as "
                      "(W + adapter) * magnitude / norm (the norm over each input channel's column); with any "
                      "lora_type; written as dora_scale (1, in), which ComfyUI, AUTOMATIC1111 and LyCORIS merge "
                      "alike; exports in the kohya layout only", False)
    embedding_token: str = _doc("textual inversion: learn this new token (a word not in the tokenizer, e.g. <my-cat>) "
                                "from prompts that use it; the UNet and text encoder stay frozen (with lora_rank > 0 a "
                                "LoRA trains beside it: pivotal tuning). Needs init_from", "")
    embedding_init: str = _doc("textual inversion: the word(s) whose embedding the new token starts from (e.g. cat)",
                               "")
    embedding_vectors: int = _doc("textual inversion: vectors of the new token (each takes one of the prompt's 75 "
                                  "token places)", 1, allowed=COUNT)
    embedding_lr: float = _doc("pivotal tuning (embedding_token with lora_rank > 0): the learned token's peak learning "
                               "rate, beside the LoRA's lr; 0 = lr", 0.0, allowed=NON_NEGATIVE)
    embedding_train_fraction: float = _doc("pivotal tuning: the fraction of the run's steps in which the token trains; "
                                           "after them it stays as learned while the LoRA goes on (0.5: the first "
                                           "half)", 1.0, allowed=Range(0, 1, low_open=True, high_open=False))
    instance_dir: str = _doc("a subject folder (DreamBooth; a LoRA's, a token's, a fine-tune's): images of the new "
                             "subject or style (replaces datasets)", "")
    instance_prompt: str = _doc("subject folder: the prompt of every instance image, e.g. 'a photo of sks dog'", "")
    class_dir: str = _doc("DreamBooth prior preservation: a folder of class images; the missing ones are generated "
                          "there by the base model from class_prompt", "")
    class_prompt: str = _doc("DreamBooth prior preservation: the prompt of the class images, e.g. 'a photo of dog'",
                             "")
    num_class_images: int = _doc("class images to use in all (and generate when class_dir has fewer; the "
                                 "DreamBooth paper's 200 per instance image is a ceiling); 0 = 100", 100,
                                 allowed=NON_NEGATIVE)
    image_size: int = _doc("subject folder: the instance and class images are centre-cropped and resized to this many "
                           "pixels square (a multiple of 8)", 512, allowed=Range(8))
    prior_loss_weight: float = _doc("weight of the class images' loss beside the instance loss", 1.0,
                                    allowed=NON_NEGATIVE)
    # -- distillation -------------------------------------------------------------------------
    distill: str = _doc("lcm: latent consistency distillation of init_from (the teacher) into a model that samples "
                        "in 1-8 steps (SD_ImageGen.py --sampler lcm); with lora_rank an LCM-LoRA, else the whole "
                        "UNet; empty = the usual diffusion loss", "")
    lcm_solver_steps: int = _doc("distill: DDIM solver steps over the teacher's 1000 timesteps (each a skip of 1000 / "
                                 "this)", 50, allowed=Range(1, 1000, high_open=False))
    lcm_guidance_min: float = _doc("distill: lowest classifier-free guidance scale of the teacher (drawn per sample "
                                   "between min and max; LCM's w is this - 1)", 3.0, allowed=Range(1, 30, high_open=False))
    lcm_guidance_max: float = _doc("distill: highest guidance scale of the teacher; = lcm_guidance_min for a fixed "
                                   "scale", 15.0, allowed=Range(1, 30, high_open=False))
    lcm_loss: str = _doc("distill: huber (pseudo-Huber, as LCM) or l2", "huber")
    lcm_huber_c: float = _doc("distill: the pseudo-Huber loss's c", 0.001, allowed=POSITIVE)
    lcm_timestep_scaling: float = _doc("distill: the boundary condition's timestep scaling (c_skip, c_out at 10 t)", 10.0,
                                       allowed=POSITIVE)
    lcm_target_decay: float = _doc("distill: EMA decay of the target network; 0 = the student itself (diffusers' "
                                   "LCM-LoRA script)", 0.95, allowed=BELOW_ONE)
    # -- ControlNet ---------------------------------------------------------------------------
    control: str = _doc("ControlNet: the name of the conditioning images it learns from (canny, seg, ...: the "
                        "latent folders' files from encode_latents.py --control NAME); init_from, the base, stays "
                        "frozen and the ControlNet alone trains; empty = no ControlNet", "")
    control_dropout: float = _doc("ControlNet: probability that a sample's conditioning image is blank (all zeros) "
                                  "in a step", 0.0, allowed=FRACTION)
    controlnet_from: str = _doc("ControlNet: train on from this ControlNet (a ControlNet run of ours, a diffusers "
                                "folder or a single file); empty = a new one, a copy of the base UNet's encoder with "
                                "zero convolutions out", "")
    validation_controls: list = _doc("ControlNet: the sample grid's conditioning images, one file per validation "
                                     "prompt", default_factory=list)
    cache_text_embeddings: bool = _doc("encode every distinct prompt of the run once at start (host memory: 77 x "
                                       "768 floats each) and keep the text encoder off the device; not with "
                                       "lora_text_encoder", False)
    # -- optimisation -----------------------------------------------------------------------
    batch_size: int = _doc("micro-batch size per GPU; auto (or 0): the largest that the GPU's memory holds, as "
                           "--estimate_memory predicts it (CUDA only; fixed for the run once chosen)", 24,
                           allowed=NON_NEGATIVE)
    grad_accum: int = _doc("micro-batches accumulated per optimizer step (replaced when global_batch is set)", 2,
                           allowed=COUNT)
    global_batch: int = _doc("images per optimizer step across every GPU, kept whatever the number of GPUs: "
                             "grad_accum becomes global_batch / (batch_size x GPUs), and a batch that cannot make "
                             "it exactly stops with the settings that can; 0 = batch_size x grad_accum x GPUs", 0,
                             allowed=NON_NEGATIVE)
    max_steps: int = _doc("optimizer steps of the phase; 0 = run `epochs` epochs", 0, allowed=NON_NEGATIVE)
    epochs: int = _doc("epochs of the phase when max_steps is 0", 1, allowed=NON_NEGATIVE)
    lr: float = _doc("peak learning rate", 1e-5, allowed=POSITIVE)
    warmup_steps: int = _doc("linear warm-up steps from lr * 0.01 to lr (adamw_schedulefree: from lr / warmup_steps)",
                             500, allowed=NON_NEGATIVE)
    text_encoder_lr: float = _doc("peak learning rate of the text encoder's LoRA adapter (lora_text_encoder), its own "
                                  "parameter group; 0 = lr", 0.0, allowed=NON_NEGATIVE)
    text_encoder_warmup_steps: int = _doc("warm-up steps of the text encoder's adapter; -1 = warmup_steps", -1,
                                          allowed=Range(-1))
    down_lr_scale: float = _doc("the UNet's down blocks (their weights, or the LoRA adapters in them) train at lr x "
                                "this, in a parameter group of their own", 1.0, allowed=POSITIVE)
    mid_lr_scale: float = _doc("the UNet's middle block at lr x this", 1.0, allowed=POSITIVE)
    up_lr_scale: float = _doc("the UNet's up blocks at lr x this (the rest of the UNet: conv_in, the time embedding "
                              "and the output layers train at lr)", 1.0, allowed=POSITIVE)
    min_lr_ratio: float = _doc("cosine decay ends at lr * min_lr_ratio", 0.01, allowed=FRACTION)
    weight_decay: float = _doc("AdamW weight decay", 1e-2, allowed=NON_NEGATIVE)
    adam_beta1: float = _doc("AdamW beta1", 0.9, allowed=BELOW_ONE)
    adam_beta2: float = _doc("AdamW beta2", 0.999, allowed=BELOW_ONE)
    adam_eps: float = _doc("AdamW epsilon", 1e-8, allowed=POSITIVE)
    optimizer: str = _doc("adamw (fused or foreach, fp32 state: 8 bytes a parameter), adamw8bit (bitsandbytes' "
                          "8-bit state: 2 bytes), prodigy (Prodigy: estimates its own step size, which lr multiplies: set lr "
                          "1.0; 16 bytes) or adamw_schedulefree (Schedule-Free AdamW: no decay after the warm-up, weights "
                          "averaged instead; 8 bytes); see docs/training.md", "adamw")
    noise_offset: float = _doc("add noise_offset * N(0, 1) per sample and channel to the training noise (lets "
                               "the model learn very dark and very bright images); 0 = off", 0.0,
                               allowed=NON_NEGATIVE)
    zero_terminal_snr: bool = _doc("rescale the noise schedule so the last timestep is pure noise (needs "
                                   "prediction_type v_prediction); samplers then space timesteps 'trailing'", False)
    grad_clip: float = _doc("clip the global gradient norm to this; 0 = no clipping", 1.0,
                            allowed=NON_NEGATIVE)
    min_snr_gamma: float = _doc("Min-SNR-gamma loss weighting; 0 = none", 5.0, allowed=NON_NEGATIVE)
    loss_type: str = _doc("the loss of each latent element: l2 (squared error), l1, huber (pseudo-Huber: about "
                          "l2 for small errors, linear for large ones) or smooth_l1 (the same without the factor c), "
                          "as kohya's sd-scripts --loss_type", "l2")
    huber_schedule: str = _doc("huber and smooth_l1: how c follows the timestep: snr (near 1 at low noise, "
                               "huber_c at high noise), exponential (huber_scale at t=0 to huber_c x huber_scale at "
                               "t=1000) or constant (huber_c x huber_scale)", "snr")
    huber_c: float = _doc("huber and smooth_l1: the c of the schedule", 0.1, allowed=Range(0, 1, low_open=True))
    huber_scale: float = _doc("huber and smooth_l1: the scale of the exponential and constant schedules", 1.0,
                              allowed=POSITIVE)
    debiased_estimation: bool = _doc("weight each sample's loss by 1/sqrt(SNR) (1/(SNR+1) predicting v), debiased "
                                     "estimation as kohya's sd-scripts applies it, after Min-SNR", False)
    cfg_dropout: float = _doc("fraction of samples trained with the empty prompt (for classifier-free guidance)", 0.05,
                              allowed=BELOW_ONE)
    ema_decay: float = _doc("EMA decay; 0 = no EMA", 0.9999, allowed=BELOW_ONE)
    ema_device: str = _doc("where the EMA lives: same (the training device) or cpu", "same")
    ema_update_every: int = _doc("update the EMA every N optimizer steps (decay raised to the N-th power); auto "
                                 "(or 0): 10 for a whole UNet's EMA in host memory of a GPU run (each update copies "
                                 "3.4 GB off the GPU), else 1", 0, allowed=NON_NEGATIVE)
    posthoc_ema_every: int = _doc("post-hoc EMA (Karras et al. 2024): keep two power-function EMAs of what trains "
                                  "(in the UNet, and a text adapter or learned token beside it; sigma_rel 0.05 and "
                                  "0.10, where ema_device says, updated every step) "
                                  "and write both to OUT_DIR/posthoc_ema/ every N optimizer steps (fp16), from which "
                                  "SD_ImageGen.py --ema_length rebuilds an EMA of any length; 0 = off", 0,
                                  allowed=NON_NEGATIVE)
    ema_warmup: str = _doc("EMA decay warm-up: restart (min(ema_decay, (1+t)/(10+t)) from this run's step 0), "
                           "off (the full ema_decay from the first step, so an inherited EMA keeps its weight), or "
                           "auto (off when init_from brings an EMA of ours, else restart; config.yaml records which)",
                           "auto")
    precision: str = _doc("bf16 (autocast), fp16 (autocast + GradScaler) or fp32", "bf16")
    bf16_weights: bool = _doc("precision bf16, full fine-tuning: keep the UNet's weights and gradients in bf16 (no "
                              "per-step casts under autocast) with fp32 master weights in AdamW and the EMA "
                              "(MLPerf's recipe); checkpoints hold the masters. A speed lever not yet measured on "
                              "a GPU", False)
    grad_checkpointing: bool = _doc("recompute activations in backward to save memory", True)
    channels_last: bool = _doc("channels_last memory format for the UNet", False)
    compile: bool = _doc("torch.compile the UNet (works with grad_checkpointing)", False)
    compile_mode: str = _doc("torch.compile mode with compile: default, max-autotune-no-cudagraphs (searches "
                             "kernel choices at start), reduce-overhead (CUDA graphs: replays each micro-batch's "
                             "kernels without launching them one by one) or max-autotune (both); "
                             "bench/train_throughput.py --compile_modes measures them on a GPU", "default")
    attention: str = _doc("attention kernels of the training step on a GPU: auto (flash, else memory-efficient), "
                          "cudnn (cuDNN's fused attention first, then as auto), flash, efficient, or math (the full "
                          "attention matrix: slow, for checks); ignored on a CPU", "auto")
    max_bad_steps: int = _doc("stop after this many non-finite steps in a row", 10, allowed=COUNT)
    sharding: str = _doc("how a full fine-tune spreads over several GPUs: none (DDP: every GPU holds the weights, "
                         "gradients and optimizer state), zero1 (DDP, the AdamW state split across the GPUs) or "
                         "fsdp (FSDP2: weights, gradients, AdamW state and EMA split); not with lora_rank", "none")
    fsdp_reduce_each_micro_batch: bool = _doc("sharding: fsdp with grad_accum above 1: reduce-scatter the gradients "
                                              "after every micro-batch, so they accumulate split across the GPUs "
                                              "(at SD 1.x size 3.44 GB less per GPU than whole gradients kept until "
                                              "the last micro-batch), for a reduce-scatter per micro-batch instead "
                                              "of one per step", False)
    # -- checkpoints and logging ------------------------------------------------------------
    out_dir: str = _doc("run folder: config.yaml, metrics.jsonl, samples/, checkpoints/", "runs/train")
    save_steps: int = _doc("save a checkpoint every N optimizer steps (and at the end of the run)", 1500,
                           allowed=COUNT)
    save_every_epoch: bool = _doc("also save at the end of each epoch", False)
    keep_checkpoints: int = _doc("keep the newest N checkpoints (at least 2: the newest may be mid-write when a "
                                "run dies)", 3, allowed=Range(2))
    keep_every_steps: int = _doc("also keep every checkpoint whose step is a multiple of this; 0 = none", 0,
                                 allowed=NON_NEGATIVE)
    keep_best: str = _doc("with eval_every: fid (lowest) or clip_score (highest): each evaluation that beats the "
                          "best so far saves its step's checkpoint, which pruning then keeps until a better one "
                          "comes; OUT_DIR/best.json names it (SD_ImageGen.py --ckpt OUT_DIR --best); empty = off", "")
    stop_at_step: int = _doc("end after this optimizer step as an interruption would (save, exit 0); 0 = off", 0,
                             allowed=NON_NEGATIVE)
    log_every: int = _doc("log metrics every N optimizer steps (the step statistics are read from the device then, not every step)", 10, allowed=COUNT)
    validate_every: int = _doc("validation loss and sample grid every N optimizer steps and at the last; 0 = never",
                               1000, allowed=NON_NEGATIVE)
    validation_prompts: list = _doc("prompts of the validation sample grid",
                                    default_factory=lambda: ["a photograph of an astronaut riding a horse"])
    validation_data_captions: int = _doc("captions of the training data (drawn with seed, the same all run) sampled "
                                         "in the grid after validation_prompts: the model's progress on its own "
                                         "data; not with control, whose prompts take images; 0 = none", 4,
                                         allowed=NON_NEGATIVE)
    validation_samples: int = _doc("held-out samples used for the validation loss", 256, allowed=COUNT)
    validation_steps: int = _doc("DDIM steps of the validation samples", 50, allowed=COUNT)
    validation_cfg: float = _doc("classifier-free guidance scale of the validation samples", 7.5,
                                 allowed=NON_NEGATIVE)
    validation_sampler: str = _doc("sampler of the validation samples: auto (flow_euler for a flow run, ddim "
                                   "otherwise), ddim, dpm++, euler, lcm (a distill: lcm run: e.g. 4 validation_steps "
                                   "at validation_cfg 1), flow_euler or flow_heun", "auto")
    validation_width: int = _doc("width of the validation samples in pixels, a multiple of 8; 0 = the training "
                                 "latents' size (with aspect-ratio buckets: the bucket nearest square)", 0,
                                 allowed=NON_NEGATIVE)
    validation_height: int = _doc("height of the validation samples in pixels, a multiple of 8; 0 = as "
                                  "validation_width's default", 0, allowed=NON_NEGATIVE)
    eval_every: int = _doc("FID and CLIP score (SD_Eval.py) of the EMA weights every N optimizer steps and at the "
                           "last, logged to "
                           "metrics.jsonl as eval_fid / eval_clip_score; 0 = never", 0, allowed=NON_NEGATIVE)
    eval_prompts: str = _doc("prompts of the evaluation: a text file (one per line) or a .tsv/.csv with a caption "
                             "column; image i uses seed + i", "")
    eval_n: int = _doc("evaluate on the first N of eval_prompts (one image each)", 500, allowed=COUNT)
    eval_reference: str = _doc("reference of the FID: a folder of images (statistics cached in it) or an .npz "
                               "(mu, sigma) computed with the same eval_features", "")
    eval_features: str = _doc("FID network: inception (torch-fidelity's InceptionV3, needs torch-fidelity) or tiny "
                              "(offline stand-ins)", "inception")
    eval_clip_model: str = _doc("CLIP of the CLIP score (hub id or folder; empty = no CLIP score); the stand-in "
                                "with eval_features tiny", "openai/clip-vit-large-patch14")
    eval_batch_size: int = _doc("images per generation and feature batch of the evaluation", 16, allowed=COUNT)
    wandb_project: str = _doc("wandb project name", "sd1-train")
    wandb_mode: str = _doc("wandb: online, offline or disabled (API key from the environment)", "disabled")
    tensorboard: str = _doc("the metrics and sample grids as TensorBoard events in OUT_DIR/tensorboard (view with "
                            "tensorboard --logdir OUT_DIR): auto (when wandb_mode is disabled), true or false", "auto")
    # -- run --------------------------------------------------------------------------------
    seed: int = _doc("seed of the model init, data order and diffusion noise", 0,
                     allowed=Range(0, 2**32 - 1, high_open=False))
    device: str = _doc("auto, cpu, cuda", "auto")

    @property
    def flow(self) -> bool:
        """Trained as a flow: a flow model, or an epsilon or v model through the diff2flow bridge."""
        return self.prediction_type == "flow" or self.flow_matching

    @property
    def sampler(self) -> str:
        """``validation_sampler`` with ``auto`` resolved."""
        if self.validation_sampler != "auto":
            return self.validation_sampler
        return sd.sampling.default_sampler(self.prediction_type, self.flow_matching)

    def validate(self, check_paths: bool = True) -> None:
        """Reject bad values before any work, naming the field, the value and what is allowed.
        ``check_paths=False`` leaves the data folders and ``init_from`` unchecked (a memory estimate
        reads neither)."""
        def need(ok, message):
            if not ok:
                raise ConfigError(message)

        for name, f in FIELDS.items():
            check_type_and_range(name, getattr(self, name), f)
        if check_paths:
            need(self.datasets or self.instance_dir,
                 "datasets: list at least one {dataset: DIR, latents: DIR, weight: 1.0} (or set instance_dir)")
            need(not (self.datasets and self.instance_dir), "instance_dir replaces datasets: set one of them")
            for name in ("instance_dir", "class_dir"):
                need(not getattr(self, name) or Path(getattr(self, name)).is_dir() or name == "class_dir",
                     f"{name}: folder {getattr(self, name)} does not exist")
            for i, entry in enumerate(self.datasets):
                check_dataset_entry(i, entry)
        need(self.unet in sd.model.UNET_PRESETS, f"unet: choose one of {sorted(sd.model.UNET_PRESETS)}")
        need(self.prediction_type in sd.model.PREDICTION_TYPES,
             f"prediction_type: one of {', '.join(sd.model.PREDICTION_TYPES)}")
        need(self.precision in ("bf16", "fp16", "fp32"), "precision: bf16, fp16 or fp32")
        need(self.ema_device in ("same", "cpu"), "ema_device: same or cpu")
        need(self.compile_mode in COMPILE_MODES, f"compile_mode: one of {', '.join(COMPILE_MODES)}")
        need(self.loss_type in sd.model.LOSS_TYPES, f"loss_type: one of {', '.join(sd.model.LOSS_TYPES)}")
        need(self.huber_schedule in sd.model.HUBER_SCHEDULES,
             f"huber_schedule: one of {', '.join(sd.model.HUBER_SCHEDULES)}")
        need(self.attention in sd.model.ATTENTION_CHOICES, f"attention: one of {', '.join(sd.model.ATTENTION_CHOICES)}")
        need(self.ema_warmup in ("auto", "restart", "off"), "ema_warmup: auto, restart or off")
        need(self.wandb_mode in ("online", "offline", "disabled"), "wandb_mode: online, offline or disabled")
        need(self.tensorboard.lower() in ("auto", "true", "false"), "tensorboard: auto, true or false")
        need(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"), "device: auto, cpu or cuda")
        for name in ("vae", "text_encoder", "out_dir"):
            need(getattr(self, name).strip(), f"{name} must not be empty")
        need(all(isinstance(p, str) for p in self.validation_prompts), "validation_prompts: a list of strings")
        need(self.max_steps > 0 or self.epochs > 0, "set max_steps or epochs to a positive number")
        need(self.optimizer in OPTIMIZERS, f"optimizer: one of {', '.join(OPTIMIZERS)}")
        check_learning_rates(self)
        need(not self.instance_dir or self.instance_prompt.strip(), "instance_dir needs an instance_prompt")
        sd.train.modes.check(self, check_paths)
        check_sharding(self)
        check_bf16_weights(self)
        check_posthoc_ema(self)
        need(not (self.cache_text_embeddings and sd.train.modes.mode_of(self).text_encoder_trains),
             "cache_text_embeddings needs a frozen text encoder: turn off lora_text_encoder or the cache")
        sd.train.objectives.check(self, check_paths)
        sampling = sd.sampling.settings_error(self.sampler, self.validation_steps, self.validation_cfg)
        need(sampling is None, f"validation_sampler {self.validation_sampler}, validation_steps "
             f"{self.validation_steps}, validation_cfg {self.validation_cfg:g} (the validation grid's and the "
             f"evaluation's sampling): {sampling}")
        classes = sd.sampling.settings_error("ddim", self.validation_steps, self.validation_cfg) if self.class_dir else None
        need(classes is None, f"validation_steps {self.validation_steps} (DDIM steps of the class images of "
             f"class_dir): {classes}")
        need(self.image_size % 8 == 0, f"image_size must be a multiple of 8, got {self.image_size}")
        need(self.validation_width % 8 == 0 and self.validation_height % 8 == 0
             and bool(self.validation_width) == bool(self.validation_height),
             f"validation_width and validation_height: both multiples of 8, or both 0 (got "
             f"{self.validation_width}x{self.validation_height})")
        need(not (self.instance_dir and self.masked_loss), "masked_loss needs masks carried by encode_latents.py "
             "(pipeline/01e_import_folder.py reads photo_mask.png beside photo.jpg); instance_dir has none: "
             "set masked_loss: false, or import and encode the images as a dataset")
        need(not (self.instance_dir and self.flip), "flip needs latents of mirrored images from encode_latents.py; "
             "with instance_dir add mirrored copies to the folder instead")
        check_caption_ops(self)
        need(bool(self.class_dir) == bool(self.class_prompt.strip()),
             "prior preservation needs both class_dir and class_prompt (or neither)")
        need(not self.class_dir or self.instance_dir, "class_dir (prior preservation) needs instance_dir")
        need(self.eval_features in ("inception", "tiny"), "eval_features: inception or tiny")
        need(self.keep_best in KEEP_BEST, f"keep_best: {', '.join(repr(m) for m in KEEP_BEST)}, got {self.keep_best!r}")
        need(not self.keep_best or self.eval_every, f"keep_best: {self.keep_best} ranks the checkpoints by the "
             "in-training evaluation: set eval_every (with eval_prompts and eval_reference), or keep_best: ''")
        need(self.keep_best != "clip_score" or self.eval_clip_model, "keep_best: clip_score needs the CLIP score: "
             "set eval_clip_model, or keep_best: fid")
        need(not self.eval_every or (self.eval_prompts and self.eval_reference),
             "eval_every > 0 needs eval_prompts (a prompts file) and eval_reference (a folder of images or an .npz)")
        for name in ("eval_prompts", "eval_reference"):
            need(not check_paths or not self.eval_every or Path(getattr(self, name)).exists(),
                 f"{name}: {getattr(self, name)} does not exist")
        conflict = sd.model.schedule_conflict(self.prediction_type, self.zero_terminal_snr)
        need(conflict is None, f"zero_terminal_snr: {conflict}; set prediction_type: v_prediction")
        need(not check_paths or not self.init_from or Path(self.init_from).exists()
             or sd.cli.looks_like_hub_id(self.init_from),
             f"init_from: {self.init_from} is neither an existing path nor a hub id (owner/name)")


OPTIMIZERS = ("adamw", "adamw8bit", "prodigy", "adamw_schedulefree")
KEEP_BEST = ("", "fid", "clip_score")
BLOCK_LR_SCALES = ("down_lr_scale", "mid_lr_scale", "up_lr_scale")  # the UNet blocks' (sd.train.step.BLOCK_SCALES)
PRODIGY_LR = (0.1, 10.0)  # lr scales Prodigy's own estimate: far outside this, it was meant for another optimizer


def check_learning_rates(config: TrainConfig) -> None:
    """The text encoder's learning rate and warm-up need its adapter, the UNet blocks' scales a UNet that
    trains; Prodigy's lr is a multiplier near 1, the same for every parameter group (its one step-size
    estimate is shared by them)."""
    own_schedule = config.text_encoder_lr or config.text_encoder_warmup_steps >= 0
    mode = sd.train.modes.mode_of(config)
    if own_schedule and not mode.text_encoder_trains:
        raise ConfigError("text_encoder_lr / text_encoder_warmup_steps set the learning rate of the text encoder's "
                          "LoRA adapter: set lora_text_encoder: true (and lora_rank), or leave them at 0 / -1")
    scaled = [name for name in BLOCK_LR_SCALES if getattr(config, name) != 1]
    if scaled and not mode.unet_blocks_train:
        raise ConfigError(f"{', '.join(scaled)} scale the learning rate of the UNet's blocks, which a {mode.what} "
                          f"run leaves frozen: set {' and '.join(scaled)} to 1")
    if config.optimizer == "adamw_schedulefree" and config.adam_beta1 == 0:
        raise ConfigError("optimizer: adamw_schedulefree interpolates with adam_beta1 (its model is an average "
                          "reached through 1 / beta1): set adam_beta1 above 0, e.g. 0.9")
    if config.optimizer != "prodigy":
        return
    low, high = PRODIGY_LR
    if not low <= config.lr <= high:
        raise ConfigError(f"optimizer: prodigy estimates the step size itself and lr multiplies it: set lr: 1.0 (got "
                          f"{config.lr:g}; {low:g} to {high:g} to scale the estimate, which Prodigy's authors advise "
                          "against)")
    if own_schedule and (config.text_encoder_lr not in (0, config.lr)
                         or config.text_encoder_warmup_steps not in (-1, config.warmup_steps)):
        raise ConfigError("optimizer: prodigy steps every parameter group with one learning rate: leave "
                          "text_encoder_lr at 0 and text_encoder_warmup_steps at -1, or use optimizer adamw")
    if scaled:
        raise ConfigError(f"optimizer: prodigy steps every parameter group with one learning rate: set "
                          f"{' and '.join(scaled)} to 1, or use optimizer adamw")
    own = mode.own_learning_rates()
    if own:
        raise ConfigError(f"optimizer: prodigy steps every parameter group with one learning rate: leave "
                          f"{' and '.join(own)}, or use optimizer adamw")


SHARDINGS = ("none", "zero1", "fsdp")


def check_sharding(config: TrainConfig) -> None:
    """``sharding`` and the settings it cannot run with, each refused with the way out."""
    name = config.sharding
    if name not in SHARDINGS:
        raise ConfigError(f"sharding: none, zero1 or fsdp, got {name!r}")
    if config.fsdp_reduce_each_micro_batch and name != "fsdp":
        raise ConfigError(f"fsdp_reduce_each_micro_batch: applies to sharding: fsdp (got sharding: {name}); set it "
                          "false, or sharding: fsdp")
    if name == "none":
        return
    if config.optimizer != "adamw":
        raise ConfigError(f"sharding: {name} splits torch's AdamW state; set optimizer: adamw (adamw8bit's state is "
                          "already a quarter of the size; prodigy and adamw_schedulefree run unsharded), or sharding: "
                          "none")
    if name == "fsdp" and config.precision == "fp16":
        raise ConfigError("sharding: fsdp runs precision bf16 or fp32 (fp16's loss scaler is not sharded); set "
                          "precision: bf16, or sharding: zero1")
    if name == "fsdp" and config.channels_last:
        raise ConfigError("sharding: fsdp needs contiguous weights (FSDP2 refuses channels_last convolution "
                          "weights); set channels_last: false, or sharding: zero1")
    if name == "fsdp" and config.eval_every:
        raise ConfigError("sharding: fsdp does not run the in-training evaluation; set eval_every: 0 and score the "
                          "checkpoints with SD_Eval.py, or use sharding: zero1")


def check_bf16_weights(config: TrainConfig) -> None:
    """``bf16_weights`` and the settings it does not run with, each refused with the way out."""
    if not config.bf16_weights:
        return
    mode, objective = sd.train.modes.mode_of(config), sd.train.objectives.objective_of(config)
    others = [(config.precision != "bf16", f"precision: bf16 (got {config.precision})"),
              (config.optimizer != "adamw", f"optimizer: adamw (got {config.optimizer})"),
              (config.sharding != "none", f"sharding: none (got {config.sharding})"),
              (not mode.whole_unet, f"full fine-tuning (not a {mode.what} run: its base is frozen in bf16 already)"),
              (objective.uses_base, f"no {objective.what} (its frozen reference)")]
    needs = [what for failed, what in others if failed]
    if needs:
        raise ConfigError(f"bf16_weights: runs with {', '.join(needs)}; set those, or bf16_weights: false")


def check_posthoc_ema(config: TrainConfig) -> None:
    """``posthoc_ema_every`` and the runs it cannot keep its EMAs in, each refused with the way out."""
    if not config.posthoc_ema_every:
        return
    if config.sharding == "fsdp":
        raise ConfigError("posthoc_ema_every: the post-hoc EMAs hold whole weights, which sharding: fsdp splits; set "
                          "sharding: zero1 or none, or posthoc_ema_every: 0")
    mode = sd.train.modes.mode_of(config)
    if not mode.unet_trains:
        raise ConfigError(f"posthoc_ema_every: averages what trains in the UNet, which a {mode.what}'s run leaves "
                          "frozen; set posthoc_ema_every: 0")


def check_caption_ops(config: TrainConfig) -> None:
    """``shuffle_tags`` / ``tag_dropout`` and the settings they cannot run with, each refused with the way out."""
    if config.tag_separator == "":
        raise ConfigError("tag_separator must not be empty; use ', ' (tags joined by commas) or ' ' (by blanks)")
    if not (config.shuffle_tags or config.tag_dropout):
        return
    on = "shuffle_tags" if config.shuffle_tags else "tag_dropout"
    if config.instance_dir:
        raise ConfigError(f"{on} changes dataset captions at each step; a DreamBooth run (instance_dir) has one "
                          "fixed instance_prompt: set shuffle_tags: 0 and tag_dropout: 0, or train on datasets")
    if config.cache_text_embeddings:
        raise ConfigError(f"{on} makes a new prompt at each step, so the prompts are no fixed set whose embeddings "
                          "could be cached: set cache_text_embeddings: false, or shuffle_tags: 0 and tag_dropout: 0")


TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str, "list": list}


def check_type_and_range(name: str, value, f: dataclasses.Field) -> None:
    """A field's value has the field's type and, for a number, lies in its ``allowed`` range."""
    if isinstance(value, bool) and f.type != "bool" or not isinstance(value, TYPES[f.type]):
        raise ConfigError(f"{name}: expected {f.type}, got {value!r}")
    allowed = f.metadata["allowed"]
    if allowed is not None and not allowed.allows(value):
        raise ConfigError(f"{name} must be {allowed.describe(f.type)}, got {value!r} ({f.metadata['help']})")


def check_dataset_entry(i: int, entry) -> None:
    """One ``{dataset: DIR, latents: DIR, weight: W}``: known keys, existing folders, a finite weight > 0."""
    if not isinstance(entry, dict):
        raise ConfigError(f"datasets[{i}]: expected a mapping with dataset, latents, weight")
    unknown = set(entry) - {"dataset", "latents", "weight"}
    if unknown:
        raise ConfigError(f"datasets[{i}]: unknown keys {sorted(unknown)} (allowed: dataset, latents, weight)")
    for key in ("dataset", "latents"):
        if key not in entry:
            raise ConfigError(f"datasets[{i}].{key} is missing")
        if not Path(str(entry[key])).is_dir():
            raise ConfigError(f"datasets[{i}].{key}: folder {entry[key]} does not exist")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, str):  # YAML reads 1e-3 (no dot) as a string
        try:
            weight = float(weight)
        except ValueError:
            pass
    if not POSITIVE.allows(weight):
        raise ConfigError(f"datasets[{i}].weight must be {POSITIVE.describe()}, got {entry.get('weight')!r} "
                          "(the share of each epoch drawn from this dataset, relative to the others)")


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


AUTO_BATCH = 0  # batch_size: auto
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
AUTO_COUNTS = ("batch_size", "ema_update_every")  # counts whose 0 is spelled auto


def _coerce(name: str, value):
    """Convert a YAML or command-line value to the field's type, or say what was expected."""
    kind = FIELDS[name].type
    if name in AUTO_COUNTS and isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO_BATCH
    if kind == "bool":
        try:
            return sd.cli.parse_bool(value)
        except Exception:
            pass
    elif kind in ("int", "float"):
        if isinstance(value, str):  # YAML reads 1e-6 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if kind == "float":
                return float(value)
            if float(value).is_integer():
                return int(value)
    elif kind == "str":
        return "" if value is None else str(value)
    elif kind == "list":
        if isinstance(value, str):
            try:
                value = load_yaml(value)
            except ValueError as error:
                raise ConfigError(f"{name}: {error}") from None
        if isinstance(value, list):
            return value
        if isinstance(value, (str, dict)):
            return [value]
    raise ConfigError(f"{name}: expected {kind}, got {value!r}")


def _unknown_field(name: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(name, FIELDS, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config field '{name}' in {where}{hint}")


class _Parser(sd.cli.ArgumentParser):
    """Unknown or malformed flags become ConfigErrors, reported like every other config mistake."""

    def error(self, message):
        raise ConfigError(message)


def build_parser(description: str = "") -> sd.cli.ArgumentParser:
    """``--config`` plus one flag per field; a bool field also works as a bare flag (``--compile``)."""
    parser = _Parser(description=description)
    parser.add_argument("--config", action="append", metavar="YAML",
                        help="phase YAML; flags override its fields. Given again, each later file overrides the "
                             "earlier ones' fields (a card's recipe over a phase: --config "
                             "configs/phases/p1_laion_broad.yaml --config configs/hardware/24gb.yaml)")
    for name, f in FIELDS.items():
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        extra = {"nargs": "?", "const": "true"} if f.type == "bool" else {}
        allowed = f"; allowed: {f.metadata['allowed'].describe(f.type)}" if f.metadata["allowed"] else ""
        parser.add_argument(f"--{name}", metavar="VALUE", help=f"{f.metadata['help']} (default: {default!r}{allowed})",
                            **extra)
    estimate = parser.add_argument_group("memory estimate (no training, no data, no GPU needed)")
    estimate.add_argument("--estimate_memory", nargs="?", const="true", default="false", metavar="BOOL",
                          help="print the predicted peak device memory of one training step of this config, "
                               "broken down, and the largest micro-batch that fits --gpu_memory_gb; ends with "
                               "one JSON line (peak_gb, max_batch, ...)")
    estimate.add_argument("--gpu_memory_gb", type=float, default=None, metavar="GB",
                          help="the card's memory in GB (1e9 bytes) for --estimate_memory (default: this "
                               "machine's CUDA device, else 24 GiB = 25.77)")
    estimate.add_argument("--resolution", type=int, default=None, metavar="PX",
                          help="image size for --estimate_memory (default: the first dataset's latents, else 512)")
    estimate.add_argument("--world_size", default=None, metavar="N",
                          help="GPUs of the run for --estimate_memory: above 1, each GPU's step in DDP (the "
                               "gradients in DDP's buckets, global_batch split over N GPUs) (default: the "
                               "WORLD_SIZE environment variable as torchrun sets it, else 1)")
    return parser


def check_models(config: TrainConfig, unet, text_encoder) -> None:
    """The models fit together and the config before any work: the text encoder's width is the UNet's
    cross-attention width, and the mode's own checks (``Mode.check_models``: every LoRA target selects a
    layer). A ConfigError names both."""
    width, wanted = text_encoder.config.hidden_size, unet.config.cross_attention_dim
    if width != wanted:
        raise ConfigError(f"text_encoder {config.text_encoder} gives {width}-wide embeddings, but unet {config.unet} "
                          f"attends to {wanted}-wide ones; use a text encoder of width {wanted} (SD 1.x: CLIP "
                          "ViT-L/14, 768) or the UNet made for this one")
    sd.train.modes.mode_of(config).check_models(unet, text_encoder)


def read_yaml(path: Path, seen: tuple = ()) -> dict:
    """A config YAML's fields, its ``extends`` chain resolved (the file's own fields win)."""
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'extends' loops back to itself")
    try:
        loaded = load_yaml(path.read_text()) or {}
    except ValueError as error:
        raise ConfigError(f"{path}: {error}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of config fields")
    values = {}
    base = loaded.pop("extends", None)
    if base is not None:
        values.update(read_yaml(path.parent / str(base), seen + (path.resolve(),)))
    for name, value in loaded.items():
        if name not in FIELDS:
            raise _unknown_field(name, str(path))
        values[name] = _coerce(name, value)
    return values


def load_config(argv=None, description: str = "", check_paths: bool = True) -> TrainConfig:
    """YAML from ``--config`` (each with its ``extends``; several: later over earlier), then ``--field value``
    overrides; validated
    (``check_paths``: see ``TrainConfig.validate``)."""
    args, unknown = build_parser(description).parse_known_args(argv)
    if unknown:
        flag = next((u for u in unknown if u.startswith("--")), unknown[0])
        raise _unknown_field(flag.lstrip("-").split("=")[0], "the command line")
    overrides = {name: getattr(args, name) for name in FIELDS if getattr(args, name) is not None}
    return make_config(config_values(args.config or [], overrides), check_paths)


def config_values(configs: list, overrides: dict, where: str = "the command line") -> dict:
    """The fields of the YAML files ``configs`` (later over earlier), then ``overrides`` (field -> value as
    written after ``--field``), each as its field's type: what ``load_config`` reads, for a caller that holds
    the parts rather than a command line (the studio). An unknown field is a ConfigError naming ``where``."""
    values = {}
    for path in configs:
        values.update(read_yaml(Path(path)))
    for name, raw in overrides.items():
        if name not in FIELDS:
            raise _unknown_field(name, where)
        values[name] = _coerce(name, raw)
    return values


def make_config(values: dict, check_paths: bool = True) -> TrainConfig:
    """The validated config of ``values`` (``config_values``), with what ``init_from``'s run was built with."""
    config = TrainConfig(**inherit_model(values))
    config.validate(check_paths)
    return config


# What a run's weights were built with: a run started from them (init_from) takes these from its
# config.yaml unless its own config names them.
INHERITED = ("unet", "vae", "text_encoder", "tokenizer")


def inherit_model(values: dict) -> dict:
    """``values`` with the INHERITED fields that ``init_from``'s config.yaml (a run or checkpoint folder
    of ours) has and ``values`` does not name. A named one that differs from the saved one is a
    ConfigError naming both: the weights would not fit, or would meet other latents or text. An
    unreadable config.yaml is left to the loading of ``init_from``, which names the damaged file."""
    source = values.get("init_from")
    saved_path = Path(source) / "config.yaml" if source else None
    if saved_path is None or not saved_path.is_file():
        return values
    try:
        saved = read_saved_config(saved_path)
    except (OSError, ValueError):  # damaged: loading init_from names it, as for any damaged file there
        return values
    values = dict(values)
    for name in INHERITED:
        if name not in saved:
            continue
        if name not in values:
            values[name] = saved[name]
        elif values[name] != saved[name]:
            raise ConfigError(f"{name}: this config names {values[name]!r}, but init_from {source} was trained with "
                              f"{saved[name]!r} ({saved_path}); leave {name} out to take the run's, or set it to "
                              f"{saved[name]!r}")
    return values


def estimate_flags(argv=None) -> tuple[bool, float | None, int | None, int]:
    """``--estimate_memory``, ``--gpu_memory_gb``, ``--resolution``, ``--world_size`` of a command line."""
    args, _ = build_parser().parse_known_args(argv)
    try:
        estimate = sd.cli.parse_bool(args.estimate_memory)
    except Exception:
        raise ConfigError(f"--estimate_memory: expected true or false, got {args.estimate_memory!r}") from None
    if args.gpu_memory_gb is not None and not args.gpu_memory_gb > 0:
        raise ConfigError(f"--gpu_memory_gb must be > 0, got {args.gpu_memory_gb}")
    if args.resolution is not None and (args.resolution <= 0 or args.resolution % 8):
        raise ConfigError(f"--resolution must be a positive multiple of 8, got {args.resolution}")
    return estimate, args.gpu_memory_gb, args.resolution, world_size_flag(args.world_size)


def world_size_flag(value: str | None) -> int:
    """``--world_size``: a positive whole number; without it torchrun's ``WORLD_SIZE``, else 1."""
    source = "--world_size"
    if value is None:
        value, source = os.environ.get("WORLD_SIZE"), "the WORLD_SIZE environment variable"
        if value is None:
            return 1
    try:
        world_size = int(str(value).strip())
    except ValueError:
        world_size = 0
    if world_size < 1:
        raise ConfigError(f"{source} must be a positive whole number of GPUs, got {value!r}")
    return world_size


def largest_batch_for(global_batch: int, world_size: int, at_most: int) -> int:
    """The largest micro-batch up to ``at_most`` that makes ``global_batch`` on ``world_size`` GPUs in
    whole accumulation steps; 0 when none does."""
    return next((b for b in range(at_most, 0, -1) if global_batch % (b * world_size) == 0), 0)


def resolve_global_batch(config: TrainConfig, world_size: int) -> TrainConfig:
    """``global_batch`` set: the config with ``grad_accum`` that makes it on ``world_size`` GPUs; a
    batch that cannot make it exactly is a ConfigError naming the settings that can."""
    if not config.global_batch:
        return config
    per_step = config.batch_size * world_size
    if config.global_batch % per_step == 0:
        return dataclasses.replace(config, grad_accum=config.global_batch // per_step)
    options = []
    smaller = largest_batch_for(config.global_batch, world_size, config.batch_size)
    if smaller:
        options.append(f"batch_size {smaller} (grad_accum {config.global_batch // (smaller * world_size)})")
    bigger = -(-config.global_batch // per_step) * per_step
    options.append(f"global_batch {bigger} with lr {config.lr * bigger / config.global_batch:.3g} (the linear "
                   f"scaling rule; the recipe's lr is for {config.global_batch})")
    raise ConfigError(f"global_batch {config.global_batch} is not a whole number of steps of batch_size "
                      f"{config.batch_size} on {world_size} GPU(s) ({per_step} images each): use "
                      + " or ".join(options))


def config_yaml(config: TrainConfig) -> str:
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)


# ---------------------------------------------------------------------------------------------
# What a resume does with a field that differs from its checkpoint's config.yaml
# ---------------------------------------------------------------------------------------------

REFUSE, WARN, FREE = "refuse", "warn", "free"


@dataclass(frozen=True)
class OnResume:
    """A field changed between a checkpoint and the command that resumes it: ``refuse`` (it fixes the
    math or the data order: the resumed run would not continue the same run), ``warn`` (accepted;
    ``then`` says what the resumed run does) or ``free`` (nothing the run computes depends on it).
    ``dreambooth``: refused only in a DreamBooth run (elsewhere the field is unused)."""

    action: str
    then: str = ""
    dreambooth: bool = False


_ORDER, _MATH, _SCHEDULE = "the data order", "the training math", "the learning-rate schedule"
ON_RESUME = {
    "datasets": OnResume(REFUSE, _ORDER), "epoch_size": OnResume(REFUSE, _ORDER),
    "data_threads": OnResume(FREE), "mmap_latents": OnResume(FREE),
    "allow_missing_latents": OnResume(FREE, "a changed number of samples is refused by itself"),
    "flip": OnResume(REFUSE, _ORDER), "masked_loss": OnResume(REFUSE, _MATH),
    "shuffle_tags": OnResume(REFUSE, _MATH), "keep_tokens": OnResume(REFUSE, _MATH),
    "tag_dropout": OnResume(REFUSE, _MATH), "tag_separator": OnResume(REFUSE, _MATH),
    "unet": OnResume(REFUSE, "the model"), "vae": OnResume(REFUSE, "the instance latents", dreambooth=True),
    "text_encoder": OnResume(REFUSE, "the text conditioning"), "tokenizer": OnResume(REFUSE, "the text conditioning"),
    "prediction_type": OnResume(REFUSE, _MATH), "flow_matching": OnResume(REFUSE, _MATH),
    "flow_density": OnResume(REFUSE, _MATH), "flow_logit_mean": OnResume(REFUSE, _MATH),
    "flow_logit_std": OnResume(REFUSE, _MATH), "flow_shift": OnResume(REFUSE, _MATH),
    "reflow": OnResume(REFUSE, _MATH),
    "init_from": OnResume(FREE, "a resume loads its checkpoint (a LoRA run's base is checked by its fingerprint)"),
    "lora_rank": OnResume(REFUSE, "the adapters"), "lora_alpha": OnResume(REFUSE, "the adapters"),
    "lora_dropout": OnResume(REFUSE, _MATH), "lora_targets": OnResume(REFUSE, "the adapters"),
    "lora_conv_rank": OnResume(REFUSE, "the adapters"), "lora_conv_alpha": OnResume(REFUSE, "the adapters"),
    "lora_text_encoder": OnResume(REFUSE, "the adapters"),
    "lora_type": OnResume(REFUSE, "the adapters"), "lora_factor": OnResume(REFUSE, "the adapters"),
    "dora": OnResume(REFUSE, "the adapters"),
    "embedding_token": OnResume(REFUSE, "the learned token"), "embedding_init": OnResume(REFUSE, "the learned token"),
    "embedding_lr": OnResume(REFUSE, _SCHEDULE), "embedding_train_fraction": OnResume(REFUSE, _SCHEDULE),
    "embedding_vectors": OnResume(REFUSE, "the learned token"),
    "instance_dir": OnResume(REFUSE, _ORDER), "instance_prompt": OnResume(REFUSE, _MATH, dreambooth=True),
    "class_dir": OnResume(REFUSE, _ORDER, dreambooth=True), "class_prompt": OnResume(REFUSE, _MATH, dreambooth=True),
    "num_class_images": OnResume(REFUSE, _ORDER, dreambooth=True),
    "image_size": OnResume(REFUSE, _MATH, dreambooth=True), "prior_loss_weight": OnResume(REFUSE, _MATH, dreambooth=True),
    "cache_text_embeddings": OnResume(FREE),
    "distill": OnResume(REFUSE, _MATH), "lcm_solver_steps": OnResume(REFUSE, _MATH),
    "lcm_guidance_min": OnResume(REFUSE, _MATH), "lcm_guidance_max": OnResume(REFUSE, _MATH),
    "lcm_loss": OnResume(REFUSE, _MATH), "lcm_huber_c": OnResume(REFUSE, _MATH),
    "lcm_timestep_scaling": OnResume(REFUSE, _MATH), "lcm_target_decay": OnResume(REFUSE, "the target network"),
    "control": OnResume(REFUSE, _MATH), "control_dropout": OnResume(REFUSE, _MATH),
    "controlnet_from": OnResume(FREE, "a resume loads its checkpoint's ControlNet"),
    "validation_controls": OnResume(FREE),
    "batch_size": OnResume(REFUSE, _ORDER), "grad_accum": OnResume(REFUSE, _ORDER),
    "global_batch": OnResume(REFUSE, _ORDER),
    "max_steps": OnResume(REFUSE, _SCHEDULE), "epochs": OnResume(REFUSE, _SCHEDULE),
    "lr": OnResume(REFUSE, _SCHEDULE), "warmup_steps": OnResume(REFUSE, _SCHEDULE),
    "text_encoder_lr": OnResume(REFUSE, _SCHEDULE), "text_encoder_warmup_steps": OnResume(REFUSE, _SCHEDULE),
    "min_lr_ratio": OnResume(REFUSE, _SCHEDULE), "down_lr_scale": OnResume(REFUSE, _SCHEDULE),
    "mid_lr_scale": OnResume(REFUSE, _SCHEDULE), "up_lr_scale": OnResume(REFUSE, _SCHEDULE),
    # the optimizer's saved state carries its hyper-parameters: a new value would be silently ignored
    "weight_decay": OnResume(REFUSE, "the optimizer"), "adam_beta1": OnResume(REFUSE, "the optimizer"),
    "adam_beta2": OnResume(REFUSE, "the optimizer"), "adam_eps": OnResume(REFUSE, "the optimizer"),
    "optimizer": OnResume(REFUSE, "the optimizer"),
    "noise_offset": OnResume(REFUSE, _MATH), "zero_terminal_snr": OnResume(REFUSE, _MATH),
    "grad_clip": OnResume(REFUSE, _MATH), "min_snr_gamma": OnResume(REFUSE, _MATH),
    "loss_type": OnResume(REFUSE, _MATH), "huber_schedule": OnResume(REFUSE, _MATH),
    "huber_c": OnResume(REFUSE, _MATH), "huber_scale": OnResume(REFUSE, _MATH),
    "debiased_estimation": OnResume(REFUSE, _MATH),
    "cfg_dropout": OnResume(REFUSE, _MATH),
    "ema_decay": OnResume(WARN, "the EMA goes on with the new decay; turned on, it starts from the resumed weights; "
                                "turned off, the checkpoints' EMA is not carried on"),
    "ema_device": OnResume(FREE), "ema_update_every": OnResume(WARN, "the EMA goes on updating at the new interval"),
    "ema_warmup": OnResume(FREE, "a resume keeps the warm-up its checkpoint records"),
    "precision": OnResume(WARN, "the resumed steps compute in the new precision (an fp16 loss scale starts afresh "
                                "when fp16 is new)"),
    "bf16_weights": OnResume(FREE, "checkpoints hold fp32 weights either way"),
    "grad_checkpointing": OnResume(FREE), "channels_last": OnResume(FREE), "compile": OnResume(FREE), "compile_mode": OnResume(FREE),
    "attention": OnResume(FREE),
    "max_bad_steps": OnResume(FREE),
    "sharding": OnResume(FREE, "checkpoints hold whole tensors whatever the sharding"),
    "fsdp_reduce_each_micro_batch": OnResume(FREE),
    "out_dir": OnResume(FREE), "save_steps": OnResume(FREE), "save_every_epoch": OnResume(FREE),
    "keep_checkpoints": OnResume(FREE), "keep_every_steps": OnResume(FREE),
    "posthoc_ema_every": OnResume(REFUSE, "the post-hoc EMAs' snapshots"),
    "keep_best": OnResume(WARN, "the best checkpoint is chosen by the new metric from the next evaluation on"),
    "stop_at_step": OnResume(FREE),
    "log_every": OnResume(FREE), "validate_every": OnResume(FREE), "validation_prompts": OnResume(FREE),
    "validation_data_captions": OnResume(FREE),
    "validation_samples": OnResume(FREE), "validation_steps": OnResume(FREE), "validation_cfg": OnResume(FREE),
    "validation_sampler": OnResume(FREE),
    "validation_width": OnResume(FREE), "validation_height": OnResume(FREE),
    "eval_every": OnResume(FREE), "eval_prompts": OnResume(FREE), "eval_n": OnResume(FREE),
    "eval_reference": OnResume(FREE), "eval_features": OnResume(FREE), "eval_clip_model": OnResume(FREE),
    "eval_batch_size": OnResume(FREE), "wandb_project": OnResume(FREE), "wandb_mode": OnResume(FREE),
    "tensorboard": OnResume(FREE),
    "seed": OnResume(REFUSE, _ORDER),
    "device": OnResume(FREE),
}


def resume_changes(saved: dict, config: TrainConfig) -> tuple[list[str], list[str]]:
    """The fields of ``config`` that differ from a checkpoint's ``saved`` config: ``(refused,
    warned)``, each as ``"name: old -> new (...)"``. A field newer than the saved config compares with its
    default."""
    refused, warned = [], []
    for name, rule in ON_RESUME.items():
        old, new = saved.get(name, field_default(name)), getattr(config, name)
        if old == new or rule.action == FREE or (rule.dreambooth and not config.instance_dir):
            continue
        if rule.action == REFUSE:
            refused.append(f"{name}: {old!r} -> {new!r} (it fixes {rule.then})")
        else:
            warned.append(f"{name}: {old!r} -> {new!r}: {rule.then}")
    return refused, warned


def field_default(name: str):
    """A field's default value (for a field newer than a saved config)."""
    f = FIELDS[name]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# ---------------------------------------------------------------------------------------------
# The reference of every field (docs/config.md is this, generated: python -m sd.train.config)
# ---------------------------------------------------------------------------------------------


def sections() -> list[tuple[str, list[str]]]:
    """The fields in the order and groups of ``TrainConfig``'s source (its ``# -- name ---`` comments)."""
    import inspect

    groups: list[tuple[str, list[str]]] = []
    for line in inspect.getsource(TrainConfig).splitlines():
        heading = re.match(r"\s*# -- (.+?) -+\s*$", line)
        name = re.match(r"    (\w+): \w+ = ", line)
        if heading:
            groups.append((heading.group(1), []))
        elif name and name.group(1) in FIELDS:
            groups[-1][1].append(name.group(1))
    return groups


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def describe_default(name: str) -> str:
    value = field_default(name)
    if name in AUTO_COUNTS and value == AUTO_BATCH:
        return "auto"
    if value in ("", [], None):
        return "(none)"
    if isinstance(value, (list, dict)):
        return f"`{yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()}`"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def reference_markdown() -> str:
    """``docs/config.md``: every field with its default, allowed values and doc, by group."""
    lines = ["# Training config reference", "",
             "Every field of a training YAML, generated from the fields' own docs in `sd/train/config.py` "
             "(`make docs` rewrites this file; a test keeps it in sync). A YAML may start with "
             "`extends: base.yaml`; every field is also a flag of `SD_Train.py` (`--lr 1e-5`), which "
             "overrides the YAML.", ""]
    for title, names in sections():
        lines += [f"## {title[0].upper()}{title[1:]}", "", "| field | default | allowed | what it does |",
                  "|---|---|---|---|"]
        for name in names:
            meta = FIELDS[name].metadata
            allowed = meta["allowed"].describe(FIELDS[name].type) if meta.get("allowed") else ""
            lines.append(f"| `{name}` | {_cell(describe_default(name))} | {_cell(allowed)} | {_cell(meta['help'])} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    target = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    if target is None:
        print(reference_markdown(), end="")
    else:
        target.write_text(reference_markdown())
