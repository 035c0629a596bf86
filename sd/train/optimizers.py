"""What an optimizer means for the rest of a run beyond its step: which weights each consumer sees
(Schedule-Free AdamW's two points), and the optimizer as a checkpoint entry.

Schedule-Free AdamW (``optimizer: adamw_schedulefree``, Defazio et al. 2024) keeps three points per
parameter: ``z`` (the SGD-like iterate, in its state), ``x`` (the running average of ``z``: the
model to evaluate) and ``y = (1 - beta1) z + beta1 x`` (where gradients are taken). In train mode the
parameters hold ``y``; ``x = y + (1 - 1/beta1) (z - y)``. Which weights each consumer of a run sees:

* the training step (forward, backward, clipping, the update): ``y``, the parameters as they are;
* the EMAs: ``x`` (``evaluation_view``), the model the EMA then smooths further; averaging ``y``
  would mix in the noise of ``z``;
* validation loss, the sample grid and the evaluation: ``x`` swapped into the parameters for their
  duration (``evaluation_weights``), ``y`` restored bit for bit after, so validating never moves
  the training trajectory (the EMA's own swap comes inside, over ``x``);
* the checkpoint's weight files (``unet.safetensors``, a LoRA run's ``adapter.safetensors``), which
  ``SD_ImageGen.py``, exports and ``init_from`` read: ``x`` (``EvaluationWeights``), computed beside
  the parameters; ``y`` goes into ``optimizer.pt`` (``OptimizerState``), and a resume puts it back
  after the weight files, so a resumed run continues bit for bit.

Every other optimizer has one point: each function here leaves it as it is, but for ``bf16_weights``
(``MasterWeights``): the UNet's parameters are bf16, the optimizer's are fp32 master copies of them,
and the EMAs and the checkpoint's weight files take the master copies (``evaluation_view``).
"""

from __future__ import annotations

from dataclasses import dataclass

import contextlib
import logging
import math

import torch
from sd.settings import setting, refused, OnResume, FREE, Range, POSITIVE, NON_NEGATIVE, FRACTION, BELOW_ONE, SCHEDULE
from sd.cli import ConfigError

log = logging.getLogger("sd_train")


