"""EMA of the trained weights (the UNet's, a text-encoder adapter's): an fp32 shadow updated by a foreach lerp
after each optimizer step; ``EMAWeights``, the EMAs of a run as its checkpoints' one ``ema.safetensors``."""

from __future__ import annotations

from dataclasses import dataclass

import contextlib

import torch

import sd.train.sharding
from sd.run_folder import EMA_TEXT_PREFIX, split_ema
from sd.settings import setting, refused, warned, OnResume, FREE, NON_NEGATIVE
from sd.cli import ConfigError


@dataclass(frozen=True)
class EmaConfig:
    """The EMA's updates and warm-up, and the post-hoc EMAs (ema_decay and ema_device are top-level)."""

    update_every: int = setting("update the EMA every N optimizer steps (decay raised to the N-th power); auto "
                                "(or 0): 10 for a whole UNet's EMA in host memory of a GPU run (each update copies "
                                "3.4 GB off the GPU), else 1", 0, allowed=NON_NEGATIVE,
                                resume=warned("the EMA goes on updating at the new interval"))
    posthoc_every: int = setting("post-hoc EMA (Karras et al. 2024): keep two power-function EMAs of what trains "
                                 "(in the UNet, and a text adapter or learned token beside it; sigma_rel 0.05 and "
                                 "0.10, where ema_device says, updated every step) "
                                 "and write both to OUT_DIR/posthoc_ema/ every N optimizer steps (fp16), from which "
                                 "SD_ImageGen.py --ema_length rebuilds an EMA of any length; 0 = off", 0,
                                 allowed=NON_NEGATIVE, resume=refused("the post-hoc EMAs' snapshots"))
    warmup: str = setting("EMA decay warm-up: restart (min(ema_decay, (1+t)/(10+t)) from this run's step 0), "
                          "off (the full ema_decay from the first step, so an inherited EMA keeps its weight), or "
                          "auto (off when init_from brings an EMA of ours, else restart; config.yaml records which)",
                          "auto", resume=OnResume(FREE, "a resume keeps the warm-up its checkpoint records"))

    def check(self, config, check_paths: bool = True) -> None:
        """``ema_warmup``, and ``posthoc_ema_every`` with the runs it cannot keep its EMAs in, each refused with the
        way out."""
        if self.warmup not in ("auto", "restart", "off"):
            raise ConfigError("ema.warmup: auto, restart or off")
        if config.ema_device not in ("same", "cpu"):
            raise ConfigError("ema_device: same or cpu")
        if not self.posthoc_every:
            return
        if config.sharding == "fsdp":
            raise ConfigError("ema.posthoc_every: the post-hoc EMAs hold whole weights, which sharding: fsdp "
                              "splits; set sharding: zero1 or none, or ema.posthoc_every: 0")
        mode = config.mode
        if not mode.unet_trains:
            raise ConfigError(f"ema.posthoc_every: averages what trains in the UNet, which a {mode.what}'s run "
                              "leaves frozen; set ema.posthoc_every: 0")

def ema_decay_at(step: int, decay: float) -> float:
    """Warm-up of the EMA decay: ``min(decay, (1 + step) / (10 + step))``."""
    return min(decay, (1 + step) / (10 + step))


def copy_weights(buffers: list[torch.Tensor], params: list[torch.Tensor]) -> None:
    """Copy ``params`` into ``buffers``; returns once the data is there.

    The copies are queued without blocking. One from CUDA into host memory returns before its data
    has arrived (PyTorch's notes on pinned memory and ``non_blocking``), so the host then waits on
    an event recorded after the last copy: whoever reads the buffers next sees finished copies.
    """
    for buffer, param in zip(buffers, params):
        buffer.copy_(param, non_blocking=True)
    source = params[0].device
    if source.type == "cuda" and buffers[0].device.type == "cpu":
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(source))
        copied.synchronize()


