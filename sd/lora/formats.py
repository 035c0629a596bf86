"""LoRA files other tools load, read, written and merged.

* ``save_lora`` / ``save_model_lora`` write the kohya / AUTOMATIC1111 layout (``lora_unet_...``, the
  default: ComfyUI, AUTOMATIC1111, sd-scripts and diffusers all load it) or diffusers' own
  (``pytorch_lora_weights.safetensors``); ``read_lora`` reads either; ``merge_lora`` adds one to a
  model's weights; ``merge_adapters`` folds a run's own adapter and any LoRA files into a sampling
  pipeline (``SD_ImageGen.py --lora``). Non-finite weights are refused wherever a LoRA is read.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import NamedTuple

import torch

import sd.embedding.tokens
import sd.files
import sd.lora.adapters
import sd.lora.dora
import sd.metadata
import sd.original_layout
from sd.cli import first_line

log = logging.getLogger("sd_lora")

# # Both layouts hold, per adapted layer, ``down`` (r, in[, kh, kw]) and ``up`` (out, r[, 1, 1]) with
# ``W' = W + (alpha / r) * up @ down``:
#   kohya      one FILE.safetensors: lora_unet_<module with _>.lora_down.weight, .lora_up.weight, .alpha
#              (a 0-d tensor; without it alpha = r); text encoder lora_te_text_model_encoder_layers_...
#              Layers of more than one rank (LoCon) are written with alpha / r folded into up.
#   diffusers  FOLDER/pytorch_lora_weights.safetensors: unet.<module>.lora_A.weight (down), .lora_B.weight
#              (up), text_encoder.text_model.<module>...; alpha in the header's ``lora_adapter_metadata``
#              (a JSON LoraConfig per part), without it alpha = r. Written with alpha / r folded into up.
# A conv layer's ``down`` is a conv of the layer's kernel (3x3 or 1x1), its ``up`` a 1x1 conv.
# In memory an adapter is ``{part: {module name: LoraModule}}``, part "unet" or "text_encoder", the
# module names as our models spell them (transformers 5's CLIPTextModel has no ``text_model.``).

LORA_FORMATS = ("kohya", "diffusers")
BUNDLE_PREFIX, BUNDLE_KEY = "bundle_emb.", "string_to_param.*"  # AUTOMATIC1111's embeddings inside a LoRA file
DEFAULT_LORA_FORMAT = "kohya"  # the layout every tool loads (diffusers converts it; the others ignore diffusers')
DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"  # what load_lora_weights(FOLDER) looks for first
DIFFUSERS_LORA_METADATA = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
KOHYA_PREFIXES = {"unet": "lora_unet_", "text_encoder": "lora_te_"}


class LoraModule(NamedTuple):
    """One adapted layer: ``W += (alpha / rank) * up @ down`` (with DoRA's ``dora_scale``, then decomposed:
    ``sd.lora.dora.decompose``)."""

    down: torch.Tensor  # (r, in) or (r, in, kh, kw)
    up: torch.Tensor  # (out, r) or (out, r, 1, 1)
    alpha: float
    dora_scale: torch.Tensor | None = None  # (1, in[, 1, 1]); read also (out, 1[, 1, 1])

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def is_spatial_conv(self) -> bool:
        """A convolution's adapter with a kernel larger than 1x1 (kohya's conv_dim / conv_alpha layers)."""
        return self.down.ndim == 4 and tuple(self.down.shape[2:]) != (1, 1)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def delta(self, shape) -> torch.Tensor:
        """``up @ down`` in fp32, reshaped to the layer's weight ``shape`` (a conv's kernel included)."""
        return (self.up.flatten(1).float() @ self.down.flatten(1).float()).reshape(shape)


def tucker(t: torch.Tensor, wa: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """A convolution kernel from a Tucker core ``t`` (r, r, kh, kw) and factors ``wa`` (r, out), ``wb``
    (r, in): sum over p, q of t[p, q] wa[p, o] wb[q, i]."""
    return torch.einsum("pqyx,po,qi->oiyx", t.float(), wa.float(), wb.float())


class HadamardModule(NamedTuple):
    """A LoHa layer (LyCORIS): ``W += (alpha / r) * (w1a @ w1b) * (w2a @ w2b)``, elementwise, r the rows of
    ``w1b``; with Tucker cores ``t1`` / ``t2`` (a convolution) each product is ``tucker(t, wa, wb)``."""

    tensors: dict[str, torch.Tensor]  # hada_w1_a, hada_w1_b, hada_w2_a, hada_w2_b[, hada_t1, hada_t2]
    alpha: float
    dora_scale: torch.Tensor | None = None
    is_spatial_conv: bool = False  # its layer is a convolution larger than 1x1 (its factors 2-D all the same)

    @property
    def rank(self) -> int:
        return self.tensors["hada_w1_b"].shape[0]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def delta(self, shape) -> torch.Tensor:
        t = {k: v.float() for k, v in self.tensors.items()}
        if "hada_t1" in t:
            return (tucker(t["hada_t1"], t["hada_w1_a"], t["hada_w1_b"])
                    * tucker(t["hada_t2"], t["hada_w2_a"], t["hada_w2_b"])).reshape(shape)
        return ((t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])).reshape(shape)


class KroneckerModule(NamedTuple):
    """A LoKr layer (LyCORIS): ``W += scale * kron(W1, W2)``, each factor stored whole (``lokr_w1``,
    ``lokr_w2``) or as a low-rank product (``_a @ _b``; ``W2`` also with a Tucker core ``lokr_t2``). The
    rank is that of ``W2``'s product, else ``W1``'s; with both factors whole the scale is 1 (LyCORIS
    trains them so and stores alpha = r, and ComfyUI and AUTOMATIC1111 ignore alpha), else alpha / rank."""

    tensors: dict[str, torch.Tensor]
    alpha: float
    dora_scale: torch.Tensor | None = None
    is_spatial_conv: bool = False  # as HadamardModule's

    @property
    def rank(self) -> int | None:
        for name in ("lokr_w2_b", "lokr_w1_b"):
            if name in self.tensors:
                return self.tensors[name].shape[0]
        return None

    @property
    def scale(self) -> float:
        return 1.0 if self.rank is None else self.alpha / self.rank

    def delta(self, shape) -> torch.Tensor:
        t = {k: v.float() for k, v in self.tensors.items()}
        w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
        if "lokr_w2" in t:
            w2 = t["lokr_w2"]
        elif "lokr_t2" in t:
            w2 = tucker(t["lokr_t2"], t["lokr_w2_a"], t["lokr_w2_b"])
        else:
            w2 = t["lokr_w2_a"] @ t["lokr_w2_b"]
        if w2.ndim == 4:
            w1 = w1[:, :, None, None]
        return torch.kron(w1.contiguous(), w2.contiguous()).reshape(shape)


LYCORIS_KEYS = {"loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"),
                "lokr": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")}
FOLDED = "lora_alpha_folded"  # the header's note of scales multiplied into a file's weights (its alphas then r)


class Network(NamedTuple):
    """An adapter as it trained, as a kohya-layout header records it (sd-scripts' ``ss_network_dim`` /
    ``ss_network_alpha`` / ``ss_network_args``, LyCORIS' kohya network's arguments)."""

    dim: int  # the rank of the Linear and 1x1 layers
    alpha: float  # their alpha
    conv_dim: int | None = None  # the rank and alpha of the convolutions larger than 1x1; None: none adapted
    conv_alpha: float | None = None
    kind: str = "lora"  # sd.lora.adapters.LORA_TYPES
    factor: int | None = None  # a LoKr's lora_factor (None: unknown)
    dora: bool = False

    @property
    def algo(self) -> str:
        """The algorithm as LyCORIS' kohya network names it (``algo``)."""
        return self.kind if self.kind != "lora" else "locon" if self.conv_dim is not None else "lora"

    @classmethod
    def of_settings(cls, settings: dict, convs: bool) -> "Network":
        """From a model's ``lora_settings`` (``sd.lora.adapters.add_lora``); ``convs``: larger convolutions adapted."""
        return cls(settings["rank"], float(settings["alpha"]), settings["conv_rank"] if convs else None,
                   float(settings["conv_alpha"]) if convs else None, settings["kind"],
                   settings["factor"] if settings["kind"] == "lokr" else None, bool(settings["dora"]))

    @classmethod
    def of_layers(cls, layers: list) -> "Network":
        """From the layers as they trained (before any folding): the Linear and 1x1 layers' rank and alpha, and
        the larger convolutions' (``is_spatial_conv``, which a LoHa's or LoKr's layer is told, its factors being
        2-D) as ``conv_dim`` / ``conv_alpha``. A LoKr layer of two whole factors has no rank: counted where
        no other layer has one."""
        convs = [m for m in layers if m.is_spatial_conv]
        linear = [m for m in layers if not m.is_spatial_conv] or layers
        ranked, ranked_convs = ([m for m in group if m.rank is not None] or group for group in (linear, convs))
        lycoris = [m for m in layers if not isinstance(m, LoraModule)]
        kind = ("loha" if isinstance(lycoris[0], HadamardModule) else "lokr") if lycoris else "lora"
        return cls(_most_common(m.rank or 0 for m in ranked), _most_common(m.alpha for m in ranked),
                   _most_common(m.rank or 0 for m in ranked_convs) if convs else None,
                   _most_common(m.alpha for m in ranked_convs) if convs else None, kind,
                   dora=any(m.dora_scale is not None for m in layers))


