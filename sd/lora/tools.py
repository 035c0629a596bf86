"""The tools around a LoRA file (``SD_Tools.py``): a LoRA extracted from the difference of two models, and a
LoRA resized to a lower rank. Both work one layer at a time (``sd.model_weights``, ``sd.lora.lowrank``): a
pair of 2 GB checkpoints is never held whole, and each output is written atomically in the kohya layout with
its header saying what was done.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import sd.cli
import sd.lora.adapters
import sd.lora.formats
import sd.metadata
import sd.model
import sd.model_weights
from sd.lora.formats import LoraModule
from sd.lora.lowrank import RankRule, factor, refactor

log = logging.getLogger("sd_tools")

# The layers kohya's extract_lora_from_models.py adapts: every Linear and 1x1 convolution of the UNet's
# transformer blocks, the 3x3 convolutions of its ResNet blocks and samplers with a conv rank (LoCon), and the
# text encoder's attention and MLP.
UNET_TARGETS = ("transformer",)
CONV_TARGETS = ("resnet",)
TEXT_TARGETS = (*sd.lora.adapters.TEXT_TARGETS, "fc1", "fc2")
HEADER_KEY = "sd_tools"  # what a tool did, as JSON, in the files it writes


@dataclass(frozen=True)
class ExtractSettings:
    rule: RankRule  # the Linear and 1x1 layers' rank
    conv_rule: RankRule | None = None  # the 3x3 convolutions' (None: not extracted)
    text_encoder: bool = True
    clamp_quantile: float = 0.99  # kohya's default; 1 keeps the SVD's factors as they are
    min_diff: float = 0.01  # a text encoder that differs by less than this in every weight is left out (kohya's)
    dtype: torch.dtype = torch.float16  # of the written factors


def extract(tuned: str, base: str, settings: ExtractSettings) -> tuple[dict, list[dict]]:
    """``({part: {module: LoraModule}}, report)``: each adapted layer of ``tuned`` minus ``base`` as a LoRA
    (alpha = its rank: scale 1). ``report``: one row per layer (``part``, ``module``, ``rank``, ``full_rank``,
    ``fro_kept``). Models of other architectures are a ValueError naming both."""
    lora, report = {}, []
    for part in ("unet", "text_encoder") if settings.text_encoder else ("unet",):
        tuned_part, base_part = (sd.model_weights.WeightReader(s, part) for s in (tuned, base))
        check_same_layout(tuned_part, base_part)
        log.info("%s: %s minus %s", part, tuned_part.describe(), base_part.describe())
        layers, largest, rows = {}, 0.0, []
        for module, spatial in tqdm(target_layers(tuned_part.model, part, settings.conv_rule is not None),
                                    desc=f"extract {part}", unit="layer"):
            name = f"{module}.weight"
            delta = tuned_part.read([name])[name] - base_part.read([name])[name]
            largest = max(largest, float(delta.abs().max()))
            rule = settings.conv_rule if spatial else settings.rule
            up, down, row = factor(delta, rule, settings.clamp_quantile)
            layers[module] = LoraModule(down.to(settings.dtype), up.to(settings.dtype), float(row["rank"]))
            rows.append({"part": part, "module": module, **row})
        if part == "text_encoder" and largest < settings.min_diff:
            log.info("the text encoders differ by at most %.2g (under min_diff %g): the LoRA leaves them out", largest,
                     settings.min_diff)
            continue
        lora[part], report = layers, report + rows
    return lora, report


def check_same_layout(a: sd.model_weights.WeightReader, b: sd.model_weights.WeightReader) -> None:
    shapes = [{k: tuple(v.shape) for k, v in r.model.state_dict().items()} for r in (a, b)]
    if shapes[0] != shapes[1]:
        differing = sorted(k for k in set(shapes[0]) | set(shapes[1]) if shapes[0].get(k) != shapes[1].get(k))
        raise ValueError(f"{a.source} and {b.source}: their {a.part}s are of other architectures ({len(differing)} "
                         f"tensors differ in name or shape, e.g. {differing[:2]})")


def target_layers(model, part: str, convs: bool) -> list[tuple[str, bool]]:
    """``(module, is a 3x3 convolution)`` of the layers an extraction adapts in ``model``, in model order."""
    targets = (*UNET_TARGETS, *(CONV_TARGETS if convs else ())) if part == "unet" else TEXT_TARGETS
    modules = dict(model.named_modules())
    return [(name, sd.lora.adapters.is_spatial_conv(modules[name]))
            for name in sd.lora.adapters.resolve_targets(model, targets)]


def resize(lora: dict, settings: ExtractSettings) -> tuple[dict, list[dict]]:
    """``lora`` (``{part: {module: LoraModule}}``) at the ranks ``settings``' rules choose, each layer's scale
    (alpha / rank) and DoRA magnitude kept; ``report`` as ``extract``'s. A LoHa or LoKr is a ValueError: their
    factors are no low-rank product to truncate."""
    out, report = {}, []
    for part, modules in lora.items():
        for module, layer in tqdm(modules.items(), desc=f"resize {part}", unit="layer"):
            if not isinstance(layer, LoraModule):
                raise ValueError(f"{part} layer {module}: a {type(layer).__name__.removesuffix('Module')} layer; only "
                                 "LoRA, LoCon and DoRA files are resized")
            rule = settings.conv_rule if layer.is_spatial_conv and settings.conv_rule else settings.rule
            up, down, row = refactor(layer.up, layer.down, rule, settings.clamp_quantile)
            alpha = layer.scale * row["rank"]  # the same scale: the file's alpha / rank as it was
            out.setdefault(part, {})[module] = layer._replace(down=down.to(settings.dtype), up=up.to(settings.dtype),
                                                              alpha=float(alpha))
            report.append({"part": part, "module": module, **row})
    return out, report


def read_lora_file(path: str | Path) -> tuple[dict, dict[str, str], str]:
    """A LoRA file as ``read_lora`` reads it, for the SD 1.x architecture its names fit (``sd1``, else the small
    presets), with its header; returns ``(lora, header, preset)``."""
    from safetensors import safe_open

    from safetensors import SafetensorError

    file = sd.lora.formats.lora_file(path)
    try:
        with safe_open(str(file), framework="pt") as handle:
            header = handle.metadata() or {}
    except SafetensorError as error:
        raise ValueError(f"{file}: not a readable safetensors file, damaged or truncated ({error})") from error
    errors = []
    for preset in sd.model.FILE_CONFIGS["unet"]:
        unet = sd.model.empty_model("unet", sd.model.FILE_CONFIGS["unet"][preset])
        text = sd.model.empty_model("text_encoder", sd.model.FILE_CONFIGS["text_encoder"].get(
            preset, sd.model.FILE_CONFIGS["text_encoder"]["tiny"]))
        try:
            return sd.lora.formats.read_lora(file, unet, text), header, preset
        except ValueError as error:
            errors.append(f"{preset}: {sd.cli.first_line(error)}")
    raise ValueError(f"{file}: fits no SD 1.x model known here ({'; '.join(errors)[:300]})")


def tool_header(tool: str, title: str, settings: ExtractSettings, sources: dict, report: list[dict],
                resolution: tuple[int, int], prediction_type: str = "epsilon") -> dict[str, str]:
    """The header of a file a tool writes: modelspec's keys and ``HEADER_KEY``, what was done (the tool, its
    sources by their last names, its rank rules, the Frobenius share kept over every layer)."""
    kept = [row["fro_kept"] for row in report]
    done = {"tool": tool, **{k: sd.metadata.public_name(v) for k, v in sources.items()},
            "rank": _rule_text(settings.rule), "conv_rank": _rule_text(settings.conv_rule),
            "clamp_quantile": settings.clamp_quantile, "layers": len(report),
            "fro_kept_min": round(min(kept), 4) if kept else None,
            "fro_kept_mean": round(sum(kept) / len(kept), 4) if kept else None}
    header = sd.metadata.modelspec("lora", title, prediction_type, resolution, time.time())
    header[HEADER_KEY] = json.dumps(done)
    header["ss_training_comment"] = f"{tool} by SD_Tools.py: {json.dumps(done)}"
    return header


def _rule_text(rule: RankRule | None) -> str | None:
    if rule is None:
        return None
    return str(rule.max_rank) if rule.method == "fixed" else f"{rule.method} {rule.param:g} (at most {rule.max_rank})"


def concatenate(loras: list[tuple[dict, float]]) -> dict:
    """One LoRA whose every layer adds what ``loras`` (``[(lora, ratio)]``) add together, exactly: the ranks
    concatenated, each input's ratio and scale folded into its ``up``, alpha the total rank (scale 1). A LoHa,
    LoKr or DoRA layer is a ValueError: its change is no sum of low-rank products (merge it into a model)."""
    layers: dict[tuple[str, str], list] = {}
    for lora, ratio in loras:
        for part, modules in lora.items():
            for module, layer in modules.items():
                if not isinstance(layer, LoraModule) or layer.dora_scale is not None:
                    kind = "DoRA" if isinstance(layer, LoraModule) else type(layer).__name__.removesuffix("Module")
                    raise ValueError(f"{part} layer {module}: a {kind} layer is no low-rank product to join; merge "
                                     "the files into a model instead (SD_Tools.py merge-lora --into MODEL)")
                layers.setdefault((part, module), []).append((layer, ratio))
    out: dict = {}
    for (part, module), items in layers.items():
        down = torch.cat([layer.down.float() for layer, _ in items])
        up = torch.cat([layer.up.float() * (ratio * layer.scale) for layer, ratio in items], dim=1)
        out.setdefault(part, {})[module] = LoraModule(down, up, float(down.shape[0]))
    return out


def joined_tokens(files: list[Path]) -> dict[str, torch.Tensor]:
    """The learned tokens the LoRA ``files`` bundle, all of them; one token bundled with other vectors in two files
    is a ValueError naming both."""
    tokens, where = {}, {}
    for file in files:
        for token, vectors in sd.lora.formats.read_bundled_embeddings(file).items():
            if token in tokens and not torch.equal(tokens[token], vectors):
                raise ValueError(f"token {token}: {where[token]} and {file} bundle it with other vectors")
            tokens[token], where[token] = vectors, file
    return tokens
