"""A LoRA run as a training mode (``lora_rank`` > 0): adapters on init_from's frozen UNet (and, with
``lora_text_encoder``, the text encoder), which alone train and alone are saved (``adapter``)."""

from __future__ import annotations

from dataclasses import dataclass

import logging
import math
from pathlib import Path

import sd.formats
import sd.lora.adapters
import sd.run_folder
import sd.training_mode
from sd.cli import ConfigError
from sd.settings import setting, refused, Range, NON_NEGATIVE, BELOW_ONE, MATH

log = logging.getLogger("sd_lora")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA and its relatives (LoCon, LoHa, LoKr, DoRA): adapters on init_from's frozen weights."""

    rank: int = setting("LoRA rank of the adapters trained instead of the full UNet; 0 = full fine-tuning. "
                        "Needs init_from (the base weights, which stay unchanged)", 0, allowed=NON_NEGATIVE,
                        resume=refused("the adapters"))
    alpha: float = setting("LoRA alpha: the adapter's output is scaled by lora_alpha / lora_rank; 0 = lora_rank "
                           "(scale 1)", 0.0, allowed=NON_NEGATIVE, resume=refused("the adapters"))
    dropout: float = setting("dropout on the adapter's input during training", 0.0, allowed=BELOW_ONE,
                             resume=refused(MATH))
    targets: list = setting("UNet layers that get an adapter: groups attention (q/k/v/out projections), "
                            "transformer (+ feed-forward and proj_in/out), resnet (the convolutions: LoCon), "
                            "or module-name suffixes such as to_q", default_factory=lambda: ["attention"],
                            resume=refused("the adapters"))
    conv_rank: int = setting("LoRA rank of the convolutions with a kernel larger than 1x1 that lora_targets "
                             "selects (LoCon: the resnet group's 3x3 convolutions; kohya's conv_dim); the 1x1 "
                             "ones take lora_rank, as in kohya's files; 0 = lora_rank", 0, allowed=NON_NEGATIVE,
                             resume=refused("the adapters"))
    conv_alpha: float = setting("LoRA alpha of those convolutions (kohya's conv_alpha); 0 = lora_alpha (and when "
                                "that is 0 too, the convolutions' rank: scale 1)", 0.0, allowed=NON_NEGATIVE,
                                resume=refused("the adapters"))
    block_dims: list = setting("the rank of each of the UNet's 25 blocks (IN00-IN11, M00, OUT00-OUT11; kohya's "
                               "block_dims): a target layer in a block takes its block's rank, 0 leaves the block "
                               "without adapters; the convolutions larger than 1x1 keep conv_rank; empty: rank "
                               "everywhere", default_factory=list, resume=refused("the adapters"))
    block_alphas: list = setting("the alpha of each of the 25 blocks with block_dims (kohya's block_alphas); empty: "
                                 "alpha everywhere", default_factory=list, resume=refused("the adapters"))
    text_encoder: bool = setting("also train a LoRA adapter on the text encoder's attention projections", False,
                                 resume=refused("the adapters"))
    type: str = setting("the adapter: lora (up @ down), loha (LyCORIS' Hadamard product of two low-rank products) "
                        "or lokr (LyCORIS' Kronecker product of a small and a low-rank factor); lora_rank, "
                        "lora_alpha and the conv settings apply to each; loha and lokr export in the kohya layout "
                        "only", "lora", resume=refused("the adapters"))
    factor: int = setting("lokr: how each layer's sides split between the two Kronecker factors, as LyCORIS "
                          "splits them: a divisor of a side gives it and the rest (the smaller first), else the "
                          "divisor nearest the square root and at most this; -1 = nearest the square root", -1,
                          allowed=Range(-1), resume=refused("the adapters"))
    dora: bool = setting("DoRA: each adapted layer also trains a magnitude per input channel, its weight used as "
                         "(W + adapter) * magnitude / norm (the norm over each input channel's column); with any "
                         "lora_type; written as dora_scale (1, in), which ComfyUI, AUTOMATIC1111 and LyCORIS merge "
                         "alike; exports in the kohya layout only", False, resume=refused("the adapters"))