OPTIMIZERS = ("adamw", "adamw8bit", "prodigy", "adamw_schedulefree")
BLOCK_LR_SCALES = ("down_lr_scale", "mid_lr_scale", "up_lr_scale")  # the UNet blocks' (sd.train.step.BLOCK_SCALES)
PRODIGY_LR = (0.1, 10.0)  # lr scales Prodigy's own estimate: far outside this, it was meant for another optimizer


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer, its hyper-parameters, and the learning rates of groups other than the UNet's."""

    name: str = setting("adamw (fused or foreach, fp32 state: 8 bytes a parameter), adamw8bit (bitsandbytes' "
                        "8-bit state: 2 bytes), prodigy (Prodigy: estimates its own step size, which lr multiplies: set lr "
                        "1.0; 16 bytes) or adamw_schedulefree (Schedule-Free AdamW: no decay after the warm-up, weights "
                        "averaged instead; 8 bytes); see docs/training.md", "adamw", resume=refused("the optimizer"))
    text_encoder_lr: float = setting("peak learning rate of the text encoder's LoRA adapter (lora_text_encoder), its own "
                                     "parameter group; 0 = lr", 0.0, allowed=NON_NEGATIVE, resume=refused(SCHEDULE))
    text_encoder_warmup_steps: int = setting("warm-up steps of the text encoder's adapter; -1 = warmup_steps", -1,
                                             allowed=Range(-1), resume=refused(SCHEDULE))
    down_lr_scale: float = setting("the UNet's down blocks (their weights, or the LoRA adapters in them) train at lr x "
                                   "this, in a parameter group of their own", 1.0, allowed=POSITIVE,
                                   resume=refused(SCHEDULE))
    mid_lr_scale: float = setting("the UNet's middle block at lr x this", 1.0, allowed=POSITIVE,
                                  resume=refused(SCHEDULE))
    up_lr_scale: float = setting("the UNet's up blocks at lr x this (the rest of the UNet: conv_in, the time embedding "
                                 "and the output layers train at lr)", 1.0, allowed=POSITIVE, resume=refused(SCHEDULE))
    block_lr_weights: list = setting("the learning rate of each of the UNet's 25 blocks as a multiple of lr, in the "
                                     "order IN00-IN11, M00, OUT00-OUT11 (kohya's down_lr_weight, mid_lr_weight and "
                                     "up_lr_weight as one list; 0: the block's weights, or the LoRA adapters in them, "
                                     "stay as they start), each block in a parameter group of its own; empty: lr "
                                     "everywhere", default_factory=list, resume=refused(SCHEDULE))
    min_lr_ratio: float = setting("cosine decay ends at lr * min_lr_ratio", 0.01, allowed=FRACTION,
                                  resume=refused(SCHEDULE))
    weight_decay: float = setting("AdamW weight decay", 1e-2, allowed=NON_NEGATIVE, resume=refused("the optimizer"))
    adam_beta1: float = setting("AdamW beta1", 0.9, allowed=BELOW_ONE, resume=refused("the optimizer"))
    adam_beta2: float = setting("AdamW beta2", 0.999, allowed=BELOW_ONE, resume=refused("the optimizer"))
    adam_eps: float = setting("AdamW epsilon", 1e-8, allowed=POSITIVE, resume=refused("the optimizer"))
    bf16_weights: bool = setting("precision bf16, full fine-tuning: keep the UNet's weights and gradients in bf16 (no "
                                 "per-step casts under autocast) with fp32 master weights in AdamW and the EMA "
                                 "(MLPerf's recipe); checkpoints hold the masters. A speed lever not yet measured on "
                                 "a GPU", False, resume=OnResume(FREE, "checkpoints hold fp32 weights either way"))

    def check(self, config, check_paths: bool = True) -> None:
        """The optimizer; the text encoder's learning rate and warm-up need its adapter, the UNet blocks' scales a
        UNet whose blocks train; Prodigy's lr is a multiplier near 1, the same for every parameter group (its one
        step-size estimate is shared by them); ``bf16_weights`` and what it does not run with."""
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"optim.name: one of {', '.join(OPTIMIZERS)}")
        own_schedule = self.text_encoder_lr or self.text_encoder_warmup_steps >= 0
        mode = config.mode
        if own_schedule and not mode.text_encoder_trains:
            raise ConfigError("optim.text_encoder_lr / optim.text_encoder_warmup_steps set the learning rate of the "
                              "text encoder's LoRA adapter: set lora.text_encoder: true (and lora.rank), or leave "
                              "them at 0 / -1")
        scaled = [f"optim.{name}" for name in BLOCK_LR_SCALES if getattr(self, name) != 1]
        self.check_block_weights(scaled)
        scaled += ["optim.block_lr_weights"] if self.block_lr_weights else []
        if scaled and not mode.unet_blocks_train:
            raise ConfigError(f"{', '.join(scaled)} scale the learning rate of the UNet's blocks, which a {mode.what} "
                              f"run leaves frozen: set {' and '.join(scaled)} to 1")
        if self.name == "adamw_schedulefree" and self.adam_beta1 == 0:
            raise ConfigError("optim.name: adamw_schedulefree interpolates with optim.adam_beta1 (its model is an "
                              "average reached through 1 / beta1): set optim.adam_beta1 above 0, e.g. 0.9")
        if self.name == "prodigy":
            self.check_prodigy(config, own_schedule, scaled, mode)
        if self.bf16_weights:
            objective = config.objective
            others = [(config.precision != "bf16", f"precision: bf16 (got {config.precision})"),
                      (self.name != "adamw", f"optimizer: adamw (got {self.name})"),
                      (config.sharding != "none", f"sharding: none (got {config.sharding})"),
                      (not mode.whole_unet, f"full fine-tuning (not a {mode.what} run: its base is frozen in bf16 "
                                            "already)"),
                      (objective.uses_base, f"no {objective.what} (its frozen reference)")]
            needs = [what for failed, what in others if failed]
            if needs:
                raise ConfigError(f"optim.bf16_weights: runs with {', '.join(needs)}; set those, or "
                                  "optim.bf16_weights: false")

    def check_block_weights(self, scaled: list) -> None:
        weights = self.block_lr_weights
        if not weights:
            return
        if len(weights) != 25 or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w < math.inf
                                           for w in weights):
            raise ConfigError(f"optim.block_lr_weights: 25 numbers >= 0 (IN00-IN11, M00, OUT00-OUT11), got "
                              f"{len(weights)} values {weights[:4]}...")
        if scaled:
            raise ConfigError(f"optim.block_lr_weights and {', '.join(scaled)} both set the UNet blocks' learning "
                              "rates: give the blocks' weights alone")

    def check_prodigy(self, config, own_schedule: bool, scaled: list, mode) -> None:
        low, high = PRODIGY_LR
        if not low <= config.lr <= high:
            raise ConfigError("optim.name: prodigy estimates the step size itself and lr multiplies it: set lr: 1.0 "
                              f"(got {config.lr:g}; {low:g} to {high:g} to scale the estimate, which Prodigy's "
                              "authors advise against)")
        if own_schedule and (self.text_encoder_lr not in (0, config.lr)
                             or self.text_encoder_warmup_steps not in (-1, config.warmup_steps)):
            raise ConfigError("optim.name: prodigy steps every parameter group with one learning rate: leave "
                              "optim.text_encoder_lr at 0 and optim.text_encoder_warmup_steps at -1, or use "
                              "optim.name adamw")
        if scaled:
            raise ConfigError("optim.name: prodigy steps every parameter group with one learning rate: set "
                              f"{' and '.join(scaled)} to 1, or use optim.name adamw")
        own = mode.own_learning_rates()
        if own:
            raise ConfigError("optim.name: prodigy steps every parameter group with one learning rate: leave "
                              f"{' and '.join(own)}, or use optim.name adamw")

