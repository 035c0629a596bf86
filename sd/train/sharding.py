"""Training state split across the ranks (``sharding: zero1 | fsdp``), and gathered whole for checkpoints.

``zero1``: the UNet stays DDP-wrapped (every rank holds the weights and the averaged gradients); the
AdamW state is split by ``ZeroRedundancyOptimizer``: each rank steps its share of the parameters and
broadcasts them. ``fsdp``: FSDP2 (``fully_shard``) on each UNet block, then on the UNet itself, instead
of DDP: weights, gradients, AdamW state and the EMA are split along their first dimension, and a
block's weights are gathered just for its forward and backward.

Checkpoints hold whole tensors in the files a ``sharding: none`` run writes, so any run (and every
exporter) reads them. The state objects here gather before rank 0 writes: ``gather()`` is a
collective that every rank calls (``sd.train.checkpoint.save`` calls it on every entry that has one).
A resume loads whole tensors into the plain modules, as an unsharded run does, but for AdamW's state
under fsdp, which stays in host memory as read (``HeldForSharding``); ``shard_unet`` then splits the
weights, the EMA and that state.
"""

from __future__ import annotations

import contextlib

import torch

import sd.train.checkpoint as ckpt
import sd.train.optimizers
from sd.run_folder import is_split
from sd.cli import ConfigError


SHARDINGS = ("none", "zero1", "fsdp")


def check(config) -> None:
    """``sharding`` and the settings it cannot run with, each refused with the way out."""
    name = config.sharding
    if name not in SHARDINGS:
        raise ConfigError(f"sharding: none, zero1 or fsdp, got {name!r}")
    if config.fsdp_reduce_each_micro_batch and name != "fsdp":
        raise ConfigError(f"fsdp_reduce_each_micro_batch: applies to sharding: fsdp (got sharding: {name}); set it "
                          "false, or sharding: fsdp")
    if name == "none":
        return
    if config.optim.name != "adamw":
        raise ConfigError(f"sharding: {name} splits torch's AdamW state; set optim.name: adamw (adamw8bit's state is "
                          "already a quarter of the size; prodigy and adamw_schedulefree run unsharded), or "
                          "sharding: none")
    if name == "fsdp" and config.precision == "fp16":
        raise ConfigError("sharding: fsdp runs precision bf16 or fp32 (fp16's loss scaler is not sharded); set "
                          "precision: bf16, or sharding: zero1")
    if name == "fsdp" and config.channels_last:
        raise ConfigError("sharding: fsdp needs contiguous weights (FSDP2 refuses channels_last convolution "
                          "weights); set channels_last: false, or sharding: zero1")
    if name == "fsdp" and config.eval.every:
        raise ConfigError("sharding: fsdp does not run the in-training evaluation; set eval.every: 0 and score the "
                          "checkpoints with SD_Eval.py, or use sharding: zero1")


def zero_optimizer(params: list, **kwargs):
    """AdamW over ``params`` with its state split across the ranks (ZeRO stage 1)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kwargs)


def local_optimizer(optimizer):
    """The optimizer that steps this rank's parameters: ZeRO's local AdamW, else ``optimizer`` itself."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a split tensor (an FSDP parameter); any other tensor as it is."""
    return tensor.to_local() if is_split(tensor) else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A split tensor gathered whole on every rank (a collective); any other tensor as it is."""
    return tensor.full_tensor() if is_split(tensor) else tensor


# ---------------------------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------------------------


def shard_unet(step) -> torch.nn.Module:
    """Split ``step.unet`` with FSDP2 (each down, mid and up block, then the rest), in place.

    FSDP2 replaces the parameters by DTensors: the optimizer is rebuilt over them, with the state it
    held (a resume's, whole on every rank) split to match; the EMA keeps this rank's slices. Every
    rank holds the same whole weights at this point (one seed, or the same checkpoint), so each keeps
    its slice without communication.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    unet, old = step.unet, step.optimizer
    names = trainable_names(unet, old)
    members, start = [], 0
    for group in old.param_groups:  # by name: fully_shard replaces the parameters
        members.append(names[start : start + len(group["params"])])
        start += len(group["params"])
    loaded = step.held_optimizer_state  # a resume's, in host memory (indices into the trainable parameters)
    step.held_optimizer_state = None
    if loaded is None and old.state:
        loaded = old.state_dict()
    for block in (*unet.down_blocks, unet.mid_block, *unet.up_blocks):
        fully_shard(block)
    fully_shard(unet)
    params = dict(unet.named_parameters())
    settings = {k: old.defaults[k] for k in ("lr", "betas", "eps", "weight_decay", "fused", "foreach")}
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [params[n] for n in group_names]}
              for group, group_names in zip(old.param_groups, members)]
    step.optimizer = type(old)(groups, **settings)
    step.trainable = [p for group in groups for p in group["params"]]
    del old
    if loaded is not None:  # tensor by tensor: each one whole on the device only while it is split
        set_optimizer_state_dict(unet, step.optimizer, by_name(loaded, names),
                                 options=StateDictOptions(full_state_dict=True))
        del loaded
    if step.ema is not None:
        shard_ema(step.ema, unet)
    return unet