def lycoris_of(layer):
    """A PEFT LoHa or LoKr layer (``sd.lora.adapters.add_lora``) as the module its file holds. A LoKr of two
    whole factors is read at scale 1 (ComfyUI, AUTOMATIC1111, LyCORIS) and written with alpha = r, as LyCORIS
    writes it; one that trained at another scale (a run of layout 1, PEFT's alpha / r) has it in ``lokr_w1``."""
    adapter = sd.lora.adapters.ADAPTER
    names = [n for kind in LYCORIS_KEYS.values() for n in kind
             if adapter in getattr(layer, n, {}) and getattr(layer, n)[adapter].numel()]
    tensors = {n: getattr(layer, n)[adapter].detach().cpu() for n in names}
    alpha, rank = float(layer.alpha[adapter]), int(layer.r[adapter])
    spatial = sd.lora.adapters.is_spatial_conv(layer.get_base_layer())
    if any(n.startswith("hada_") for n in names):
        return HadamardModule(tensors, alpha, is_spatial_conv=spatial)
    module = KroneckerModule(tensors, alpha, is_spatial_conv=spatial)
    if module.rank is None:
        scale = float(layer.scaling[adapter])
        if scale != 1.0:
            tensors["lokr_w1"] = (tensors["lokr_w1"].float() * scale).to(tensors["lokr_w1"].dtype)
        module = KroneckerModule(tensors, float(rank), is_spatial_conv=spatial)
    return module