class EMA:
    """An fp32 shadow copy of a model's parameters, updated by a foreach lerp after optimizer steps.

    ``device=None`` keeps the shadow on the model's device. A CPU shadow (``device="cpu"``) saves
    accelerator memory; with ``update_every=N`` it is updated on every N-th step only, with the decay
    raised to the N-th power so its horizon in steps stays the same. ``warmup=False`` applies the full
    decay from the first update: for a shadow that already holds an average worth keeping (an EMA
    inherited from an earlier phase), which the warm-up would otherwise overwrite within ~10 steps.
    """

    def __init__(self, model, decay: float = 0.9999, device=None, update_every: int = 1, warmup: bool = True,
                 trainable_only: bool = False):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        if update_every < 1:
            raise ValueError(f"EMA update_every must be >= 1, got {update_every}")
        self.decay = decay
        self.update_every = update_every
        self.warmup = warmup
        # trainable_only: average the parameters that train (a LoRA adapter), not the frozen base
        self.names = [name for name, p in model.named_parameters() if p.requires_grad or not trainable_only]
        self.shadow = [
            p.detach().to(device=device or p.device, dtype=torch.float32, copy=True) for p in self.parameters(model)
        ]
        self.staging: list[torch.Tensor] | None = None  # see _live_weights

    def parameters(self, model) -> list[torch.Tensor]:
        """The parameters of ``model`` that the shadow averages, in the shadow's order; of a model split
        across the ranks (FSDP), this rank's slices, which a split shadow averages
        (``sd.train.sharding.shard_ema``)."""
        params = dict(model.named_parameters())
        return [sd.train.sharding.local(params[name]) for name in self.names]

    @torch.no_grad()
    def update(self, model, step: int, skip: torch.Tensor | None = None, view=None) -> bool:
        """Fold the live weights in after optimizer step ``step`` (0-based). Returns whether it did.

        ``skip``: a bool on the model's device; where true the shadow stays as it was. A shadow on
        that device takes it as a weight of zero, without the host reading it; a shadow in host
        memory reads it (its copies wait for the device anyway). ``view``: a function from the
        parameters to the weights folded in, when those are not the parameters themselves
        (``sd.train.optimizers.evaluation_view``); called only at an update.
        """
        if (step + 1) % self.update_every:
            return False
        params = self.parameters(model)
        return self.fold(self._live_weights(view(params) if view is not None else [p.detach() for p in params]),
                         self.weight_at(step), skip)

    def weight_at(self, step: int) -> float:
        """The weight of the live weights in the update after step ``step``: 1 - decay^update_every."""
        return 1.0 - (ema_decay_at(step, self.decay) if self.warmup else self.decay) ** self.update_every

    @torch.no_grad()
    def fold(self, live: list[torch.Tensor], weight: float, skip: torch.Tensor | None = None) -> bool:
        """``shadow += weight * (live - shadow)`` (``live``: fp32 on the shadow's device, ``_live_weights``),
        nothing where ``skip``; returns whether it folded."""
        if skip is not None and skip.device == self.shadow[0].device:
            weight = (~skip).float() * weight  # one 0-dim weight for every tensor
            torch._foreach_lerp_(self.shadow, live, [weight] * len(self.shadow))
            return True
        if skip is not None and bool(skip):
            return False
        torch._foreach_lerp_(self.shadow, live, weight)
        return True

    def _live_weights(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The weights ``params`` as fp32 on the shadow's device (themselves, or copies of them).

        Copies go into staging buffers allocated on the first update and reused: a fresh 3.4 GB per
        update at SD 1.x size costs page faults and allocator churn (bench/ema_copy.py). From CUDA to
        a CPU shadow the buffers are pinned, so the copies are DMA transfers.
        """
        target, source = self.shadow[0].device, params[0].device
        if source == target and params[0].dtype == torch.float32:
            return params
        if self.staging is None:
            pin = source.type == "cuda" and target.type == "cpu"
            self.staging = [torch.empty(s.shape, dtype=torch.float32, device=target, pin_memory=pin)
                            for s in self.shadow]
        copy_weights(self.staging, params)
        return self.staging

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.shadow))

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in state]
        unexpected = [n for n in state if n not in set(self.names)]
        if missing or unexpected:
            raise KeyError(f"EMA state does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, shadow in zip(self.names, self.shadow):
            if state[name].shape != shadow.shape:
                raise ValueError(f"EMA tensor {name}: shape {tuple(state[name].shape)} != {tuple(shadow.shape)}")
            if state[name].is_floating_point() and not bool(torch.isfinite(state[name]).all()):
                raise ValueError(f"EMA tensor {name} holds non-finite values (NaN or inf)")
        for name, shadow in zip(self.names, self.shadow):  # all checked first: nothing half loaded
            shadow.copy_(state[name])

    @torch.no_grad()
    def copy_to(self, model) -> None:
        """Write the EMA weights into ``model`` (for export or sampling)."""
        for p, s in zip(self.parameters(model), self.shadow):
            p.copy_(s)

    @contextlib.contextmanager
    def swapped_in(self, model):
        """Run the body with the EMA weights in ``model``; the live weights come back bit for bit.

        The live weights wait in CPU memory, so swapping costs no accelerator memory.
        """
        with torch.no_grad():
            live = [p.detach().to("cpu", copy=True) for p in self.parameters(model)]
            self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for p, saved in zip(self.parameters(model), live):
                    p.copy_(saved)




class EMAWeights:
    """A run's EMAs as one flat dict of tensors (its checkpoints' ``ema.safetensors``): the UNet's under its
    own parameter names (a LoRA run: the bare PEFT names), the text encoder adapter's, when it trains,
    under ``text_encoder.`` + name.

    A checkpoint written before the text adapter had an EMA holds the UNet's alone: loading it leaves
    ``text_missing`` set, and the resume starts the text adapter's EMA from its loaded weights.
    """

    def __init__(self, unet_ema: EMA | None, text_ema: EMA | None = None):
        self.unet_ema, self.text_ema = unet_ema, text_ema  # unet_ema None: a learned token's run (a frozen UNet)
        self.text_missing = False

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = dict(self.unet_ema.state_dict()) if self.unet_ema is not None else {}
        if self.text_ema is not None:
            state.update({EMA_TEXT_PREFIX + name: tensor for name, tensor in self.text_ema.state_dict().items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        unet, text = split_ema(state)
        if self.unet_ema is not None:
            self.unet_ema.load_state_dict(unet)
        elif unet:
            raise KeyError(f"EMA state holds a UNet's ({len(unet)} tensors) but the run's UNet is frozen")
        if self.text_ema is None:
            if text:
                raise KeyError(f"EMA state holds a text encoder adapter's ({len(text)} tensors) but the run trains none")
            return
        self.text_missing = not text
        if text:
            self.text_ema.load_state_dict(text)
