"""A model's weights read one layer at a time from any source, for tools that compare or combine whole models
without holding them (``SD_Tools.py``): a single file (``sd.original_layout``), a diffusers folder or hub id
(its safetensors files), or a run or checkpoint folder of ours (its EMA weights unless asked for the live ones;
its text encoder from the source its config names).

``WeightReader(source, part)``: ``model`` (the part on the meta device: its module names and shapes),
``read(names)`` (those tensors, fp32, under the model's own state-dict names), ``describe()``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import sd.cli
import sd.formats
import sd.model
import sd.original_layout
import sd.run_folder

PARTS = ("unet", "vae", "text_encoder")
WEIGHT_FILES = {"unet": ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.fp16.safetensors"),
                "vae": ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.fp16.safetensors"),
                "text_encoder": ("model.safetensors", "model.fp16.safetensors")}


class WeightReader:
    """The ``part`` (``unet`` or ``text_encoder``) of ``source``, read a few tensors at a time."""

    def __init__(self, source: str, part: str, use_ema: bool = True):
        if part not in PARTS:
            raise ValueError(f"part: one of {', '.join(PARTS)}, got {part!r}")
        self.source, self.part = str(source), part
        path = Path(source)
        if self.source == "tiny" and part != "unet":  # the seeded preset: small, built here
            model = (sd.model.load_vae if part == "vae" else sd.model.load_text_encoder)("tiny")
            state = model.state_dict()
            self.model, self._names, self.kind = model, {k: k for k in state}, "tiny (random, seed 0)"
            self._read = lambda names: {n: state[n] for n in names}
        elif path.is_file():
            self._from_file(path, use_ema)
        elif sd.formats.run_config(self.source) is not None:
            self._from_run(use_ema)
        else:
            self._from_diffusers(self.source)

    # -- the three kinds of source ------------------------------------------------------------------------------

    def _from_file(self, path: Path, use_ema: bool) -> None:
        file = sd.model.open_file(path, use_ema)
        what = sd.original_layout.PART_NAMES[self.part]
        preset = sd.model.file_preset(file, self.part) if self.part in file.parts else None
        if preset is None:
            raise sd.model.LoadError(f"{path}: holds no SD 1.x {what}" if self.part not in file.parts else
                                     f"{path}: its {what} fits no architecture known here")
        self.model = sd.model.empty_model(self.part, sd.model.FILE_CONFIGS[self.part][preset])
        mapping = sd.model.key_map(self.part, self.model)
        self._names = {key: mapping[key] for key in self.model.state_dict() if mapping[key] in file.names}
        self._read = lambda names: {n: t for n, t in zip(names, file.tensors([self._names[n] for n in names]).values())}
        self.kind = file.describe(self.part)

    def _from_run(self, use_ema: bool) -> None:
        config = sd.formats.run_config(self.source)
        folder = sd.run_folder.resolve_checkpoint(self.source)
        if sd.formats.is_lora_checkpoint(folder):
            raise ValueError(f"{self.source}: a LoRA run of ours; its adapter is a LoRA already: write it with "
                             "SD_ImageGen.py --export_lora")
        if self.part != "unet":  # a run of ours trains the UNet: its text encoder and VAE are those it names
            inner = WeightReader(str(config[self.part]), self.part)
            self.model, self._names, self._read = inner.model, inner._names, inner._read
            self.kind = f"the {sd.original_layout.PART_NAMES[self.part]} of {self.source}: {inner.kind}"
            return
        weights = folder / ("ema.safetensors" if use_ema else "unet.safetensors")
        if not weights.is_file():
            weights = folder / "unet.safetensors"
        self.model = sd.model.empty_model("unet", sd.model.UNET_PRESETS[config["unet"]])
        self._safetensors({name: name for name in self.model.state_dict()}, {name: weights for name in
                                                                             self.model.state_dict()})
        self.kind = f"{weights}"

    def _from_diffusers(self, source: str) -> None:
        folder = Path(source)
        if not folder.is_dir():
            folder = _download(source, self.part)
        config = folder / self.part / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"{source}: no {self.part}/config.json (a diffusers pipeline folder has one)")
        self.model = _empty_from_config(self.part, json.loads(config.read_text(encoding="utf-8")))
        files = _weight_files(folder / self.part, self.part)
        own = set(self.model.state_dict())
        names, where = {}, {}
        for file, keys in files.items():
            for key in keys:
                name = key.removeprefix("text_model.") if self.part == "text_encoder" else key
                if name in own:
                    names[name], where[name] = key, file
        self._safetensors(names, where)
        self.kind = f"diffusers folder {source}"

    def _safetensors(self, names: dict[str, str], where: dict[str, Path]) -> None:
        from safetensors import safe_open

        self._names = names

        def read(wanted):
            out = {}
            for file in {where[n] for n in wanted}:
                with safe_open(str(file), framework="pt") as handle:
                    out.update({n: handle.get_tensor(names[n]) for n in wanted if where[n] == file})
            return out

        self._read = read

    # -- reading ------------------------------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self._names

    def read(self, names) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (the model's state-dict names) in fp32; a missing one is a ValueError naming the
        source, a NaN or inf one too."""
        names = list(names)
        missing = [n for n in names if n not in self._names]
        if missing:
            raise ValueError(f"{self.source}: its {self.part} lacks {missing[:3]} ({len(missing)} in all)")
        tensors = {name: tensor.float() for name, tensor in self._read(names).items()}
        bad = next((n for n, t in tensors.items() if not sd.original_layout.all_finite(t)), None)
        if bad is not None:
            raise ValueError(f"{self.source}: {self.part} {bad} holds non-finite values (NaN or inf)")
        return tensors

    def describe(self) -> str:
        return self.kind


