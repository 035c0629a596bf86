"""LoRA adapters on the UNet and the text encoder, through PEFT.

An adapter adds ``scale * up(down(x))`` beside a Linear or Conv2d layer (``down``: PEFT's ``lora_A``,
rank ``r`` outputs; ``up``: ``lora_B``, zero at the start, so an adapted model starts equal to its
base); ``scale = alpha / r``. Only the adapter trains: every base parameter is frozen.

Which layers carry one is a list of group names and/or module-name suffixes (``lora_targets``):
``attention`` (the default: the attention projections, as diffusers' LoRA example and most SD 1.x
LoRAs), ``transformer`` (attention plus the feed-forward and the 1x1 projections around each
transformer, kohya's default), ``resnet`` (the ResNet convolutions and the down/up-sampling
convolutions: LoCon), or suffixes such as ``to_q`` or ``ff.net.2``.

A convolution with a kernel larger than 1x1 (the ResNet and sampler convolutions) may take its own
rank and alpha (``lora_conv_rank`` / ``lora_conv_alpha``, kohya's ``conv_dim`` / ``conv_alpha``);
Linear layers and 1x1 convolutions take ``lora_rank`` / ``lora_alpha``, as in kohya's sd-scripts.

LoHa and LoKr (``kind``) are LyCORIS' adapters through PEFT's layers, laid out, scaled and initialised as
LyCORIS' own modules (``lycoris/modules/loha.py``, ``lokr.py``) make them, so that a file of ours means in
LyCORIS, ComfyUI and AUTOMATIC1111 what it meant in training: a LoKr's sides split by LyCORIS'
``factorization`` (its smaller factor first, where PEFT puts a ``lora_factor`` above a side's square root
first), a LoKr of two whole factors at scale 1 ("alpha is ignored in this case", LyCORIS' docs; PEFT
scales it by alpha / r), ``w2`` zero at the start and ``w1`` Kaiming-uniform (PEFT zeroes ``w1``), a
LoHa's ``w1_a`` drawn with std 0.1, ``w1_b`` and ``w2_b`` with std 1 and ``w2_a`` zero (PEFT: Kaiming-uniform
and ``w2_b`` zero, a first product 0.3 sqrt(r * in) times smaller: 11-21 times at rank 4 in SD 1.x).
``LOKR_LAYOUT`` numbers that layout; a run's adapter file records it, and a run trained before it (PEFT's,
layout 1) is rebuilt as it trained.

Adapters live inside the model's modules under PEFT's adapter name ``default``; ``adapter_state``
reads them as a flat dict, ``merge`` folds them into the base weights (for export) and restores
plain layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import sd.cli
import sd.embedding.tokens
import sd.lora.dora
import sd.model
import sd.original_layout
from sd.lora.dora import ADAPTER  # PEFT's adapter name inside the modules

ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
TARGET_GROUPS = {
    "attention": ATTENTION,
    "transformer": ATTENTION + ("ff.net.0.proj", "ff.net.2", "proj_in", "proj_out"),
    "resnet": ("conv1", "conv2", "conv_shortcut", "downsamplers.0.conv", "upsamplers.0.conv"),
}
TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")  # the CLIP text encoder's attention
LAYER_TYPES = (torch.nn.Linear, torch.nn.Conv2d)
LORA_TYPES = {"lora": "LoRA", "loha": "LoHa", "lokr": "LoKr"}  # lora_type: its name in messages
ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".hada_", ".lokr_", ".dora_scale.")  # in the names of every kind's parameters
# How LoKr layers are laid out: 1, PEFT's (runs before this layout was numbered: a lora_factor above a side's
# square root as the first factor, two whole factors at alpha / r); 2, LyCORIS' (the module docstring).
LOKR_LAYOUT = 2
LAYOUT_KEY = "lokr_layout"  # the tensor of a run's adapter file (AdapterWeights) that records it
LOKR_FACTORS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


class LoraError(ValueError):
    pass


def resolve_targets(model, targets) -> list[str]:
    """The full names of the Linear / Conv2d modules of ``model`` that ``targets`` (group names or
    module-name suffixes) select, in model order; a target that selects nothing is an error."""
    layers = [name for name, module in model.named_modules() if isinstance(module, LAYER_TYPES)]
    chosen = set()
    for target in targets:
        found = [n for n in layers for s in TARGET_GROUPS.get(target, (target,)) if n == s or n.endswith("." + s)]
        if not found:
            raise LoraError(f"lora.targets: {target!r} selects no Linear or Conv2d layer; use a group "
                            f"({', '.join(TARGET_GROUPS)}) or a module-name suffix such as to_q or ff.net.2")
        chosen.update(found)
    return [n for n in layers if n in chosen]


def is_spatial_conv(module) -> bool:
    """A convolution whose kernel is larger than 1x1: what kohya calls a conv layer (``conv_dim``); a 1x1
    one is a Linear over the channels and takes the Linear layers' rank."""
    return isinstance(module, torch.nn.Conv2d) and tuple(module.kernel_size) != (1, 1)


