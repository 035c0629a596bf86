"""The training modes, one line each (``sd.train.mode``): a run's mode is the first its config asks for,
else the whole-UNet run."""

from __future__ import annotations

import sd.controlnet.mode
import sd.embedding.mode
import sd.lora.mode
from sd.train.mode import Mode

MODES: tuple[type[Mode], ...] = (
    sd.controlnet.mode.ControlNet,
    sd.embedding.mode.LearnedToken,
    sd.lora.mode.Lora,
)


def mode_of(config) -> Mode:
    """The mode ``config`` asks for (its checks keep two from being asked at once)."""
    return next((mode for mode in MODES if mode.wanted(config)), Mode)(config)


def check(config, check_paths: bool = True) -> None:
    """Every mode's settings (``Mode.check``): a ConfigError names the first that cannot work."""
    for mode in MODES:
        mode.check(config, check_paths)