def is_schedule_free(optimizer) -> bool:
    """Whether ``optimizer`` keeps Schedule-Free's ``y`` in its parameters (its groups' ``train_mode``)."""
    groups = getattr(optimizer, "param_groups", [])
    return bool(groups) and "train_mode" in groups[0] and type(optimizer).__module__.startswith("schedulefree")


def _x_weight(group) -> float:
    """The lerp weight from ``y`` towards ``z`` that gives ``x`` (as ``AdamWScheduleFree.eval`` moves it)."""
    return 1 - 1 / group["betas"][0]


class MasterWeights:
    """``bf16_weights``: the trainable parameters stored in bf16, which the forward and backward read as they
    are (no per-step casts under autocast: 1.7 GB of copies at SD 1.x), with fp32 master copies that the
    optimizer updates (MLPerf's recipe for this UNet). Each step the bf16 gradients, accumulated over the
    micro-batches (and averaged across the GPUs in bf16, as DDP's buckets hold them), are copied into
    fp32 gradients of the masters (``take_gradients``: one buffer, one foreach copy), the optimizer steps the
    masters, and the parameters are set to the masters rounded to bf16 (``put_weights``), which frees the
    fp32 gradients: they exist only from the last backward to the update, not beside the activations."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.master = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in params]
        self._sizes = [m.numel() for m in self.master]
        with torch.no_grad():
            for p in params:
                p.data = p.data.to(torch.bfloat16)
        self._of = {id(p): m for p, m in zip(params, self.master)}
        self._by_address = None

    def zero_grad(self, set_to_none: bool) -> None:
        """The bf16 gradients, before a step's micro-batches (the masters' are overwritten)."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def take_gradients(self) -> None:
        flat = torch.empty(sum(self._sizes), dtype=torch.float32, device=self.master[0].device)
        grads = [g.view_as(m) for g, m in zip(flat.split(self._sizes), self.master)]
        for master, grad in zip(self.master, grads):
            master.grad = grad
        torch._foreach_copy_(grads, [p.grad for p in self.params])

    @torch.no_grad()
    def put_weights(self) -> None:
        torch._foreach_copy_(self.params, self.master)
        for master in self.master:
            master.grad = None

    def master_of(self, tensor: torch.Tensor):
        """The master of a parameter, or of a state dict's tensor that views one; None for any other."""
        if id(tensor) in self._of:
            return self._of[id(tensor)]
        if self._by_address is None:  # a state_dict's tensors are detached views of the parameters
            self._by_address = {p.data_ptr(): m for p, m in zip(self.params, self.master) if p.numel()}
        return self._by_address.get(tensor.data_ptr()) if tensor.numel() else None

    def view(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for tensor in tensors:
            master = self.master_of(tensor)
            out.append(tensor.detach() if master is None else master.detach())
        return out

    @contextlib.contextmanager
    def loading(self):
        """The body sees the masters as the parameters (fp32, the same storage), so weights loaded into the
        model (a resume, ``init_from``) keep every bit; the parameters are rounded to bf16 again after."""
        with torch.no_grad():
            for p, master in zip(self.params, self.master):
                p.data = master.data
        try:
            yield
        finally:
            with torch.no_grad():
                for p, master in zip(self.params, self.master):
                    p.data = master.data.to(torch.bfloat16)
            self._by_address = None  # new storage: state dicts view it from now on


def full_weights(optimizer):
    """``MasterWeights.loading`` under ``bf16_weights``; nothing otherwise."""
    master = getattr(optimizer, "master_weights", None)
    return master.loading() if master is not None else contextlib.nullcontext()


def evaluation_view(optimizer):
    """None for an optimizer whose parameters are the model; for Schedule-Free, a function from a list of
    its parameters (in train mode: ``y``) to their ``x``, new tensors beside them (a parameter without
    state yet is its own ``x``); with ``bf16_weights``, from bf16 parameters to their fp32 masters."""
    master = getattr(optimizer, "master_weights", None)
    if master is not None:
        return master.view
    if not is_schedule_free(optimizer):
        return None
    weights = {id(p): _x_weight(group) for group in optimizer.param_groups for p in group["params"]}
    params_of = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    by_address = None  # built on first need: a state_dict's tensors are detached views of the parameters

    def owner_of(tensor: torch.Tensor):
        nonlocal by_address
        if id(tensor) in params_of:
            return params_of[id(tensor)]
        if by_address is None:
            by_address = {p.data_ptr(): p for p in params_of.values() if p.numel()}
        return by_address.get(tensor.data_ptr()) if tensor.numel() else None

    def view(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for tensor in tensors:
            owner = owner_of(tensor)
            z = optimizer.state[owner].get("z") if owner is not None and owner in optimizer.state else None
            out.append(tensor.detach() if z is None else
                       torch.lerp(tensor.detach(), z.to(tensor.device), weights[id(owner)]))
        return out

    return view


@contextlib.contextmanager
def evaluation_weights(optimizer):
    """Run the body with Schedule-Free's ``x`` in the parameters (its ``eval()``), then put ``y`` back bit for
    bit (kept in host memory meanwhile) and return to train mode; for other optimizers, nothing."""
    if not is_schedule_free(optimizer) or not optimizer.param_groups[0]["train_mode"]:
        yield
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with torch.no_grad():
        saved = [p.detach().to("cpu", copy=True) for p in params]
    optimizer.eval()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, y in zip(params, saved):
                p.copy_(y)
        for group in optimizer.param_groups:
            group["train_mode"] = True


class EvaluationWeights:
    """A checkpoint entry of weights (a module, ``AdapterWeights``) whose saved tensors are the model to
    evaluate: Schedule-Free's ``x`` in place of the parameters' ``y``, the fp32 masters of ``bf16_weights``
    in place of the bf16 parameters. Loading is the entry's own (and the masters' from the same file): the
    resume's ``OptimizerState`` then puts ``y`` back."""

    def __init__(self, entry, optimizer):
        self.entry, self.optimizer = entry, optimizer

    def state_dict(self) -> dict[str, torch.Tensor]:
        view = evaluation_view(self.optimizer)
        state = self.entry.state_dict()
        if view is None:
            return state
        names = list(state)
        # Host memory: the model's x beside its y would otherwise take a second copy on the device.
        return dict(zip(names, [x.cpu() for x in view([state[n] for n in names])]))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with full_weights(self.optimizer):  # bf16_weights: into the fp32 masters, exactly
            self.entry.load_state_dict(state)


class OptimizerState:
    """The optimizer as a checkpoint entry (``optimizer.pt``): its ``state_dict``, and for Schedule-Free
    the parameters' ``y`` under ``train_weights`` (the weight files hold ``x``).

    A state saved with one parameter group where the optimizer now has two (a LoRA run with a text
    encoder adapter, written before each part had its own group) is split into this optimizer's groups
    in order, each keeping the saved hyper-parameters: the parameters are the same, in the same order.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        state = self.optimizer.state_dict()
        if is_schedule_free(self.optimizer):
            state = {**state, "train_weights": [p.detach() for group in self.optimizer.param_groups
                                                for p in group["params"]]}
        return state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        train_weights = state.pop("train_weights", None)
        self.optimizer.load_state_dict(regrouped(state, self.optimizer.param_groups))
        if not is_schedule_free(self.optimizer):
            return
        if train_weights is None:
            raise KeyError("a Schedule-Free optimizer's state without its train_weights (y)")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if len(train_weights) != len(params):
            raise ValueError(f"{len(train_weights)} train_weights for {len(params)} parameters")
        with torch.no_grad():
            for p, y in zip(params, train_weights):
                p.copy_(y)


def regrouped(state: dict, groups: list[dict]) -> dict:
    """``state`` with its one parameter group split as ``groups`` are (see ``OptimizerState``); any other
    state unchanged (``load_state_dict`` then checks it)."""
    saved = state.get("param_groups", [])
    sizes = [len(group["params"]) for group in groups]
    if len(saved) != 1 or len(groups) < 2 or len(saved[0]["params"]) != sum(sizes):
        return state
    indices, split, start = saved[0]["params"], [], 0
    for group, size in zip(groups, sizes):
        split.append({**saved[0], "params": indices[start : start + size],
                      **({"name": group["name"]} if "name" in group else {})})
        start += size
    log.info("the checkpoint's optim.name state has one parameter group: split into %s",
             ", ".join(str(g.get("name", i)) for i, g in enumerate(groups)))
    return {**state, "param_groups": split}