def add_lora(model, modules: list[str], rank: int, alpha: float, dropout: float = 0.0, seed: int = 0,
             conv_rank: int = 0, conv_alpha: float = 0.0, kind: str = "lora", factor: int = -1, dora: bool = False,
             layout: int = LOKR_LAYOUT, module_ranks: dict | None = None):
    """Inject a LoRA adapter into ``modules`` of ``model`` and freeze everything else.

    ``conv_rank`` / ``conv_alpha`` (0: ``rank`` / ``alpha``): the rank and alpha of the modules that are
    convolutions with a kernel larger than 1x1. ``down`` is initialised (Kaiming-uniform, seeded by
    ``seed`` without touching the global RNG), ``up`` is zero. ``kind`` (``LORA_TYPES``): loha or lokr
    instead, through PEFT's LoHa / LoKr layers made as LyCORIS makes them (the module docstring; one factor
    starts at zero likewise; lokr's sides split by ``lycoris_factorization(side, factor)``, -1: near the
    square root); ``layout`` 1 builds a LoKr as PEFT does (a run trained before ``LOKR_LAYOUT``).
    ``dora``: each layer also trains a magnitude per input channel (``sd.lora.dora``). ``module_ranks``:
    ``{module: (rank, alpha)}`` of modules at their own rank (``block_layout``). Returns ``model``.
    """
    import re

    from peft import LoHaConfig, LoKrConfig, LoraConfig, inject_adapter_in_model

    conv_rank, conv_alpha = conv_rank or rank, float(conv_alpha or alpha)
    if rank < 1:
        raise LoraError(f"lora rank must be >= 1, got {rank}")
    convs = [name for name in modules if is_spatial_conv(model.get_submodule(name))]
    # PEFT matches a pattern as the end of a module's name after a dot: the escaped full name is that module alone
    patterns = dict(rank_pattern={re.escape(name): conv_rank for name in convs} if conv_rank != rank else {},
                    alpha_pattern={re.escape(name): conv_alpha for name in convs} if conv_alpha != alpha else {})
    for name, (own_rank, own_alpha) in (module_ranks or {}).items():  # per block (block_layout)
        patterns["rank_pattern"][re.escape(name)] = own_rank
        patterns["alpha_pattern"][re.escape(name)] = own_alpha
    if kind == "loha":
        config = LoHaConfig(r=rank, alpha=alpha, target_modules=list(modules), init_weights=True, **patterns)
    elif kind == "lokr":
        config = LoKrConfig(r=rank, alpha=alpha, target_modules=list(modules), decompose_factor=factor,
                            init_weights="lycoris" if layout == LOKR_LAYOUT else True, **patterns)
    else:
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(modules),
                            init_lora_weights=True, **patterns)
    model.requires_grad_(False)
    model.lora_settings = {"rank": rank, "alpha": float(alpha), "dropout": float(dropout), "modules": list(modules),
                           "conv_rank": conv_rank, "conv_alpha": conv_alpha, "kind": kind, "factor": factor,
                           "dora": dora}
    with sd.model._seeded(seed):
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        if kind == "loha":
            for _, layer in lora_layers(model):
                init_loha_as_lycoris(layer)
        elif kind == "lokr":
            set_lokr_layout(model, layout, init=True)
    if dora:
        for _, layer in lora_layers(model):
            sd.lora.dora.add_dora(layer)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))
    return model


