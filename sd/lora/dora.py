"""DoRA (weight-decomposed low-rank adaptation, Liu et al. 2024) on a LoRA, LoHa or LoKr layer.

The adapted weight ``V = W0 + scale * delta`` is used as ``V * (m / |V|)``: ``|V|`` the norm of each
input channel's column (over the outputs and the kernel), ``m`` a trained magnitude per input channel
that starts at ``|W0|``'s, so an adapted model starts equal to its base. Files store ``m`` as
``dora_scale`` of shape ``(1, I)`` (a Linear) or ``(1, I, 1, 1)`` (a convolution): the layout ComfyUI,
AUTOMATIC1111 and LyCORIS (``dora_wd`` with ``wd_on_output`` off) all merge to the same weights.
The per-output-channel form (PEFT's DoRA, LyCORIS' default since 3.2, ``dora_scale`` of shape
``(O, 1)``) is read too (``decompose``), but ComfyUI divides it by ``|W0|`` and AUTOMATIC1111 by the
input axis' norm, so it is never written.

Scaling each input channel's column of the weight is scaling that channel of the input:
``(V * g) x = V (g * x)``. A forward pre-hook on the adapter's layer multiplies its input by
``g = m / |V|``, which makes any of PEFT's adapter layers a DoRA layer. As in the paper (its section
4.3) and PEFT, ``|V|`` is a constant to the gradient: it is computed without autograd, in fp32.
"""

from __future__ import annotations

import torch

ADAPTER = "default"  # PEFT's adapter name inside the modules (sd.lora.adapters injects under it)
DORA = "dora_scale"  # the layer's ParameterDict of magnitudes: <module>.dora_scale.default, as files name it
HOOK = "_dora_hook"


def input_norm(weight: torch.Tensor) -> torch.Tensor:
    """The norm of each input channel's column of ``weight`` (over the outputs and the kernel), shaped
    ``(1, I)`` or ``(1, I, 1, 1)``: a DoRA magnitude's shape."""
    return weight.transpose(0, 1).flatten(1).norm(dim=1).reshape(1, weight.shape[1], *[1] * (weight.ndim - 2))


def output_norm(weight: torch.Tensor) -> torch.Tensor:
    """The norm of each output channel's row of ``weight``, shaped ``(O, 1)`` or ``(O, 1, 1, 1)``."""
    return weight.flatten(1).norm(dim=1).reshape(weight.shape[0], *[1] * (weight.ndim - 1))


def axis_of(magnitude: torch.Tensor, weight_shape) -> str | None:
    """``input`` or ``output``: the axis a ``dora_scale`` of ``magnitude``'s shape decomposes a weight of
    ``weight_shape`` along (ComfyUI tells them by the first size too); None when it fits neither."""
    out_channels, in_channels = weight_shape[0], weight_shape[1]
    trailing = [1] * (len(weight_shape) - 2)
    shape = list(magnitude.shape)
    if shape in ([1, in_channels, *trailing], [1, in_channels]) and out_channels != 1:
        return "input"
    if shape in ([out_channels, 1, *trailing], [out_channels, 1]):
        return "output"
    return None


def decompose(weight: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """``V * (m / |V|) - W0`` for ``V = weight + delta`` (fp32), the norm along ``magnitude``'s axis: the
    change a DoRA layer makes at strength 1 (its change at strength s is s times this, as ComfyUI and
    AUTOMATIC1111 apply it)."""
    weight = weight.float()
    patched = weight + delta.float()
    norm = input_norm(patched) if axis_of(magnitude, weight.shape) == "input" else output_norm(patched)
    return patched * (magnitude.float().reshape(norm.shape) / norm) - weight


def add_dora(layer) -> None:
    """Give a PEFT adapter layer a magnitude (``|W0|`` per input channel, fp32, trained) and the hook that
    applies it."""
    weight = layer.get_base_layer().weight.detach().float()
    setattr(layer, DORA, torch.nn.ParameterDict({ADAPTER: torch.nn.Parameter(input_norm(weight))}))
    setattr(layer, HOOK, layer.register_forward_pre_hook(scale_input))


def has_dora(layer) -> bool:
    return ADAPTER in getattr(layer, DORA, {})


def magnitude(layer) -> torch.Tensor:
    return getattr(layer, DORA)[ADAPTER]


@torch.no_grad()
def adapted_norm(layer) -> torch.Tensor:
    """``|V|`` per input channel of the layer's adapted weight, in fp32, outside autograd and autocast (whose
    cache of a weight's cast, made here without autograd, could stand in for the forward pass' own)."""
    base = layer.get_base_layer().weight
    with torch.autocast(base.device.type, enabled=False):
        delta = layer.get_delta_weight(ADAPTER)
    return input_norm(base.float() + delta.float().reshape(base.shape))


def scale_input(layer, args):
    """The forward pre-hook: the layer's input times ``m / |V|`` per channel (fp32: the gain is near 1 and
    bf16 would round it to 1), unless the layer's adapters are off."""
    if layer.disable_adapters or layer.merged:
        return None
    x = args[0]
    g = magnitude(layer) / adapted_norm(layer)  # exactly 1 at the start
    return (x * (g.reshape(-1) if g.ndim == 2 else g), *args[1:])


@torch.no_grad()
def merge(layer) -> None:
    """Fold a DoRA layer's adapter and magnitude into its base weight, ``V * m / |V|`` in fp32 rounded
    once to the weight's dtype, and remove the hook (the layer then computes its base alone)."""
    weight = layer.get_base_layer().weight
    delta = layer.get_delta_weight(ADAPTER).float().reshape(weight.shape)
    weight.copy_(weight.float() + decompose(weight, delta, magnitude(layer)))
    getattr(layer, HOOK).remove()
    getattr(layer, DORA).clear()