def swapped_lokr_factors(module: KroneckerModule, weight_shape) -> bool:
    """Whether a LoKr's first factor is the larger on a side of its layer's weight: PEFT's split of a side by
    a ``lora_factor`` above its square root (a run of layout 1), which LyCORIS' loader refuses (its
    ``factorization`` puts the smaller first); ComfyUI and AUTOMATIC1111 read it as it is."""
    t = module.tensors
    w1 = t["lokr_w1"].shape if "lokr_w1" in t else (t["lokr_w1_a"].shape[0], t["lokr_w1_b"].shape[1])
    rows, columns = w1[0], w1[1]
    return rows * rows > weight_shape[0] or columns * columns > weight_shape[1]


def lora_file_name(part: str, module: str) -> str:
    """A module's name as LoRA files spell it: the text encoder's from ``text_model.`` (transformers 4's
    CLIPTextModel, kohya, ComfyUI, AUTOMATIC1111 and diffusers' own files all use that layout)."""
    if part == "text_encoder" and not module.startswith("text_model."):
        return "text_model." + module
    return module


def lora_layers_of(model) -> dict[str, torch.nn.Module]:
    """The Linear / Conv2d layers of ``model`` that an adapter can patch, by name; a layer that carries a
    PEFT adapter appears under its own name, as its base layer."""
    wrapped = dict(sd.lora.adapters.lora_layers(model))
    out = {}
    for name, module in model.named_modules():
        if name in wrapped:
            out[name] = module.get_base_layer()
        elif isinstance(module, sd.lora.adapters.LAYER_TYPES) and not set(name.split(".")) & {"base_layer", "lora_A", "lora_B"}:
            out[name] = module
    return out


def adapter_lora_modules(model) -> dict[str, LoraModule]:
    """The PEFT adapter of ``model`` (``sd.lora.adapters.add_lora``) as LoraModules (a LoHa's or LoKr's as
    ``HadamardModule`` / ``KroneckerModule``), detached on the CPU."""
    from peft.tuners.lycoris_utils import LycorisLayer

    out = {}
    for name, layer in sd.lora.adapters.lora_layers(model):
        if isinstance(layer, LycorisLayer):
            out[name] = lycoris_of(layer)
            weight_shape = layer.get_base_layer().weight.shape
            if isinstance(out[name], KroneckerModule) and swapped_lokr_factors(out[name], weight_shape):
                log.warning("%s: its LoKr factors are PEFT's split of lora.factor (a run trained before LyCORIS' "
                            "layout was used): ComfyUI and AUTOMATIC1111 read the file, LyCORIS' loader refuses it",
                            name)
        elif getattr(layer, "use_rslora", {}).get(sd.lora.adapters.ADAPTER, False):
            raise ValueError(f"{name}: rank-stabilised LoRA (alpha / sqrt(r)) has no place in these file formats")
        else:
            out[name] = LoraModule(layer.lora_A[sd.lora.adapters.ADAPTER].weight.detach().cpu(),
                                   layer.lora_B[sd.lora.adapters.ADAPTER].weight.detach().cpu(),
                                   float(layer.lora_alpha[sd.lora.adapters.ADAPTER]))
        if sd.lora.dora.has_dora(layer):
            out[name] = out[name]._replace(dora_scale=sd.lora.dora.magnitude(layer).detach().cpu())
    return out


def lora_output(out: str | Path, lora_format: str = DEFAULT_LORA_FORMAT) -> Path:
    """The file ``save_lora`` writes for ``out``: kohya, ``out`` itself when it ends in ``.safetensors``,
    else ``out.safetensors``; diffusers, ``out/pytorch_lora_weights.safetensors`` (``out`` a folder)."""
    out = Path(out)
    if lora_format == "kohya":
        return out if out.suffix == ".safetensors" else out.with_name(out.name + ".safetensors")
    if lora_format == "diffusers":
        return out / DIFFUSERS_LORA_FILE
    raise ValueError(f"LoRA format must be one of {', '.join(LORA_FORMATS)}, got {lora_format!r}")