def lycoris_factorization(side: int, factor: int = -1) -> tuple[int, int]:
    """LyCORIS' split of a layer's side into the sides of a LoKr's two factors, ``(m, n)`` with ``m * n = side``
    and ``m <= n`` (``lycoris.functional.general.factorization``): ``factor`` and the rest when ``factor`` divides
    ``side`` (in either order: PEFT keeps ``factor`` first even when it is the larger), else the divisor nearest
    the square root that is at most ``factor`` (-1: any)."""
    if factor > 0 and side % factor == 0:
        return min(factor, side // factor), max(factor, side // factor)
    limit = side if factor < 0 else factor
    m = max(d for d in range(1, math.isqrt(side) + 1) if side % d == 0 and d <= limit)
    return m, side // m


@torch.no_grad()
def init_loha_as_lycoris(layer) -> None:
    """A PEFT LoHa layer's factors drawn as LyCORIS' LohaModule draws them: Tucker cores and ``w1_a`` normal
    with std 0.1, ``w1_b`` and ``w2_b`` with std 1, ``w2_a`` zero (the layer adds nothing at the start)."""
    if ADAPTER in layer.hada_t1:
        torch.nn.init.normal_(layer.hada_t1[ADAPTER], std=0.1)
        torch.nn.init.normal_(layer.hada_t2[ADAPTER], std=0.1)
    torch.nn.init.normal_(layer.hada_w1_b[ADAPTER], std=1.0)
    torch.nn.init.normal_(layer.hada_w1_a[ADAPTER], std=0.1)
    torch.nn.init.normal_(layer.hada_w2_b[ADAPTER], std=1.0)
    torch.nn.init.zeros_(layer.hada_w2_a[ADAPTER])


def lokr_layers(model) -> list:
    from peft.tuners.lokr.layer import LoKrLayer

    return [(name, layer) for name, layer in lora_layers(model) if isinstance(layer, LoKrLayer)]


def set_lokr_layout(model, layout: int, init: bool = False) -> None:
    """Lay out every LoKr layer of ``model`` as ``layout`` (``LOKR_LAYOUT``) says: a layer whose factors have
    other shapes gets new ones (drawn as LyCORIS draws them with ``init``, else zero: to be loaded), and each
    its scale (1 for two whole factors in layout 2, else alpha / r). The factor sides are ``lora_settings``'."""
    factor = model.lora_settings["factor"]
    for _, layer in lokr_layers(model):
        _lay_out_lokr(layer, factor, layout, init)
    model.lora_settings["layout"] = layout


def lokr_layout_of(model) -> int | None:
    """The layout of ``model``'s LoKr layers, None when it has none."""
    return model.lora_settings.get("layout", LOKR_LAYOUT) if lokr_layers(model) else None


def _lay_out_lokr(layer, factor: int, layout: int, init: bool) -> None:
    from peft.tuners.lokr.layer import factorization as peft_factorization

    r, alpha = layer.r[ADAPTER], layer.alpha[ADAPTER]
    out_side, in_side, *kernel = layer.get_base_layer().weight.shape
    split = lycoris_factorization if layout == LOKR_LAYOUT else peft_factorization
    (a, b), (c, d) = split(out_side, factor), split(in_side, factor)
    whole = r >= max(b, d) / 2  # LyCORIS' and PEFT's rule: w2 whole when the rank reaches half its larger side
    if kernel:
        wanted = {"lokr_w1": (a, c), **({"lokr_w2": (b, d, *kernel)} if whole else
                                        {"lokr_w2_a": (b, r), "lokr_w2_b": (r, d * math.prod(kernel))})}
    else:
        wanted = {"lokr_w1": (a, c), **({"lokr_w2": (b, d)} if whole else {"lokr_w2_a": (b, r), "lokr_w2_b": (r, d)})}
    present = {name: getattr(layer, name)[ADAPTER] for name in LOKR_FACTORS if ADAPTER in getattr(layer, name)}
    if {name: tuple(p.shape) for name, p in present.items()} != wanted:
        like = next(iter(present.values()))
        for name in present:
            del getattr(layer, name)[ADAPTER]
        layer.create_adapter_parameters(ADAPTER, r, ((a, b), (c, d), *kernel), use_w1=True, use_w2=whole,
                                        use_effective_conv2d=False)
        for name in wanted:
            holder = getattr(layer, name)
            zeros = torch.zeros_like(holder[ADAPTER], device=like.device, dtype=like.dtype)
            holder[ADAPTER] = torch.nn.Parameter(zeros, requires_grad=like.requires_grad)
        if init:
            layer.reset_adapter_parameters_lycoris_way(ADAPTER)
    layer.scaling[ADAPTER] = 1.0 if layout == LOKR_LAYOUT and whole else alpha / r


def is_adapter_name(name: str) -> bool:
    return any(part in name for part in ADAPTER_PARTS)


def has_lora(model) -> bool:
    return any(is_adapter_name(name) for name, _ in model.named_parameters())


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapter tensors by parameter name (``<module>.lora_A.default.weight``, ...)."""
    return {name: p for name, p in model.named_parameters() if is_adapter_name(name)}


@torch.no_grad()
def load_adapter_state(model, state: dict[str, torch.Tensor], where: str = "adapter") -> None:
    """Copy ``state`` into the adapter; its names and shapes must match exactly and its values be finite."""
    own = adapter_state(model)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise KeyError(f"{where} does not match the model's adapter: missing {missing[:3]}, unexpected {unexpected[:3]} "
                       f"({len(missing)} missing, {len(unexpected)} unexpected)")
    check_finite(state, where)
    for name, param in own.items():
        if state[name].shape != param.shape:
            raise ValueError(f"{where}: {name} has shape {tuple(state[name].shape)}, the model {tuple(param.shape)}")
        param.copy_(state[name])


def check_finite(tensors: dict[str, torch.Tensor], where) -> None:
    """A ValueError naming the first tensor of ``tensors`` that holds a NaN or an infinity: merged into
    a model, one such value spreads through every layer after it and every image comes out black."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{where}: {name} holds non-finite values (NaN or inf); the adapter is damaged, "
                             "use an earlier checkpoint or another copy of the file")


