"""Two or three models merged into one single file (``SD_Tools.py merge``), one tensor at a time.

* ``weighted_sum``: ``(1 - alpha) A + alpha B``;
* ``add_difference``: ``A + alpha (B - C)`` (what B learned from C, put on A).

``alpha`` is one number, or per UNet block: the 25 blocks of SD 1.x as the block-merge tools and kohya name them
(``IN00``-``IN11``: the original layout's ``input_blocks.N``, ``M00``: ``middle_block``, ``OUT00``-``OUT11``:
``output_blocks.N``); the UNet's other tensors (time embedding, the output layer) take the base alpha. The text
encoder and the VAE are merged too, or taken from one side (``a`` / ``b``). The sources are any models
``sd.model_weights`` reads (single files, diffusers folders or hub ids, runs of ours: their EMA weights); the
output is an original-layout single file (``sd.original_layout``) that AUTOMATIC1111, ComfyUI and diffusers'
``from_single_file`` load, written streamed (``sd.files.write_safetensors_streamed``): memory holds a tensor of
each source at a time, never a whole model.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import sd.files
import sd.formats
import sd.lora.formats
import sd.metadata
import sd.model
import sd.model_weights
import sd.original_layout

log = logging.getLogger("sd_tools")

METHODS = ("weighted_sum", "add_difference")
SIDES = ("merge", "a", "b")


@dataclass(frozen=True)
class MergeSettings:
    method: str = "weighted_sum"
    alpha: float = 0.5  # the base ratio: the UNet outside the blocks, and the text encoder and VAE when merged
    block_alphas: tuple[float, ...] | None = None  # 25 values, sd.original_layout.BLOCKS' order
    text_encoder: str = "merge"  # merge, a or b
    vae: str = "a"
    dtype: torch.dtype = torch.float16

    def check(self) -> "MergeSettings":
        if self.method not in METHODS:
            raise ValueError(f"method: one of {', '.join(METHODS)}, got {self.method!r}")
        if self.block_alphas is not None and len(self.block_alphas) != len(sd.original_layout.BLOCKS):
            raise ValueError(f"block alphas: {len(sd.original_layout.BLOCKS)} values (IN00-IN11, M00, OUT00-OUT11), "
                             f"got {len(self.block_alphas)}")
        for name in ("text_encoder", "vae"):
            if getattr(self, name) not in SIDES:
                raise ValueError(f"{name}: one of {', '.join(SIDES)}, got {getattr(self, name)!r}")
        return self


class OriginalView:
    """A model's UNet, VAE and text encoder under the original single file's names and shapes, read a few tensors
    at a time (``sd.model_weights.WeightReader`` per part)."""

    def __init__(self, source: str):
        self.source, self.entries, self.kinds = source, {}, []
        for part in ("unet", "vae", "text_encoder"):
            reader = sd.model_weights.WeightReader(source, part)
            mapping = sd.model.key_map(part, reader.model)
            shapes = {k: tuple(v.shape) for k, v in reader.model.state_dict().items()}
            for key, original in mapping.items():
                if reader.has(key):
                    shape = shapes[key] + ((1, 1) if ".mid.attn_1." in original and len(shapes[key]) == 2
                                           and original.endswith(".weight") else ())
                    self.entries[original] = (reader, key, shape)
            self.kinds.append(f"{part}: {reader.describe()}")

    def shape(self, name: str) -> tuple:
        return self.entries[name][2]

    def read(self, name: str) -> torch.Tensor:
        reader, key, shape = self.entries[name]
        return reader.read([key])[key].reshape(shape)


def merge(sources: dict[str, str], out: str | Path, settings: MergeSettings) -> Path:
    """Merge ``sources`` (``a``, ``b``, and ``c`` for add_difference) into the single file ``out``; a model of
    another layout is a ValueError naming both. Returns ``out``."""
    settings.check()
    if (settings.method == "add_difference") != ("c" in sources):
        raise ValueError("add_difference takes three models (A + alpha (B - C)); weighted_sum two")
    views = {side: OriginalView(source) for side, source in sources.items()}
    for side, view in views.items():
        log.info("%s: %s", side.upper(), "; ".join(view.kinds))
    names = list(views["a"].entries)
    for side, view in views.items():
        if side != "a" and {n: view.shape(n) for n in view.entries} != {n: views["a"].shape(n) for n in names}:
            other = sorted(set(view.entries) ^ set(names))[:2] or [n for n in names if view.shape(n) != views["a"].shape(n)][:2]
            raise ValueError(f"{sources['a']} and {sources[side]} are models of other layouts (e.g. {other}); merge "
                             "models of one architecture")
    layout = {name: (settings.dtype, views["a"].shape(name)) for name in names}
    header = merge_header(sources, settings, out)
    sd.files.write_safetensors_streamed(out, layout, merged_tensors(views, names, settings), header)
    return Path(out)


def merged_tensors(views: dict, names: list[str], settings: MergeSettings):
    """``(name, tensor)`` of the merged model in ``names``' order, each made when asked for."""
    alphas = dict(zip(sd.original_layout.BLOCKS, settings.block_alphas)) if settings.block_alphas else {}
    for name in tqdm(names, desc=f"merge ({settings.method})", unit="tensor"):
        part = "unet" if name.startswith(sd.original_layout.UNET_PREFIX) else \
            "vae" if name.startswith(sd.original_layout.VAE_PREFIX) else "text_encoder"
        side = getattr(settings, part) if part != "unet" else "merge"
        if side in ("a", "b"):
            tensor = views[side].read(name)
        else:
            alpha = alphas.get(sd.original_layout.block_of(name), settings.alpha) if part == "unet" else settings.alpha
            a, b = views["a"].read(name), views["b"].read(name)
            tensor = a + alpha * (b - views["c"].read(name)) if settings.method == "add_difference" else \
                torch.lerp(a, b, alpha)
        yield name, tensor.to(settings.dtype)