def save_lora(out: str | Path, lora: dict[str, dict[str, LoraModule]], lora_format: str = DEFAULT_LORA_FORMAT,
              metadata: dict | None = None, embeddings: dict[str, torch.Tensor] | None = None,
              network: Network | None = None) -> Path:
    """Write ``lora`` (``{part: {module: LoraModule}}``) in ``lora_format`` to ``lora_output(out)``,
    atomically; returns that file. ``metadata`` (string values) joins the header, beside the rank and
    alpha it records (kohya: and sd-scripts' network keys and content hashes, ``sd.metadata``): those of
    ``network`` (the adapter as it trained; None: as its layers say before any folding), whatever the
    tensors hold after folding, which ``FOLDED`` then notes.
    ``embeddings`` (``{token: (N, D)}``, kohya only): learned tokens bundled as AUTOMATIC1111 reads them,
    ``bundle_emb.<token>.string_to_param.*`` (``BUNDLE_PREFIX``).

    diffusers: each ``up`` holds ``alpha / r`` and the alpha written is r. diffusers 0.32 and older (and
    any reader of PEFT keys that skips the header) take alpha = r: with alpha folded in, every version
    computes the trained weights (rounded once, as in a merge). kohya: the same when the layers differ
    in rank (LoCon's convolutions at another rank than the linear layers): diffusers up to 0.32 (the
    version sd-scripts pins) then reads every layer at alpha = its rank (``_maybe_adjust_config``);
    a file of one rank keeps its alpha, which every reader applies.
    """
    path = lora_output(out, lora_format)
    layers = [m for part in lora.values() for m in part.values()]
    if not layers:
        raise ValueError(f"{out}: no LoRA layers to write")
    lycoris = [m for m in layers if not isinstance(m, LoraModule)]
    if lycoris and lora_format != "kohya":
        raise ValueError(f"{out}: diffusers' LoRA format holds LoRA layers only; write a LoHa or LoKr with "
                         "--lora_format kohya (LyCORIS' layout, which ComfyUI and AUTOMATIC1111 load)")
    if any(m.dora_scale is not None for m in layers) and lora_format != "kohya":
        raise ValueError(f"{out}: diffusers' LoRA format holds DoRA per output channel, which this adapter is not; "
                         "write it with --lora_format kohya (dora_scale, which ComfyUI and AUTOMATIC1111 load)")
    network = network or Network.of_layers(layers)
    header = {"format": "pt", "lora_rank": str(network.dim), "lora_alpha": str(float(network.alpha))}
    if network.conv_dim is not None:
        header.update(lora_conv_rank=str(network.conv_dim), lora_conv_alpha=str(float(network.conv_alpha)))
    header.update({k: str(v) for k, v in (metadata or {}).items()})
    if not lycoris and (lora_format == "diffusers" or len({m.rank for m in layers}) > 1):
        if any(m.alpha != m.rank for m in layers):
            up = "lora_B" if lora_format == "diffusers" else "lora_up"
            header[FOLDED] = (f"each layer's alpha / rank is multiplied into its {up} weight and its alpha written as "
                              "its rank; it trained at the alphas lora_alpha and lora_conv_alpha say")
        lora = fold_alpha(lora)
    if lora_format == "diffusers":
        tensors = _diffusers_lora_tensors(lora)
        header[DIFFUSERS_LORA_METADATA] = json.dumps(
            {f"{part}.{key}": value for part, modules in lora.items() if modules
             for key, value in _peft_config(part, modules).items()}, indent=2, sort_keys=True)
    else:
        tensors = _kohya_lora_tensors(lora)
        header.update(_kohya_header(network))
        for token, vectors in (embeddings or {}).items():
            if "." in token:
                raise ValueError(f"token {token!r}: a '.' splits the names of AUTOMATIC1111's bundled embeddings; "
                                 "write the token with --export_embedding instead")
            tensors[f"{BUNDLE_PREFIX}{token}.{BUNDLE_KEY}"] = vectors.float()
    if embeddings and lora_format != "kohya":
        raise ValueError(f"{out}: learned tokens are bundled in the kohya layout only (AUTOMATIC1111's bundle_emb)")
    from safetensors.torch import save_file

    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    if lora_format == "kohya":
        header.update(sd.metadata.content_hashes(tensors, header))
    sd.files.write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=header))
    return path


def fold_alpha(lora: dict[str, dict[str, LoraModule]]) -> dict[str, dict[str, LoraModule]]:
    """``lora`` with each layer's ``alpha / r`` multiplied into its ``up`` (in fp32, rounded once to its
    dtype) and alpha = r: the same weights for a reader that applies alpha and one that does not."""
    def folded(m: LoraModule) -> LoraModule:
        if m.alpha == m.rank:
            return m
        return m._replace(up=(m.up.float() * (m.alpha / m.rank)).to(m.up.dtype), alpha=float(m.rank))

    return {part: {name: folded(m) for name, m in modules.items()} for part, modules in lora.items()}