def same_base(saved: torch.Tensor, loaded: torch.Tensor) -> bool:
    """Whether two fingerprints of base weights (``sd.run_folder.weights_fingerprint``) are of the
    same weights: equal up to the order in which a device sums in float64."""
    return saved.shape == loaded.shape and torch.allclose(saved.double(), loaded.double(), rtol=1e-9, atol=1e-9)


def lora_layers(model):
    """``(name, layer)`` of every PEFT LoRA, LoHa or LoKr layer of ``model``."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lycoris_utils import LycorisLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, (LoraLayer, LycorisLayer))]


@torch.no_grad()
def merge(model):
    """Fold every adapter into its base weight (``W + scale * up @ down``; with DoRA, its magnitude too) and
    put the plain layer back in place of the LoRA wrapper. Returns ``model``, which then has no adapter."""
    for name, layer in lora_layers(model):
        if sd.lora.dora.has_dora(layer):
            sd.lora.dora.merge(layer)
        else:
            layer.merge(adapter_names=[ADAPTER])
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer.get_base_layer())
    for attribute in ("lora_settings", "peft_config", "_hf_peft_config_loaded"):
        if hasattr(model, attribute):
            try:
                delattr(model, attribute)
            except AttributeError:
                pass
    return model


def effective_alpha(rank: int, alpha: float) -> float:
    """An adapter's alpha as configured (``lora_alpha``): 0 means the rank, a scale of 1."""
    return float(alpha or rank)


def conv_settings(rank: int, alpha: float, conv_rank: int, conv_alpha: float) -> tuple[int, float]:
    """The rank and alpha of the larger-than-1x1 convolutions' adapters as configured: ``lora_conv_rank``,
    0 meaning ``lora_rank``; ``lora_conv_alpha``, 0 meaning ``lora_alpha`` (0 there too: that rank, a
    scale of 1), as kohya's conv_alpha defaults to network_alpha."""
    conv_rank = conv_rank or rank
    return conv_rank, effective_alpha(conv_rank, conv_alpha or alpha)


@dataclass(frozen=True)
class LoraSettings:
    """The config fields a LoRA run's adapters are built from."""

    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_conv_rank: int = 0
    lora_conv_alpha: float = 0.0
    lora_targets: tuple = ("attention",)
    lora_dropout: float = 0.0
    lora_text_encoder: bool = False
    lora_type: str = "lora"
    lora_factor: int = -1
    dora: bool = False
    lora_block_dims: tuple = ()
    lora_block_alphas: tuple = ()
    seed: int = 0
    precision: str = "bf16"

    @classmethod
    def from_config(cls, config) -> "LoraSettings":
        return sd.cli.view_of(cls, config)


def block_layout(unet, modules: list[str], alpha: float, block_dims, block_alphas
                 ) -> tuple[list[str], dict[str, tuple[int, float]]]:
    """``(modules, {module: (rank, alpha)})`` with kohya's per-block ranks (``block_dims``: 25 values, IN00-IN11,
    M00, OUT00-OUT11; ``block_alphas`` likewise, or empty: ``alpha``): a block at 0 loses its modules, the others
    take its rank; the convolutions larger than 1x1 and the modules outside the blocks keep the run's own."""
    if not block_dims:
        return list(modules), {}
    dims = dict(zip(sd.original_layout.BLOCKS, block_dims))
    alphas = dict(zip(sd.original_layout.BLOCKS, block_alphas or [alpha] * len(block_dims)))
    block_of = sd.original_layout.unet_blocks(unet.config)
    kept, ranks = [], {}
    for name in modules:
        block = block_of(name)
        if block is None or is_spatial_conv(unet.get_submodule(name)):
            kept.append(name)
        elif dims[block] > 0:
            kept.append(name)
            ranks[name] = (int(dims[block]), effective_alpha(int(dims[block]), float(alphas[block])))
    if not kept:
        raise LoraError("lora.block_dims: every block of the targets is 0: no layer keeps an adapter")
    return kept, ranks