def merge_header(sources: dict[str, str], settings: MergeSettings, out) -> dict[str, str]:
    """modelspec's keys of a checkpoint, A's recorded prediction type, and ``sd_tools``: what was merged how."""
    prediction = sd.formats.recorded_prediction_type(sources["a"])
    unet = sd.model_weights.WeightReader(sources["a"], "unet").model
    header = sd.metadata.modelspec("checkpoint", Path(out).stem, prediction, sd.metadata.model_resolution(unet),
                                   time.time())
    done = {"tool": "merge", "method": settings.method, "alpha": settings.alpha,
            "block_alphas": list(settings.block_alphas) if settings.block_alphas else None,
            "text_encoder": settings.text_encoder, "vae": settings.vae,
            **{side: sd.metadata.public_name(source) for side, source in sources.items()}}
    header.update({"prediction_type": prediction, "sd_tools": json.dumps(done)})
    return header


def bake(source: str, loras: list[tuple], out: str | Path, dtype: torch.dtype = torch.float16,
         title_sources: dict | None = None) -> Path:
    """The model ``source`` with ``loras`` (``[(lora, ratio[, block weights])]``, each ``{part: {module: layer}}``:
    LoRA, LoCon, LoHa, LoKr, DoRA) merged in at their ratios (and block weights), as one single file written a tensor at a time. A LoRA layer of
    no layer of the model is a ValueError (a LoRA of another architecture)."""
    view = OriginalView(source)
    targets = {(reader.part, key.removesuffix(".weight")): name for name, (reader, key, _) in view.entries.items()
               if key.endswith(".weight")}
    for lora, *_ in loras:
        missing = [f"{part} {module}" for part, modules in lora.items() for module in modules
                   if (part, module) not in targets]
        if missing:
            raise ValueError(f"{source}: has no layer {missing[0]} of a LoRA ({len(missing)} in all); a LoRA of "
                             "another architecture")
    unet = sd.model_weights.WeightReader(source, "unet").model
    changes = {}
    for lora, ratio, *blocks in loras:
        factors = sd.lora.formats.block_scales(lora, unet, blocks[0] if blocks else None)
        for part, modules in lora.items():
            for module, layer in modules.items():
                changes.setdefault(targets[(part, module)], []).append(
                    (layer, ratio * factors.get((part, module), 1.0)))

    def tensors():
        for name in tqdm(view.entries, desc="merge LoRAs into the model", unit="tensor"):
            weight = view.read(name)
            for layer, ratio in changes.get(name, ()):
                weight = weight + ratio * sd.lora.formats.layer_change(layer, weight)
            yield name, weight.to(dtype)

    prediction = sd.formats.recorded_prediction_type(source)
    header = sd.metadata.modelspec("checkpoint", Path(out).stem, prediction, sd.metadata.model_resolution(unet),
                                   time.time())
    header.update(prediction_type=prediction, sd_tools=json.dumps({"tool": "merge-lora", **(title_sources or {})}))
    layout = {name: (dtype, view.shape(name)) for name in view.entries}
    sd.files.write_safetensors_streamed(out, layout, tensors(), header)
    return Path(out)
