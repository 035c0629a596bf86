"""The contract between the trainer and a training mode.

Every run is built, stepped, saved and validated the same way; what differs between a whole-UNet run, a
LoRA, a learned token and a ControlNet is asked of the run's ``Mode`` at a few points, and answered in the
mode's own room (``sd/lora/mode.py``, ``sd/embedding/mode.py``, ``sd/controlnet/mode.py``):

* ``check(config, check_paths)`` (a class method, asked of every mode): its settings, and the settings it
  cannot train with, each a ``ConfigError`` naming the field and the way out;
* ``check_models(unet, text_encoder)``: the built models fit its settings (before any data is read);
* ``before_data(unet, text_encoder, tokenizer)``: changes the data needs (a new token in the tokenizer);
* ``check_data(data)``: the training data can train it (captions that hold a learned token);
* ``attach(unet, text_encoder)`` -> the module the step trains, after the data (a DreamBooth run's class
  images are drawn by the base alone), and ``estimate_before_data`` / ``estimate_attach`` the same on
  fake tensors, without files (``sd.train.memory``);
* ``trained_weights(step)``: its checkpoint entries of weights, by name (the file names: ``unet``,
  ``adapter``, ``embedding``, ``controlnet``); the trainer adds the rest (EMA, optimizer, RNGs);
* ``batch_inputs`` / ``model_inputs``: the tensors it adds at the end of a micro-batch, and what they
  become in the model's call; ``sample_inputs``: the same for the validation grid's samples, and
  ``shown_inputs`` the images of them the grid shows beside each sample (a ControlNet's conditioning image);
* ``describe(step)``: its line in the log.

A new mode is one new room (a ``Mode`` subclass, its config section beside it) and one line in
``sd.train.modes.MODES`` (ARCHITECTURE.md, "Where to add", lists the other lines). An objective
other than the diffusion loss (``sd.train.objectives``: flow, reflow, consistency distillation) is not a mode: it combines with one.

Every answer above composes, so two modes can train in one run (a LoRA with a learned token: pivotal
tuning, ``sd.train.modes.Together``): asked in ``MODES``' order, ``before_data``, ``check_models``,
``check_data`` and ``attach`` run one after the other (each attaches to what the one before returned);
the checkpoint entries of ``trained_weights`` sit side by side (their names differ: ``adapter``,
``embedding``, ``controlnet``); ``batch_inputs`` and ``model_inputs`` join; ``frozen_base`` and
``retokenises`` hold when one of them holds, ``whole_unet`` when both do; the frozen base's fingerprint
(of what either mode keeps frozen) is taken once, before either attaches. The modes' checks allow that
one pair and refuse every other.
"""

from __future__ import annotations

import torch


class Mode:
    """A whole-UNet run, and what every other mode changes of it (override what differs)."""

    what = "model"  # what trains, in messages
    frozen_base = False  # trains an addition to init_from's weights, which are never saved: fingerprinted instead
    whole_unet = True  # every UNet parameter trains (its EMA averages all of them; sharding can split them)
    unet_trains = True  # False: the UNet is frozen and keeps no EMA
    unet_blocks_train = True  # the UNet's own blocks train (their learning-rate scales apply)
    text_encoder_trains = False  # an adapter of the text encoder trains (its own learning rate and warm-up apply)
    retokenises = False  # the captions are tokenised again (the stored token ids lack what the mode adds)
    batch_inputs: tuple[str, ...] = ()  # the names of the tensors it adds at the end of a micro-batch
    missing_inputs = ""  # what a micro-batch without them lacks, and why, in an error message
    prompt_inputs = False  # sample_inputs needs each validation prompt's own input (no data captions join the grid)

    def __init__(self, config):
        self.config = config

    @classmethod
    def wanted(cls, config) -> bool:
        """Whether ``config`` asks for this mode."""
        return True

    @classmethod
    def check(cls, config, check_paths: bool = True) -> None:
        """Refuse settings of this mode that cannot work, also while it is off (its fields set without it)."""

    def own_learning_rates(self) -> list[str]:
        """The fields set to give what it trains a learning rate of its own (``name at its default`` each), which
        an optimizer with one rate for every group (Prodigy) cannot follow."""
        return []

    def check_models(self, unet, text_encoder) -> None:
        """Refuse, before any work, models the settings do not fit."""

    def before_data(self, unet, text_encoder, tokenizer) -> None:
        """Changes the data needs, made before any prompt is tokenised."""

    def check_data(self, data) -> None:
        """Refuse, before any step, training data this mode cannot learn from (``data``: the training split,
        ``sd.data.training_data.MixedData`` or DreamBooth's)."""

    def attach(self, unet, text_encoder) -> torch.nn.Module:
        """The module the step trains and calls; what does not train is frozen here."""
        return unet

    def estimate_before_data(self, unet, text_encoder) -> None:
        """``before_data`` on fake tensors, without a tokenizer (``sd.train.memory``)."""

    def estimate_attach(self, unet, text_encoder) -> torch.nn.Module:
        """``attach`` on fake tensors (``sd.train.memory``): the architecture, no file read."""
        return self.attach(unet, text_encoder)

    def fingerprinted(self, unet, text_encoder) -> list[torch.Tensor]:
        """The frozen weights a checkpoint of this mode was trained on, as loaded (``frozen_base``)."""
        return list(unet.parameters())

    def trained_weights(self, step) -> dict[str, object]:
        """The checkpoint's entries of trained weights: objects with ``state_dict`` / ``load_state_dict``."""
        return {"unet": step.unet}

    def model_inputs(self, inputs: dict, device: torch.device, generator: torch.Generator) -> dict:
        """The model call's keyword arguments from a micro-batch's ``batch_inputs`` (by name)."""
        return {}

    def estimate_inputs(self, images: int, resolution: int) -> tuple:
        """Stand-ins of ``batch_inputs`` for a memory estimate's micro-batch of ``images``."""
        return ()

    def sample_inputs(self, index: int, width: int, height: int) -> dict:
        """``sd.sampling.generate``'s keyword arguments for validation prompt ``index``."""
        return {}

    def shown_inputs(self, inputs: dict) -> list:
        """Images (uint8 ``(H, W, 3)``) of ``sample_inputs``' that the grid shows before the sample."""
        return []

    def describe(self, step) -> str | None:
        """A line for the log once the step is built, or None."""
        return None