def apply_settings(settings: LoraSettings, unet, text_encoder, layout: int = LOKR_LAYOUT) -> None:
    """Add the adapters a training config asks for (``lora_rank`` > 0): on the UNet's ``lora_targets``
    (its larger-than-1x1 convolutions at ``lora_conv_rank`` / ``lora_conv_alpha``) and, with
    ``lora_text_encoder``, on the text encoder's attention projections; a LoKr laid out as ``layout``.

    With bf16 or fp16 precision the frozen base weights are then stored in that type (half their
    memory: autocast computes the layers in it anyway); the adapters stay fp32.
    """
    if not settings.lora_rank:
        return
    rank = settings.lora_rank
    alpha = effective_alpha(rank, settings.lora_alpha)
    conv_rank, conv_alpha = conv_settings(rank, settings.lora_alpha, settings.lora_conv_rank, settings.lora_conv_alpha)
    kind = dict(kind=settings.lora_type, factor=settings.lora_factor, dora=settings.dora, layout=layout)
    modules, ranks = block_layout(unet, resolve_targets(unet, list(settings.lora_targets)), alpha,
                                  settings.lora_block_dims, settings.lora_block_alphas)
    add_lora(unet, modules, rank, alpha, settings.lora_dropout, seed=settings.seed, conv_rank=conv_rank,
             conv_alpha=conv_alpha, module_ranks=ranks, **kind)
    if settings.lora_text_encoder:
        add_lora(text_encoder, resolve_targets(text_encoder, TEXT_TARGETS), rank, alpha, settings.lora_dropout,
                 seed=settings.seed + 1, **kind)
    else:
        text_encoder.requires_grad_(False)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(settings.precision)
    if dtype is not None:
        for model in (unet, text_encoder):
            cast_base(model, dtype)


@torch.no_grad()
def cast_base(model, dtype: torch.dtype) -> None:
    """Store the frozen (non-adapter) floating-point parameters of ``model`` in ``dtype``; a learned token's
    rows (``sd.embedding.tokens``: pivotal tuning trains them beside the adapters) stay fp32."""
    learned = {id(layer.vectors) for layer in sd.embedding.tokens.added_embeddings(model)} \
        if hasattr(model, "get_input_embeddings") else set()
    for name, param in model.named_parameters():
        if not is_adapter_name(name) and param.is_floating_point() and id(param) not in learned:
            param.data = param.data.to(dtype)


def trainable_count(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class AdapterWeights:
    """The trained adapters of a run as one flat dict of tensors (``unet.``/``text_encoder.`` +
    parameter name): what a LoRA run's checkpoints hold instead of the full UNet. With LoKr layers it also
    holds their layout (``LAYOUT_KEY``, 0-d); a file with LoKr tensors and none is layout 1.

    Loading lays the LoKr layers out as the state's layout says (their scales, and new factors where the
    shapes differ) when ``relayout`` allows it: never while training, whose optimizer holds the factors the
    run was built with (``resumed_lokr_layout`` builds them right for a resume)."""

    def __init__(self, relayout: bool = True, **models):
        self.relayout = relayout
        self.models = {prefix: m for prefix, m in models.items() if m is not None and has_lora(m)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"{prefix}.{name}": p for prefix, m in self.models.items() for name, p in adapter_state(m).items()}
        layouts = {lokr_layout_of(m) for m in self.models.values()} - {None}
        if layouts:
            state[LAYOUT_KEY] = torch.tensor(max(layouts), dtype=torch.int32)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        state = dict(state)
        layout = state.pop(LAYOUT_KEY, None)
        layout = int(layout) if layout is not None else 1 if any(".lokr_" in k for k in state) else LOKR_LAYOUT
        for model in self.models.values():
            if lokr_layout_of(model) not in (None, layout):
                if not self.relayout:
                    raise ValueError(f"adapter weights of LoKr layout {layout}, the run's layers are laid out as "
                                     f"{lokr_layout_of(model)}")
                set_lokr_layout(model, layout)
        check_finite(state, "adapter weights")  # named as the file names them
        for prefix, model in self.models.items():
            mine = {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}
            load_adapter_state(model, mine, f"adapter weights ({prefix})")
        known = tuple(p + "." for p in self.models)
        stray = [k for k in state if not k.startswith(known)]
        if stray:
            raise KeyError(f"adapter weights hold tensors of no adapted model: {stray[:3]}")