def save_model_lora(out: str | Path, unet, text_encoder=None, lora_format: str = DEFAULT_LORA_FORMAT,
                    metadata: dict | None = None, embeddings: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the PEFT adapters of ``unet`` (and ``text_encoder``) in ``lora_format``, with ``embeddings``
    bundled; see ``save_lora``.

    The header records the targets (``lora_settings['targets']``, else the adapted modules) and whether
    the text encoder carries an adapter.
    """
    models = {"unet": unet, "text_encoder": text_encoder}
    lora = {part: adapter_lora_modules(m) for part, m in models.items() if m is not None and sd.lora.adapters.has_lora(m)}
    if not lora:
        raise ValueError("the model carries no LoRA adapter")
    settings = getattr(unet, "lora_settings", None) or {}
    targets = settings.get("targets") or sorted(lora.get("unet", {}))
    header = {"lora_targets": json.dumps(list(targets)), "lora_text_encoder": str("text_encoder" in lora),
              **(metadata or {})}
    layers = [layer for m in models.values() if m is not None for _, layer in sd.lora.adapters.lora_layers(m)]
    if any(_whole_lokr_scale(layer) != 1.0 for layer in layers):
        header[FOLDED] = ("the scale of each LoKr layer of two whole factors (alpha / rank: it trained with PEFT's "
                          "layout) is multiplied into its lokr_w1 and its alpha written as its rank")
    network = None
    if settings and sd.lora.adapters.has_lora(unet):
        convs = any(sd.lora.adapters.is_spatial_conv(layer.get_base_layer()) for layer in layers)
        network = Network.of_settings(settings, convs)
    return save_lora(out, lora, lora_format, header, embeddings, network)


def _whole_lokr_scale(layer) -> float:
    """The scale a LoKr layer of two whole factors trained at (1 in LyCORIS' layout); 1 for any other layer."""
    adapter = sd.lora.adapters.ADAPTER
    if adapter in getattr(layer, "lokr_w1", {}) and adapter in getattr(layer, "lokr_w2", {}):
        return float(layer.scaling[adapter])
    return 1.0


def _most_common(values):
    from collections import Counter

    return Counter(values).most_common(1)[0][0]


def _diffusers_lora_tensors(lora) -> dict[str, torch.Tensor]:
    tensors = {}
    for part, modules in lora.items():
        for name, m in modules.items():
            key = f"{part}.{lora_file_name(part, name)}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = m.down, m.up
    return tensors


def _peft_config(part: str, modules: dict[str, LoraModule]) -> dict:
    """The LoraConfig arguments that rebuild ``modules`` in diffusers' ``load_lora_weights``, as its
    ``lora_adapter_metadata`` holds them (what newer diffusers' ``save_lora_weights`` writes and
    ``load_lora_weights`` reads; ``save_lora`` folds alpha in first, so the alpha recorded is r, what
    older versions assume).
    Text-encoder targets are named without ``text_model.``: PEFT matches them as suffixes, so they
    fit transformers 4's CLIPTextModel and 5's flattened one alike.
    """
    import re

    r = _most_common(m.rank for m in modules.values())
    alpha = _most_common(m.alpha for m in modules.values())
    names = {name: name.removeprefix("text_model.") if part == "text_encoder" else name for name in modules}
    return {"r": r, "lora_alpha": alpha, "target_modules": sorted(names.values()),
            "rank_pattern": {re.escape(names[n]): m.rank for n, m in modules.items() if m.rank != r},
            "alpha_pattern": {re.escape(names[n]): m.alpha for n, m in modules.items() if m.alpha != alpha}}


def _kohya_lora_tensors(lora) -> dict[str, torch.Tensor]:
    tensors = {}
    for part, modules in lora.items():
        for name, m in modules.items():
            key = KOHYA_PREFIXES[part] + lora_file_name(part, name).replace(".", "_")
            if f"{key}.alpha" in tensors:
                raise ValueError(f"{part} layer {name}: its kohya name {key} is taken by another layer")
            if isinstance(m, LoraModule):
                tensors[f"{key}.lora_down.weight"], tensors[f"{key}.lora_up.weight"] = m.down, m.up
            else:  # LyCORIS' names are PEFT's (hada_w1_a..., lokr_w1...), its conv factors 2-D alike
                tensors.update({f"{key}.{n}": t for n, t in m.tensors.items()})
            tensors[f"{key}.alpha"] = torch.tensor(float(m.alpha), dtype=torch.float32)
            if m.dora_scale is not None:
                tensors[f"{key}.dora_scale"] = m.dora_scale
    return tensors


NETWORK_KEYS = ("ss_network_module", "ss_network_dim", "ss_network_alpha", "ss_network_args")  # _kohya_header's


def _kohya_header(network: Network) -> dict[str, str]:
    """sd-scripts' own header fields (AUTOMATIC1111 shows them, and takes a file with any header for SD 1.x):
    ``ss_network_dim`` / ``ss_network_alpha``, the Linear and 1x1 layers' rank and alpha as they trained, and
    the network's arguments (``ss_network_args``, JSON, every value a string, the way sd-scripts records
    them): ``conv_dim`` / ``conv_alpha`` when larger convolutions are adapted (sd-scripts' networks.lora and
    LyCORIS take both); a LoHa, LoKr or DoRA file names LyCORIS' network and its arguments (``algo``,
    lokr's ``factor``, ``dora_wd`` and ``wd_on_output``), as LyCORIS' kohya network reads them."""
    lycoris = network.kind != "lora" or network.dora
    args = {"algo": network.algo} if lycoris else {}
    if network.conv_dim is not None:
        args.update(conv_dim=str(network.conv_dim), conv_alpha=str(float(network.conv_alpha)))
    if network.kind == "lokr" and network.factor is not None:
        args["factor"] = str(network.factor)
    if network.dora:
        args.update(dora_wd="True", wd_on_output="False")
    header = {"ss_network_module": "lycoris.kohya" if lycoris else "networks.lora",
              "ss_network_dim": str(network.dim), "ss_network_alpha": str(float(network.alpha)), "ss_v2": "False",
              "ss_base_model_version": "sd_v1"}
    if args:
        header["ss_network_args"] = json.dumps(args)
    return header


def sd_scripts_usage(path: str | Path) -> str:
    """How sd-scripts loads the LoRA file ``path``, from its header (``_kohya_header``): its network module
    (``lycoris.kohya`` for a LoHa, LoKr or DoRA, ``networks.lora`` for a LoRA or LoCon) and the arguments that
    rebuild the network as it trained (``--network_dim`` / ``--network_alpha`` and ``--network_args``: the
    ``algo``, ``conv_dim`` / ``conv_alpha``... of ``ss_network_args``), as train_network.py takes them to go on
    training it; diffusers' layout, which sd-scripts does not read, says so."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata() or {}
    module = header.get("ss_network_module")
    if not module:
        return "sd-scripts reads the kohya layout only: write it with --lora_format kohya for sd-scripts"
    args = json.loads(header.get("ss_network_args") or "{}")
    flags = (f"--network_module {module} --network_weights {path} --network_dim {header.get('ss_network_dim')} "
             f"--network_alpha {header.get('ss_network_alpha')}")
    if args:
        flags += " --network_args " + " ".join(f'"{key}={value}"' for key, value in args.items())
    return f"sd-scripts loads it with {flags}"


LORA_KEY_KINDS = {**{f".{name}": name for names in LYCORIS_KEYS.values() for name in names},
                  ".dora_scale": "dora_scale", ".lora_down.weight": "down", ".lora_up.weight": "up", ".alpha": "alpha",
                  ".lora_A.weight": "down", ".lora_B.weight": "up"}


def lora_file(path: str | Path) -> Path:
    """The weights file of a LoRA: ``path`` itself, or a diffusers folder's pytorch_lora_weights.safetensors."""
    path = Path(path)
    if path.is_dir():
        path = path / DIFFUSERS_LORA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"LoRA file {path} is missing")
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: LoRA files are read as .safetensors only (a pickle can run code when loaded)")
    return path


def read_lora(path: str | Path, unet, text_encoder=None,
              tensors: dict | None = None) -> dict[str, dict[str, LoraModule]]:
    """A LoRA file in either format (or a diffusers LoRA folder) as ``{part: {module: LoraModule}}`` for
    ``unet`` and ``text_encoder``'s own module names.

    Keys: kohya's ``lora_unet_`` / ``lora_te_`` names, diffusers' ``unet.`` / ``text_encoder.`` ones, or
    PEFT's without a prefix (UNet); a kohya-named layer may also be LyCORIS' LoHa (``hada_*``) or LoKr
    (``lokr_*``), read as ``HadamardModule`` / ``KroneckerModule``; any may carry DoRA's ``dora_scale``
    (per input channel, as written here, or per output channel: ``sd.lora.dora``).
    kohya names are looked up in a table built from the models' own module names (an underscore there may
    stand for a dot or be part of a name, so a name is never split). A key of no layer, a layer's down
    without its up, a tensor that does not fit its layer, or a NaN or infinity in any tensor or alpha is a
    ValueError naming the file. ``tensors``: the file's tensors when read already.
    """
    file = lora_file(path)
    tensors = {k: v for k, v in (sd.files.read_weights(file) if tensors is None else tensors).items()
               if not k.startswith(BUNDLE_PREFIX)}  # tokens: read_bundled_embeddings
    sd.lora.adapters.check_finite(tensors, file)
    models = {part: m for part, m in (("unet", unet), ("text_encoder", text_encoder)) if m is not None}
    layers = {part: lora_layers_of(m) for part, m in models.items()}
    names = _lora_name_table(layers)
    pieces, unknown = {}, []
    for key, tensor in tensors.items():
        suffix = next((s for s in LORA_KEY_KINDS if key.endswith(s)), None)
        target = names.get(key[:-len(suffix)]) if suffix else None
        if target is None:
            unknown.append(key)
        else:
            pieces.setdefault(target, {})[LORA_KEY_KINDS[suffix]] = tensor
    if unknown:
        raise ValueError(f"{file}: {len(unknown)} of its {len(tensors)} keys name no LoRA layer of this model, e.g. "
                         f"{sorted(unknown)[:3]}; another architecture, or an adapter other than LoRA, LoHa and "
                         "LoKr?")
    if not pieces:
        raise ValueError(f"{file}: holds no LoRA tensors")
    configs = _diffusers_lora_configs(file)
    out = {}
    for (part, module), piece in pieces.items():
        where = f"{file}: {part} layer {module}"
        weight = layers[part][module].weight
        magnitude = piece.pop("dora_scale", None)
        kinds = [kind for kind, names in LYCORIS_KEYS.items() if any(name in piece for name in names)]
        if kinds:
            layer = lycoris_module(kinds, piece, weight, where)
        elif "down" not in piece or "up" not in piece:
            raise ValueError(f"{where} has no {'up' if 'down' in piece else 'down'} weight")
        else:
            down, up = piece["down"], piece["up"]
            check_lora_fits(weight, down, up, where)
            alpha = piece["alpha"].item() if "alpha" in piece else _metadata_alpha(configs.get(part), module, down.shape[0])
            if not math.isfinite(alpha):
                raise ValueError(f"{where} has a non-finite alpha ({alpha}) in its header")
            layer = LoraModule(down, up, float(alpha))
        if magnitude is not None:
            if sd.lora.dora.axis_of(magnitude, weight.shape) is None:
                raise ValueError(f"{where}: its dora_scale {tuple(magnitude.shape)} fits neither the inputs nor the "
                                 f"outputs of its weight {tuple(weight.shape)}")
            layer = layer._replace(dora_scale=magnitude)
        out.setdefault(part, {})[module] = layer
    return out


def read_bundled_embeddings(path: str | Path, tensors: dict | None = None) -> dict[str, torch.Tensor]:
    """The learned tokens a LoRA file bundles (``bundle_emb.<token>.<key>``, as AUTOMATIC1111 reads them): one
    ``(N, D)`` tensor per token; a token of several tensors (another architecture's) or with non-finite values
    is a ValueError naming the file. ``tensors``: the file's tensors when read already."""
    file = lora_file(path)
    found: dict[str, list[torch.Tensor]] = {}
    for key, tensor in (sd.files.read_weights(file) if tensors is None else tensors).items():
        if key.startswith(BUNDLE_PREFIX):
            token, _, _ = key[len(BUNDLE_PREFIX):].partition(".")
            found.setdefault(token, []).append(tensor)
    sd.lora.adapters.check_finite({f"{BUNDLE_PREFIX}{t}": v for t, vs in found.items() for v in vs}, file)
    out = {}
    for token, tensors in found.items():
        if len(tensors) != 1:
            raise ValueError(f"{file}: the bundled embedding {token!r} holds {len(tensors)} tensors; an SD 1.x token "
                             "has one (N, D)")
        out[token] = tensors[0].float().reshape(-1, tensors[0].shape[-1])
    return out


def lycoris_module(kinds: list[str], piece: dict[str, torch.Tensor], weight: torch.Tensor, where: str):
    """A LoHa or LoKr layer from its tensors (``piece``, by key suffix), checked whole and fitting ``weight``:
    its delta is built once here, so a file that does not fit is refused before anything is merged."""
    if len(kinds) > 1 or "down" in piece or "up" in piece:
        raise ValueError(f"{where}: holds the tensors of more than one kind of adapter")
    alpha = piece["alpha"].item() if "alpha" in piece else None
    tensors = {k: v for k, v in piece.items() if k != "alpha"}
    spatial = weight.ndim == 4 and tuple(weight.shape[2:]) != (1, 1)
    if kinds == ["loha"]:
        needed = {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"} | ({"hada_t2"} if "hada_t1" in tensors else set())
        module = HadamardModule(tensors, 0.0, is_spatial_conv=spatial)
    else:
        needed = ({"lokr_w1"} if "lokr_w1" in tensors else {"lokr_w1_a", "lokr_w1_b"}) | (
            {"lokr_w2"} if "lokr_w2" in tensors else {"lokr_w2_a", "lokr_w2_b"})
        module = KroneckerModule(tensors, 0.0, is_spatial_conv=spatial)
    missing = sorted(needed - set(tensors))
    if missing:
        raise ValueError(f"{where}: a {kinds[0]} layer without {', '.join(missing)}")
    if alpha is None:  # no alpha: scale 1, as ComfyUI and AUTOMATIC1111 take it (a stored 0: no change)
        alpha = float(module.rank or 1)
    if not math.isfinite(alpha):
        raise ValueError(f"{where}: non-finite alpha {alpha}")
    module = module._replace(alpha=float(alpha))
    try:
        delta = module.delta(weight.shape)
    except RuntimeError as error:
        raise ValueError(f"{where}: its {kinds[0]} tensors {({k: tuple(v.shape) for k, v in tensors.items()})} do not "
                         f"make its weight's shape {tuple(weight.shape)} ({first_line(error)})") from error
    if tuple(delta.shape) != tuple(weight.shape):
        raise ValueError(f"{where}: its {kinds[0]} tensors make {tuple(delta.shape)}, not {tuple(weight.shape)}")
    return module


def _lora_name_table(layers: dict[str, dict]) -> dict[str, tuple[str, str]]:
    """Every spelling of every layer's name in LoRA files -> ``(part, module)``."""
    table = {}
    for part, modules in layers.items():
        for name in modules:
            spelled = lora_file_name(part, name)
            table[KOHYA_PREFIXES[part] + spelled.replace(".", "_")] = (part, name)
            table[f"{part}.{spelled}"] = table[f"{part}.{name}"] = (part, name)
            if part == "unet":  # PEFT's own keys, as UNet2DConditionModel.save_lora_adapter writes them
                table[name] = (part, name)
    return table


def check_lora_fits(weight: torch.Tensor, down: torch.Tensor, up: torch.Tensor, where: str) -> None:
    """``down`` / ``up`` make a delta of ``weight``'s shape: a Linear's, or a conv's whose ``down`` has the
    layer's kernel (a 1x1 layer also takes 2-D tensors, a Linear 1x1 ones); else a ValueError."""
    rank, out_channels, in_channels, kernel = down.shape[0], weight.shape[0], weight.shape[1], tuple(weight.shape[2:])
    downs = {(rank, in_channels, *kernel)}
    if kernel in ((), (1, 1)):
        downs |= {(rank, in_channels), (rank, in_channels, 1, 1)}
    if tuple(down.shape) not in downs or tuple(up.shape) not in {(out_channels, rank), (out_channels, rank, 1, 1)}:
        raise ValueError(f"{where}: down {tuple(down.shape)} and up {tuple(up.shape)} do not fit its weight "
                         f"{tuple(weight.shape)}")


def _diffusers_lora_configs(file: Path) -> dict[str, dict]:
    """Per part, the LoraConfig arguments of a diffusers file's ``lora_adapter_metadata`` ({} when none)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        raw = (handle.metadata() or {}).get(DIFFUSERS_LORA_METADATA)
    if not raw:
        return {}
    try:
        config = json.loads(raw)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except ValueError as error:
        raise ValueError(f"{file}: unreadable {DIFFUSERS_LORA_METADATA} ({first_line(error)})") from error
    out = {}
    for key, value in config.items():
        part, _, field = key.partition(".")
        out.setdefault(part, {})[field] = value
    for part, fields in out.items():
        if fields.get("use_dora") or fields.get("lora_bias"):
            raise ValueError(f"{file}: a {part} adapter with DoRA or LoRA biases, which only LoRA layers can merge")
    return out


def _metadata_alpha(config: dict | None, module: str, rank: int) -> float:
    """The alpha PEFT gives ``module`` from a diffusers LoraConfig (as its scale ``alpha / rank``): alpha = r
    without a config; LoraConfig's default alpha 8 when it names none; alpha_pattern as PEFT matches it."""
    import re

    if config is None:
        return float(rank)
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = value
            break
    return alpha * math.sqrt(rank) if config.get("use_rslora") else float(alpha)  # rsLoRA scales by alpha/sqrt(r)


def layer_blocks(unet) -> dict[str, str]:
    """``{module: block}`` of ``unet``'s Linear and Conv2d layers in the original layout's 25 blocks
    (``sd.original_layout.block_of``); the layers outside them are left out."""
    mapping = sd.original_layout.unet_key_map(unet)
    blocks = {}
    for key, original in mapping.items():
        block = sd.original_layout.block_of(original)
        if key.endswith(".weight") and block is not None:
            blocks[key.removesuffix(".weight")] = block
    return blocks


def block_scales(lora: dict, unet, weights: dict[str, float] | None) -> dict[tuple[str, str], float]:
    """Each layer's factor of a block-weight vector (``sd.original_layout.block_weights``): the text encoder's
    ``BASE``, a UNet layer its block's, 1 outside the blocks (AUTOMATIC1111's LoRA Block Weight extension)."""
    if weights is None:
        return {}
    blocks = layer_blocks(unet)
    return {(part, module): weights["BASE"] if part == "text_encoder" else weights.get(blocks.get(module), 1.0)
            for part, modules in lora.items() for module in modules}


@torch.no_grad()
def merge_lora(models: dict, lora: dict[str, dict[str, LoraModule]], scale: float = 1.0,
               blocks: dict[str, float] | None = None) -> None:
    """Add ``scale * m.scale * m.delta`` (a LoRA's ``(alpha / r) up @ down``) to each adapted layer's weight,
    in place; a DoRA layer's change is its decomposed weight's (``sd.lora.dora.decompose``) times ``scale``,
    as ComfyUI and AUTOMATIC1111 apply a strength.

    ``models``: ``{"unet": ..., "text_encoder": ...}``; the sum is taken in fp32 and rounded once to the
    weight's dtype. A layer under a PEFT adapter gets it in its base weight. ``blocks``: a block-weight vector
    (``sd.original_layout.block_weights``) that scales each layer by its block's value too.
    """
    factors = block_scales(lora, models.get("unet"), blocks)
    for part, modules in lora.items():
        if models.get(part) is None:
            raise ValueError(f"a LoRA of the {part} needs a {part} to merge into")
        layers = lora_layers_of(models[part])
        for name, m in modules.items():
            weight = layers[name].weight
            weight.copy_(weight.float() + scale * factors.get((part, name), 1.0) * layer_change(m, weight))


def layer_change(m, weight: torch.Tensor) -> torch.Tensor:
    """What a LoRA, LoHa or LoKr layer ``m`` adds to ``weight`` at strength 1, in fp32: ``(alpha / r) up @
    down``, or with DoRA's magnitude the decomposed weight's change (``sd.lora.dora.decompose``)."""
    delta = m.scale * m.delta(weight.shape).to(weight.device)
    if m.dora_scale is not None:
        delta = sd.lora.dora.decompose(weight, delta, m.dora_scale.to(weight.device))
    return delta


def merge_adapters(pipe, loras: list[tuple]) -> None:
    """Fold the checkpoint's own adapter (a LoRA run's, scale 1) into ``pipe``'s weights, then add each
    ``(file, scale[, block weights])`` LoRA: the plain models that sampling and the full exports use."""
    for part in (pipe.unet, pipe.text_encoder):
        if sd.lora.adapters.has_lora(part):
            sd.lora.adapters.merge(part)
    for path, scale, *blocks in loras:
        blocks = blocks[0] if blocks else None
        tensors = sd.files.read_weights(lora_file(path))  # read once: the adapter's layers and any bundled token
        lora = read_lora(path, pipe.unet, pipe.text_encoder, tensors)
        merge_lora({"unet": pipe.unet, "text_encoder": pipe.text_encoder}, lora, scale, blocks)
        layers = sum(len(modules) for modules in lora.values())
        log.info("merged LoRA %s at scale %g (%d layers)%s", path, scale, layers,
                 f", block weights {','.join(f'{v:g}' for v in blocks.values())}" if blocks else "")
        for token, vectors in read_bundled_embeddings(path, tensors).items():  # a pivotal tuning's token, full strength
            try:
                sd.embedding.tokens.add_token(pipe.tokenizer, pipe.text_encoder, token, vectors)
            except sd.embedding.tokens.EmbeddingError as error:
                raise ValueError(f"{lora_file(path)}: its bundled embedding: {error}") from error
            log.info("added token %s (%d vector(s)) bundled in %s", token, vectors.shape[0], path)
        pipe.source += f" + LoRA {path}:{scale:g}" + (f":{','.join(f'{v:g}' for v in blocks.values())}" if blocks else "")