def trainable_names(module, optimizer) -> list[str]:
    """The names of the parameters ``optimizer`` updates, in its (and the checkpoint's) index order: group
    by group, each in its order."""
    name_of = {id(p): name for name, p in module.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def by_name(state: dict, names: list[str]) -> dict:
    """An optimizer state dict keyed by parameter index rekeyed by parameter name (``by_index`` undoes it)."""
    return {"state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                             for group in state["param_groups"]]}


def by_index(state: dict, names: list[str]) -> dict:
    """An optimizer state dict keyed by parameter name, keyed by index as ``torch.optim`` writes it."""
    index = {name: i for i, name in enumerate(names)}
    ordered = sorted(state["state"].items(), key=lambda item: index[item[0]])
    return {"state": {index[name]: value for name, value in ordered},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def rows_of(tensor: torch.Tensor, like: "DTensor") -> torch.Tensor:
    """This rank's slice of a whole ``tensor``, as FSDP2 splits ``like`` (``torch.chunk`` of dim 0)."""
    from torch.distributed.tensor import Shard

    if tuple(like.placements) != (Shard(0),):
        raise ValueError(f"expected a parameter split along dim 0, got {like.placements}")
    mesh = like.device_mesh
    chunks = tensor.chunk(mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    part = chunks[rank] if rank < len(chunks) else tensor.new_empty((0, *tensor.shape[1:]))
    if part.shape != like.to_local().shape:
        raise ValueError(f"slice {tuple(part.shape)} != the parameter's {tuple(like.to_local().shape)}")
    return part.clone()


@torch.no_grad()
def shard_ema(ema, unet) -> None:
    """Keep this rank's slice of each EMA tensor: the EMA then averages the parameters' local slices."""
    params = dict(unet.named_parameters())
    ema.shadow = [rows_of(shadow, params[name]) for name, shadow in zip(ema.names, ema.shadow)]
    ema.staging = None


@contextlib.contextmanager
def no_sync(step):
    """A micro-batch whose gradients are accumulated without being averaged across the ranks yet."""
    if step.ddp is not None:
        with step.ddp.no_sync():
            yield
    elif is_sharded(step.unet):
        step.unet.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            step.unet.set_requires_gradient_sync(True)
    else:
        yield


@contextlib.contextmanager
def unsharded(module: torch.nn.Module):
    """The body runs with an FSDP module's weights gathered whole, on every rank at once (a collective
    on entry and exit), so its forwards make no collective: ranks may run different numbers of them
    (the validation batches and sample grid prompts are split unevenly). Other modules: nothing."""
    if not is_sharded(module):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in modules:  # FSDP's own choice: the root keeps its weights from forward to backward
            m.reshard()
            m.set_reshard_after_forward(m is not module, recurse=False)


# ---------------------------------------------------------------------------------------------
# Checkpoint entries: gathered whole before rank 0 writes them
# ---------------------------------------------------------------------------------------------


class HeldForSharding:
    """An fsdp run's AdamW state as a resume reads it, before ``shard_unet``: kept in host memory (``torch.load``
    maps it there) instead of loaded into the optimizer, whose parameters are on the device, which would hold
    the whole state on every GPU (13.8 GB at SD 1.x) until the split."""

    def __init__(self, step):
        self.step = step

    def load_state_dict(self, state: dict) -> None:
        self.step.held_optimizer_state = sd.train.optimizers.regrouped(dict(state), self.step.optimizer.param_groups)


class ZeroState:
    """ZeRO's AdamW state: consolidated on rank 0 for a save (the AdamW ``state_dict`` an unsharded run
    writes), loaded whole on every rank (each keeps its share)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def gather(self) -> None:
        self.optimizer.consolidate_state_dict(to=0)

    def state_dict(self) -> dict:
        state = self.optimizer.state_dict()
        self.optimizer._all_state_dicts = []  # the consolidated copy: the whole AdamW state in host memory
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


class WholeModel:
    """An FSDP module's state dict gathered whole into host memory on rank 0 (the same keys)."""

    def __init__(self, module):
        self.module, self.gathered = module, None

    def gather(self) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self.gathered = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True,
                                                                                    cpu_offload=True))

    def state_dict(self) -> dict:
        return self.gathered


class WholeOptimizer:
    """An optimizer over FSDP parameters, its state gathered whole on rank 0 and keyed by index, as
    ``torch.optim`` keys it (``optimizer.pt`` is the file an unsharded run writes)."""

    def __init__(self, module, optimizer):
        self.module, self.optimizer, self.gathered = module, optimizer, None

    def gather(self) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        state = get_optimizer_state_dict(self.module, self.optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        self.gathered = by_index(state, trainable_names(self.module, self.optimizer)) if state else None

    def state_dict(self) -> dict:
        return self.gathered


class WholeEMA:
    """The EMA's slices gathered whole into host memory on rank 0 (the keys of ``EMA.state_dict``)."""

    def __init__(self, ema, module):
        self.ema, self.module, self.gathered = ema, module, None

    @torch.no_grad()
    def gather(self) -> None:
        from torch.distributed.tensor import DTensor

        params = dict(self.module.named_parameters())
        gathered = {}
        for name, shadow in zip(self.ema.names, self.ema.shadow):
            like = params[name]
            split = DTensor.from_local(shadow.to(like.device), like.device_mesh, like.placements, run_check=False,
                                       shape=like.shape, stride=like.stride())
            gathered[name] = split.full_tensor().cpu()
        self.gathered = gathered if torch.distributed.get_rank() == 0 else None

    def state_dict(self) -> dict:
        return self.gathered


def whole_states(states: dict, step) -> dict:
    """``states`` (recovery's named entries) with the split ones replaced by entries that gather
    them whole for a save; in the same order."""
    states = dict(states)
    if local_optimizer(step.optimizer) is not step.optimizer:
        states["optimizer"] = ZeroState(step.optimizer)
    if is_sharded(step.unet):
        states["unet"] = ckpt.Weights(WholeModel(step.unet))
        if "ema" in states:
            states["ema"] = ckpt.Weights(WholeEMA(step.ema, step.unet))
        states["optimizer"] = WholeOptimizer(step.unet, step.optimizer)
    elif step.sharding == "fsdp":  # a resume, before shard_unet
        states["optimizer"] = HeldForSharding(step)
    return states