def _empty_from_config(part: str, config: dict):
    """The model a diffusers folder's ``config.json`` describes, on the meta device."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffusers import AutoencoderKL

    with torch.device("meta"):
        if part == "unet":
            return UNet2DConditionModel.from_config(config)
        if part == "vae":
            return AutoencoderKL.from_config(config)
        return CLIPTextModel(CLIPTextConfig(**{k: v for k, v in config.items() if not k.startswith("_")}))


def _weight_files(folder: Path, part: str) -> dict[Path, list[str]]:
    """``{safetensors file: its keys}`` of a diffusers model folder (one file, or the shards its index names)."""
    from safetensors import safe_open

    candidates = [folder / name for name in WEIGHT_FILES[part]] + sorted(folder.glob("*.safetensors"))
    index = sorted(folder.glob("*.safetensors.index.json"))
    if index:
        shards = sorted(set(json.loads(index[0].read_text(encoding="utf-8"))["weight_map"].values()))
        candidates = [folder / name for name in shards]
    files = [f for f in dict.fromkeys(candidates) if f.is_file()]
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors weights (a .bin is not read: a pickle can run code)")
    if not index:
        files = files[:1]
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            out[file] = list(handle.keys())
    return out


def _download(hub_id: str, part: str) -> Path:
    """A hub model's ``part`` folder in the local cache (only its config and safetensors weights)."""
    from huggingface_hub import snapshot_download

    if not sd.cli.looks_like_hub_id(hub_id):
        raise FileNotFoundError(f"{hub_id}: no such file or folder (nor a hub id, which reads owner/name)")
    options = sd.model.hub_options(hub_id)
    try:
        return Path(snapshot_download(hub_id, allow_patterns=[f"{part}/config.json", f"{part}/*.safetensors",
                                                              f"{part}/*.safetensors.index.json"], **options))
    except Exception as error:  # the hub's many errors: one line
        offline = "the hub cannot be reached and it is not in the local cache; " if options else ""
        raise FileNotFoundError(f"{hub_id}: cannot be fetched ({sd.cli.first_line(error)}); {offline}give a local "
                                "folder or single file") from None