class Lora(sd.training_mode.Mode):
    what = "adapter"
    frozen_base = True
    whole_unet = False

    @property
    def text_encoder_trains(self) -> bool:
        return bool(self.config.lora.text_encoder)

    @classmethod
    def wanted(cls, config) -> bool:
        return config.lora.rank > 0

    @classmethod
    def check(cls, config, check_paths: bool = True) -> None:
        if check_paths and config.lora.rank and not config.init_from:
            raise ConfigError("lora.rank > 0 trains an adapter on existing weights: set init_from (a diffusers "
                              "folder or hub id, a single file, or a run of ours)")
        if not (config.lora.targets and all(isinstance(t, str) and t.strip() for t in config.lora.targets)):
            raise ConfigError("lora.targets: a list of groups (attention, transformer, resnet) or module-name "
                              "suffixes")
        if config.lora.type not in sd.lora.adapters.LORA_TYPES:
            raise ConfigError(f"lora.type: one of {', '.join(sd.lora.adapters.LORA_TYPES)}, got {config.lora.type!r}")
        if config.lora.factor != -1 and config.lora.type != "lokr":
            raise ConfigError(f"lora.factor sets a lokr adapter's factors (got lora.type: {config.lora.type}); set "
                              "lora.type: lokr, or lora.factor: -1")
        if config.lora.type != "lora" and config.lora.dropout:
            raise ConfigError(f"lora.dropout drops a LoRA's input; a {config.lora.type} adapter has none: set "
                              "lora.dropout: 0")
        cls.check_blocks(config.lora)
        if config.lora.rank:
            if config.sharding != "none":
                raise ConfigError(f"sharding: {config.sharding} splits a full fine-tune's state; a LoRA adapter is a "
                                  "few MB that every GPU holds whole: set sharding: none, or lora.rank: 0")
            return
        if config.lora.text_encoder:
            raise ConfigError("lora.text_encoder needs lora.rank > 0")
        if config.lora.type != "lora" or config.lora.dora:
            setting = f"lora.type: {config.lora.type}" if config.lora.type != "lora" else "lora.dora: true"
            raise ConfigError(f"{setting} sets the adapter of a run with lora.rank > 0: set lora.rank, or "
                              f"{'lora.type: lora' if config.lora.type != 'lora' else 'lora.dora: false'}")
        if config.lora.conv_rank or config.lora.conv_alpha:
            raise ConfigError("lora.conv_rank / lora.conv_alpha set the convolutions' adapters of a LoRA run: set "
                              "lora.rank > 0 too")

    @staticmethod
    def check_blocks(lora) -> None:
        def numbers(values, kind):
            return len(values) == 25 and all(isinstance(v, kind) and not isinstance(v, bool) and 0 <= v < math.inf
                                             for v in values)

        if lora.block_dims and not numbers(lora.block_dims, int):
            raise ConfigError(f"lora.block_dims: 25 whole numbers >= 0 (IN00-IN11, M00, OUT00-OUT11), got "
                              f"{len(lora.block_dims)} values")
        if lora.block_alphas and not (lora.block_dims and numbers(lora.block_alphas, (int, float))):
            raise ConfigError("lora.block_alphas: 25 numbers >= 0, with lora.block_dims (the blocks' ranks)")
        if lora.block_dims and not lora.rank:
            raise ConfigError("lora.block_dims sets the ranks of a LoRA run's blocks: set lora.rank > 0 too (the "
                              "rank of the layers outside the blocks)")

    def check_models(self, unet, text_encoder) -> None:
        try:
            sd.lora.adapters.resolve_targets(unet, self.config.lora.targets)
        except sd.lora.adapters.LoraError as error:
            raise ConfigError(str(error)) from None

    def attach(self, unet, text_encoder):
        layout = sd.lora.adapters.LOKR_LAYOUT
        if self.config.lora.type == "lokr":
            layout = resumed_lokr_layout(Path(self.config.out_dir) / "checkpoints")
            if layout != sd.lora.adapters.LOKR_LAYOUT:
                log.warning("the LoKr run in %s was trained with PEFT's layout of its factors (layout %d, before "
                            "LyCORIS' was used): it trains on as it began; a new run takes LyCORIS' layout",
                            self.config.out_dir, layout)
        return self._attach(unet, text_encoder, layout)

    def estimate_attach(self, unet, text_encoder):
        return self._attach(unet, text_encoder, sd.lora.adapters.LOKR_LAYOUT)  # no file read

    def _attach(self, unet, text_encoder, layout: int):
        try:
            sd.lora.adapters.apply_settings(sd.lora.adapters.LoraSettings.from_config(self.config), unet, text_encoder,
                                            layout)
        except sd.lora.adapters.LoraError as error:
            raise ConfigError(str(error)) from error
        return unet

    def trained_weights(self, step) -> dict[str, object]:
        # relayout=False: the optimizer holds the factors attach built (a resume's layout: resumed_lokr_layout)
        return {"adapter": sd.lora.adapters.AdapterWeights(relayout=False, unet=step.unet,
                                                           text_encoder=step.text_encoder)}

    def describe(self, step) -> str:
        lora = self.config.lora
        return (f"{sd.lora.adapters.LORA_TYPES[lora.type]}{' with DoRA' if lora.dora else ''} rank {lora.rank} (alpha "
                f"{sd.lora.adapters.effective_alpha(lora.rank, lora.alpha):g}) on "
                f"{len(step.unet.lora_settings['modules'])} UNet layers"
                f"{' and the text encoder' if lora.text_encoder else ''}: "
                f"{sum(p.numel() for p in step.trainable)} trainable parameters")


def resumed_lokr_layout(checkpoints_dir: Path) -> int:
    """The LoKr layout (``sd.lora.adapters.LOKR_LAYOUT``) of the run whose checkpoints are in ``checkpoints_dir``,
    from its newest complete checkpoint whose adapter file can be read (a resume loads one of them); the current
    layout when there is none. A checkpoint's layout is chosen before the optimizer holds the factors, so the
    resumed run keeps the factors and scales it was trained with."""
    from safetensors import SafetensorError, safe_open

    for _, folder in reversed(sd.run_folder.complete_checkpoints(checkpoints_dir)):
        try:
            with safe_open(str(folder / sd.formats.RUN_ADAPTER_FILE), framework="pt") as handle:
                keys = set(handle.keys())
                if sd.lora.adapters.LAYOUT_KEY in keys:
                    return int(handle.get_tensor(sd.lora.adapters.LAYOUT_KEY))
        except (OSError, SafetensorError, RuntimeError, ValueError):
            continue  # a damaged file: the resume sets its checkpoint aside and reads an older one
        return 1 if any(".lokr_" in key for key in keys) else sd.lora.adapters.LOKR_LAYOUT
    return sd.lora.adapters.LOKR_LAYOUT
