"""The training modes, one line each (``sd.training_mode``): a run's mode is the one its config asks for,
both of them together when it asks for two (a LoRA and a learned token: pivotal tuning), else the
whole-UNet run."""

from __future__ import annotations

import torch

import sd.controlnet.mode
import sd.embedding.mode
import sd.lora.mode
from sd.training_mode import Mode

MODES: tuple[type[Mode], ...] = (  # the order in which two modes of one run are asked (``Together``)
    sd.controlnet.mode.ControlNet,
    sd.lora.mode.Lora,
    sd.embedding.mode.LearnedToken,
)


class Together(Mode):
    """Two modes in one run, each asked in ``MODES``' order (``sd.training_mode``'s composition rules)."""

    def __init__(self, config, modes: list[Mode]):
        super().__init__(config)
        self.modes = modes
        self.what = " and ".join(mode.what for mode in modes)
        self.frozen_base = any(mode.frozen_base for mode in modes)
        self.whole_unet = all(mode.whole_unet for mode in modes)
        self.unet_trains = any(mode.unet_trains for mode in modes)
        self.unet_blocks_train = any(mode.unet_blocks_train for mode in modes)
        self.text_encoder_trains = any(mode.text_encoder_trains for mode in modes)
        self.retokenises = any(mode.retokenises for mode in modes)
        self.prompt_inputs = any(mode.prompt_inputs for mode in modes)
        self.batch_inputs = tuple(name for mode in modes for name in mode.batch_inputs)
        self.missing_inputs = "; ".join(mode.missing_inputs for mode in modes if mode.missing_inputs)

    def own_learning_rates(self) -> list[str]:
        return [name for mode in self.modes for name in mode.own_learning_rates()]

    def check_models(self, unet, text_encoder) -> None:
        for mode in self.modes:
            mode.check_models(unet, text_encoder)

    def before_data(self, unet, text_encoder, tokenizer) -> None:
        for mode in self.modes:
            mode.before_data(unet, text_encoder, tokenizer)

    def check_data(self, data) -> None:
        for mode in self.modes:
            mode.check_data(data)

    def attach(self, unet, text_encoder) -> torch.nn.Module:
        for mode in self.modes:
            unet = mode.attach(unet, text_encoder)
        return unet

    def estimate_before_data(self, unet, text_encoder) -> None:
        for mode in self.modes:
            mode.estimate_before_data(unet, text_encoder)

    def estimate_attach(self, unet, text_encoder) -> torch.nn.Module:
        for mode in self.modes:
            unet = mode.estimate_attach(unet, text_encoder)
        return unet

    def fingerprinted(self, unet, text_encoder) -> list[torch.Tensor]:
        seen, out = set(), []
        for mode in self.modes:
            for tensor in mode.fingerprinted(unet, text_encoder):
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    out.append(tensor)
        return out

    def trained_weights(self, step) -> dict[str, object]:
        out = {}
        for mode in self.modes:
            mine = mode.trained_weights(step)
            if set(mine) & set(out):
                raise ValueError(f"two modes save the checkpoint entry {sorted(set(mine) & set(out))[0]!r}")
            out.update(mine)
        return out

    def model_inputs(self, inputs: dict, device: torch.device, generator: torch.Generator) -> dict:
        return {k: v for mode in self.modes for k, v in mode.model_inputs(inputs, device, generator).items()}

    def estimate_inputs(self, images: int, resolution: int) -> tuple:
        return tuple(x for mode in self.modes for x in mode.estimate_inputs(images, resolution))

    def sample_inputs(self, index: int, width: int, height: int) -> dict:
        return {k: v for mode in self.modes for k, v in mode.sample_inputs(index, width, height).items()}

    def shown_inputs(self, inputs: dict) -> list:
        return [image for mode in self.modes for image in mode.shown_inputs(inputs)]

    def describe(self, step) -> str | None:
        lines = [line for line in (mode.describe(step) for mode in self.modes) if line]
        return "; ".join(lines) or None


def mode_of(config) -> Mode:
    """The mode ``config`` asks for, the two it asks for ``Together`` (the modes' checks allow one pair: a
    LoRA and a learned token), else the whole-UNet run."""
    wanted = [mode(config) for mode in MODES if mode.wanted(config)]
    if len(wanted) > 1:
        return Together(config, wanted)
    return wanted[0] if wanted else Mode(config)


def check(config, check_paths: bool = True) -> None:
    """Every mode's settings (``Mode.check``): a ConfigError names the first that cannot work."""
    for mode in MODES:
        mode.check(config, check_paths)
