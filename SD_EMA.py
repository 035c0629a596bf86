"""EMA of the UNet's weights: an fp32 shadow updated by a foreach lerp after each optimizer step."""

from __future__ import annotations

import contextlib

import torch


def ema_decay_at(step: int, decay: float) -> float:
    """Warm-up of the EMA decay: ``min(decay, (1 + step) / (10 + step))``."""
    return min(decay, (1 + step) / (10 + step))


class EMA:
    """An fp32 shadow copy of a model's parameters, updated by a foreach lerp after optimizer steps.

    ``device=None`` keeps the shadow on the model's device. A CPU shadow (``device="cpu"``) saves
    accelerator memory; with ``update_every=N`` it is updated on every N-th step only, with the decay
    raised to the N-th power so its horizon in steps stays the same.
    """

    def __init__(self, model, decay: float = 0.9999, device=None, update_every: int = 1):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        if update_every < 1:
            raise ValueError(f"EMA update_every must be >= 1, got {update_every}")
        self.decay = decay
        self.update_every = update_every
        self.names = [name for name, _ in model.named_parameters()]
        self.shadow = [
            p.detach().to(device=device or p.device, dtype=torch.float32, copy=True) for p in model.parameters()
        ]

    @torch.no_grad()
    def update(self, model, step: int) -> bool:
        """Fold the live weights in after optimizer step ``step`` (0-based). Returns whether it did."""
        if (step + 1) % self.update_every:
            return False
        decay = ema_decay_at(step, self.decay) ** self.update_every
        params = [p.detach() for p in model.parameters()]
        device = self.shadow[0].device
        if params[0].device != device or params[0].dtype != torch.float32:
            params = [p.to(device=device, dtype=torch.float32, non_blocking=True) for p in params]
        torch._foreach_lerp_(self.shadow, params, 1.0 - decay)
        return True

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
            shadow.copy_(state[name])

    @torch.no_grad()
    def copy_to(self, model) -> None:
        """Write the EMA weights into ``model`` (for export or sampling)."""
        for p, s in zip(model.parameters(), self.shadow):
            p.copy_(s)

    @contextlib.contextmanager
    def swapped_in(self, model):
        """Run the body with the EMA weights in ``model``; the live weights come back bit for bit.

        The live weights wait in CPU memory, so swapping costs no accelerator memory.
        """
        with torch.no_grad():
            live = [p.detach().to("cpu", copy=True) for p in model.parameters()]
            self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for p, saved in zip(model.parameters(), live):
                    p.copy_(saved)
