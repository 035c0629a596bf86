"""Predicted device memory of a training step, computed without the device.

``estimate`` builds the configured models on fake tensors (shapes, dtypes and devices; no data),
runs two optimizer steps of ``sd.train.step.train_step`` at the configured batch, precision,
gradient checkpointing, optimizer and EMA placement, and records every storage the step's operators
create: its size (rounded up to 512 bytes, as the CUDA caching allocator rounds), when it was made
and when it was freed. The peak of the live bytes, and what was live at that moment (weights,
gradients, optimizer state, EMA, the frozen text encoder and VAE, activations and temporaries), is
the prediction of ``torch.cuda.max_memory_allocated``. Two allowances turn it into what the card
must hold: the allocator's rounding of blocks into segments and fragmentation (``RESERVE_FACTOR``,
peak reserved / peak allocated), and the CUDA context with its kernels (``CONTEXT_GB``). Two steps,
because the optimizer state is created in the first: the second is the steady state.

Fake tensors run on the CPU device here: PyTorch's CPU-only builds cannot record autograd on fake
CUDA tensors (the autograd engine asks for a CUDA device guard and a current stream that do not
exist without the CUDA library). What differs between the devices is emulated where it changes
memory: ``bf16``/``fp16`` autocast casts the operators CUDA's autocast casts (convolutions, linear
layers, matmuls and attention to the low precision; group and layer norms, softmax and losses to
fp32), caching each weight's cast for the autocast region as CUDA's autocast does; attention runs
the fused kernel, which keeps the output and the log-sum-exp for the backward pass, as the CUDA
kernels do. Not seen: memory inside one operator (cuDNN and attention workspaces), freed before it
returns; the allowances cover it.

Data-parallel runs (``world_size`` > 1) are estimated as the trainer runs them: the UNet wrapped in
DistributedDataParallel by ``sd.train.step.wrap_ddp`` (gradients bound to DDP's buckets, zeroed in
place, ``no_sync`` for all but the last micro-batch), in a process group of torch's fake backend
that needs no peers (``estimation_group``). The buckets are the gradients: one flat buffer per
bucket, allocated when DDP wraps the UNet and live for the whole step, forward pass included.
``sharding: zero1`` is estimated the same way with the trainer's own ``ZeroRedundancyOptimizer`` over
the fake group (``zero_in_group``): rank 0 holds the AdamW state of its share of the parameters only.
``sharding: fsdp`` runs the trainer's FSDP2 on the fake group instead of DDP (``shard_on_fake_tensors``):
weights, gradients, AdamW state and EMA are rank 0's slices (the local tensors of the DTensors), and
each block's weights are gathered into storages FSDP2 resizes in place (``storage_resizes_seen_by``).

``session`` builds the models once and runs a step at any batch; ``max_batch`` finds the largest
micro-batch that fits ``gpu_memory_gb``: the peak grows about linearly with the batch (fixed weights
and states, activations per image), so estimates at 4 and 8 images give a first guess, and a search
from it (``largest_that_fits``) settles the answer on estimates alone.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import logging
import math
import sys
import time
import weakref
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

import sd.cli
import sd.controlnet.model
import sd.data.training_data
import sd.distributed
import sd.model
import sd.runtime
import sd.train.modes
import sd.train.sharding
import sd.train.step
from sd.distributed import Dist
from sd.run_folder import read_saved_config
from sd.train.config import ConfigError, check_models
from sd.train.config_loading import largest_batch_for, resolve_global_batch

log = logging.getLogger("sd_train")

ROUND = {"cuda": 512, "cpu": 64}  # the smallest block: the CUDA caching allocator's, the CPU allocator's alignment
RESERVE_FACTOR = 1.10  # peak reserved / peak allocated allowed for segments and fragmentation
CONTEXT_GB = 0.55  # the CUDA context, cuBLAS/cuDNN handles and loaded kernels, outside the allocator
GB = 1e9
ALIVE = 1 << 62

# The SD 1.x text encoder (CLIP ViT-L/14's text tower), known without its weights.
SD1_TEXT_ENCODER = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                        num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
                        projection_dim=768, bos_token_id=49406, eos_token_id=49407, pad_token_id=49407)


# ---------------------------------------------------------------------------------------------
# Recording allocations
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Record:
    size: int
    born: int
    died: int = ALIVE  # the clock at which it was freed


class Allocations(TorchDispatchMode):
    """Every storage created by an operator under this mode: size, and the operator counts at which it
    was made and freed (its Python storage object dying: the last tensor using it is gone)."""

    def __init__(self, round_to: int = ROUND["cuda"]):
        super().__init__()
        self.round_to = round_to
        self.records: list[Record] = []
        self.of = WeakIdKeyDictionary()  # storage -> [its current Record]
        self.regrown: set[int] = set()  # the records of storages resized up in place (``resized``)
        self.clock = 0
        self.now = 0
        self.peak = 0
        self.peak_at = 0

    def reset_peak(self) -> None:
        self.peak, self.peak_at = self.now, self.clock

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.clock += 1
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        return out

    def track(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):  # a DTensor (fsdp): the storage is its local tensor's,
            for name in tensor.__tensor_flatten__()[0]:  # made by an operator this mode does not see
                if isinstance(inner := getattr(tensor, name), torch.Tensor):
                    self.track(inner)
            return
        storage = tensor.untyped_storage()
        if storage in self.of:
            return
        cell = self.of[storage] = [self._born(storage.nbytes())]  # the storage's current record
        weakref.finalize(storage, self._freed, cell)

    def _born(self, nbytes: int) -> Record:
        record = Record(math.ceil(nbytes / self.round_to) * self.round_to, self.clock)
        self.records.append(record)
        self.now += record.size
        if self.now > self.peak:
            self.peak, self.peak_at = self.now, self.clock
        return record

    def _freed(self, cell: list[Record]) -> None:
        if cell[0].died == ALIVE:
            cell[0].died = self.clock
            self.now -= cell[0].size

    def resized(self, storage, nbytes: int) -> None:
        """A storage resized in place: its bytes freed, and as many as it now holds allocated (FSDP2
        frees each gathered weight so after use, and gathers into the same storage again)."""
        cell = self.of.get(storage)
        if cell is None:
            return
        self.clock += 1
        self._freed(cell)
        if nbytes:
            cell[0] = self._born(nbytes)
            self.regrown.add(id(cell[0]))

    def record_of(self, tensor: torch.Tensor) -> Record | None:
        cell = self.of.get(tensor.untyped_storage())
        return cell[0] if cell is not None else None

    def live_at(self, clock: int) -> list[Record]:
        return [r for r in self.records if r.born <= clock < r.died]


# ---------------------------------------------------------------------------------------------
# CUDA's autocast, emulated where it changes memory
# ---------------------------------------------------------------------------------------------

F = torch.nn.functional
LOW_PRECISION_OPS = {  # CUDA autocast casts these to the autocast dtype
    torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d,
    torch.conv_transpose3d, F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
    torch.Tensor.mm, torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm, torch.addmm,
    torch.Tensor.addmm, F.scaled_dot_product_attention,
}
FP32_OPS = {  # and these to fp32
    F.group_norm, torch.group_norm, F.layer_norm, torch.layer_norm, F.softmax, torch.softmax, torch.Tensor.softmax,
    F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax, F.mse_loss, torch.exp, torch.Tensor.exp,
    torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.rsqrt, torch.Tensor.rsqrt, torch.cumsum,
    torch.Tensor.cumsum,
}


class CudaAutocast(TorchFunctionMode):
    """``torch.autocast("cuda", dtype)`` for tensors of another device: inside a ``region`` the same
    casts on the same operators, each weight (a leaf that requires grad) cast once per region and
    the cast kept until the region ends, as CUDA's autocast caches it; a cast made without autograd is
    not kept (torch's autocast gives the next cast with autograd a gradient). Outside a region, nothing."""

    def __init__(self):
        super().__init__()
        self.dtype: torch.dtype | None = None  # None: outside any region
        self.cache: dict[int, torch.Tensor] = {}
        self.on_cast = lambda cast: None  # told of every cached weight cast (for the breakdown)

    @contextlib.contextmanager
    def region(self, dtype: torch.dtype | None):
        saved = self.dtype, self.cache
        self.dtype, self.cache = dtype, {} if dtype != saved[0] or saved[0] is None else saved[1]
        try:
            yield
        finally:
            self.dtype, self.cache = saved

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.dtype is not None:
            if func in LOW_PRECISION_OPS:
                args, kwargs = self._cast(args, self.dtype), self._cast(kwargs, self.dtype)
            elif func in FP32_OPS:
                args, kwargs = self._cast(args, torch.float32), self._cast(kwargs, torch.float32)
        return func(*args, **kwargs)

    def _cast(self, value, dtype):
        if isinstance(value, torch.Tensor):
            if not value.is_floating_point() or value.dtype in (dtype, torch.float64):
                return value
            if value.is_leaf and value.requires_grad and dtype != torch.float32 and torch.is_grad_enabled():
                cast = self.cache.get(id(value))
                if cast is None:
                    cast = self.cache[id(value)] = value.to(dtype)
                    self.on_cast(cast)
                return cast
            return value.to(dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast(v, dtype) for v in value)
        if isinstance(value, dict):
            return {k: self._cast(v, dtype) for k, v in value.items()}
        return value


def checkpointed_models(unet) -> list:
    """The diffusers models of ``unet`` (a UNet, or a ControlNet's ``ControlledUNet``: the UNet and the
    ControlNet) that checkpoint their blocks."""
    parts = [unet.unet, unet.controlnet] if isinstance(unet, sd.controlnet.model.ControlledUNet) else [unet]
    return [part for part in parts if part.is_gradient_checkpointing]


@contextlib.contextmanager
def as_if_cuda(unet, on_cast=lambda cast: None):
    """Inside: the trainer's autocast regions are CUDA's (emulated), also when gradient checkpointing
    recomputes a block in the backward pass under the region it first ran in."""
    autocast = CudaAutocast()
    autocast.on_cast = on_cast

    def trainer_autocast(precision, device):
        return autocast.region(None if precision == "fp32" else sd.runtime.dtype_of(precision))

    def checkpoint(function, *args):
        dtype = autocast.dtype

        def recompute(*inner):
            # The backward pass runs the recomputation without the modes of the forward pass.
            from torch.overrides import _get_current_function_mode_stack

            active = contextlib.nullcontext() if autocast in _get_current_function_mode_stack() else autocast
            with active, autocast.region(dtype):
                return function(*inner)

        return torch.utils.checkpoint.checkpoint(recompute, *args, use_reentrant=False)

    original = sd.runtime.autocast
    sd.runtime.autocast = trainer_autocast
    for model in checkpointed_models(unet):
        model.enable_gradient_checkpointing(gradient_checkpointing_func=lambda module, *args: checkpoint(module.__call__,
                                                                                                        *args))
    try:
        with autocast:
            yield
    finally:
        sd.runtime.autocast = original


# ---------------------------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Estimate:
    batch_size: int
    resolution: int
    parts: dict  # name -> bytes live at the peak
    allocated: int  # peak allocated bytes (the sum of the parts)
    world_size: int = 1  # GPUs of the run: above 1, the step ran in DDP
    grad_accum: int = 1  # micro-batches of the optimizer step
    sharding: str = "none"  # above 1 GPU, the config's sharding (zero1: AdamW's state split over the GPUs)

    @property
    def reserved(self) -> int:
        return int(self.allocated * RESERVE_FACTOR)

    @property
    def peak_gb(self) -> float:
        """What the card must hold: reserved by the allocator, plus the CUDA context."""
        return self.reserved / GB + CONTEXT_GB

    def as_dict(self) -> dict:
        return {"batch_size": self.batch_size, "resolution": self.resolution, "world_size": self.world_size,
                "grad_accum": self.grad_accum, "sharding": self.sharding,
                "parts_gb": {name: round(size / GB, 3) for name, size in self.parts.items()},
                "allocated_gb": round(self.allocated / GB, 3), "reserved_gb": round(self.reserved / GB, 3),
                "context_gb": CONTEXT_GB, "peak_gb": round(self.peak_gb, 3)}


def frozen_models(config):
    """The text encoder and VAE architectures the config names, with fresh weights (the SD 1.x ones
    for anything but the tiny presets: their shapes are all the estimate needs)."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    if config.text_encoder == "tiny":
        text = CLIPTextConfig(**sd.model.TINY_TEXT_ENCODER)
    elif Path(config.text_encoder).is_dir():  # a local folder's own architecture (a hub id: SD 1.x's)
        subfolder = sd.model._local_subfolder(config.text_encoder, "text_encoder")
        try:
            text = CLIPTextConfig.from_pretrained(config.text_encoder, **({"subfolder": subfolder} if subfolder else {}))
        except (OSError, ValueError) as error:
            raise ConfigError(f"text_encoder: {config.text_encoder}: {sd.cli.first_line(error)}") from None
    else:
        text = CLIPTextConfig(**SD1_TEXT_ENCODER)
    vae = sd.model.TINY_VAE if config.vae == "tiny" else sd.model.SD1_VAE
    return sd.model.frozen(CLIPTextModel(text)), sd.model.frozen(AutoencoderKL(**vae))


@contextlib.contextmanager
def session(config, resolution: int = 512, device: str = "cuda", world_size: int = 1, progress=None):
    """The configured models and step built once on fake tensors; yields ``run(batch_size) -> Estimate``,
    the peak of one steady-state training step at that micro-batch, stepped once per batch size (a
    steady-state step at a batch gives the same estimate whatever ran before it, so a batch asked
    again, as the search and the report do, is not stepped again). ``device``: ``"cuda"`` (CUDA's
    autocast emulated, its allocator's rounding) or ``"cpu"`` (the CPU's own autocast: for comparing
    with a real CPU run). ``world_size`` > 1: the step of one rank of a DDP run of that many GPUs. A step
    accumulates ``accumulation(...)`` micro-batches; at most two are run, as a third and later one repeat
    the second's memory exactly (the gradients exist, the activations are the same). ``progress``, when
    given, is called with each new estimate and the seconds it took, as it is made."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    allocations = Allocations(ROUND[device])
    casts: set[int] = set()
    group = estimation_group(world_size) if world_size > 1 else contextlib.nullcontext()
    with group as process_group, FakeTensorMode(allow_non_fake_inputs=False), allocations, \
            module_moves_of_fake_tensors(), storage_resizes_seen_by(allocations):
        text_encoder, vae = frozen_models(config)
        unet = sd.model.build_unet(config.unet, from_scratch=False, grad_checkpointing=config.grad_checkpointing,
                                   channels_last=config.channels_last).train()
        check_models(config, unet, text_encoder)
        mode = sd.train.modes.mode_of(config)
        mode.estimate_before_data(unet, text_encoder)
        unet = mode.estimate_attach(unet, text_encoder)
        adapters_always_on(unet, text_encoder)
        empty_ids = torch.full((1, sd.model.TOKENIZER_MAX_LENGTH), 49407, dtype=torch.long)
        emulate = as_if_cuda(unet, lambda cast: casts.add(id(allocations.record_of(cast)))) if device == "cuda" \
            else contextlib.nullcontext()
        with emulate, sd.model.attention_context(torch.device("cpu")), HostReadsAsZeros():
            d = Dist(0, world_size, 0, torch.device("cpu"), True, group=process_group)
            with zero_in_group(process_group):
                step = sd.train.step.build_step(config, d, unet, text_encoder, empty_ids, sd.model.SD1_SCALING_FACTOR,
                                                mode)
            if config.optim.name == "prodigy":
                prodigy_reads_on_fake_tensors(step)
            if step.sharding == "fsdp":
                shard_on_fake_tensors(step, process_group)
            elif world_size > 1:
                wrap_ddp_on_fake_tensors(step, allocations)
            if config.cache_text_embeddings:  # the encoder waits in host memory; lookups give fp32 embeddings
                step.text_cache = CachedPrompts(text_encoder.config.hidden_size)
            steps = 0
            per_batch = 2 if step.loss.prior_preservation else 1  # a class image beside each instance
            estimates: dict[int, Estimate] = {}

            def run(batch_size: int) -> Estimate:
                nonlocal steps
                if batch_size in estimates:
                    return estimates[batch_size]
                started = time.perf_counter()
                latent = resolution // 8
                images = batch_size * per_batch
                batches = [(torch.zeros(images, 4, latent, latent, dtype=torch.float16),
                            torch.zeros(images, sd.model.TOKENIZER_MAX_LENGTH, dtype=torch.long),
                            *step.objective.estimate_inputs(images, resolution),
                            *mode.estimate_inputs(images, resolution))
                           for _ in range(min(2, accumulation(config, batch_size, world_size)))]
                if steps == 0:
                    sd.train.step.train_step(step, batches, steps)  # creates the optimizer state
                    steps += 1
                allocations.reset_peak()
                sd.train.step.train_step(step, batches, steps)
                steps += 1
                parts = breakdown(allocations, step, vae, config, casts,
                                  step.ddp.reducer.records if step.ddp is not None else None)
                if step.ddp is not None:  # DDP's one rebuild of its buckets, in whichever step it came
                    at_rebuild = breakdown(allocations, step, vae, config, casts, step.ddp.reducer.records,
                                           at=step.ddp.reducer.moment)
                    parts = max(parts, at_rebuild, key=lambda p: sum(p.values()))
                estimates[batch_size] = Estimate(batch_size, resolution, parts, sum(parts.values()), world_size,
                                                 accumulation(config, batch_size, world_size), step.sharding)
                if progress is not None:
                    progress(estimates[batch_size], time.perf_counter() - started)
                return estimates[batch_size]

            yield run


class CachedPrompts:
    """Stands in for ``sd.train.step.TextCache`` (whose index reads token values): a lookup returns
    the fp32 embeddings a real one gathers."""

    def __init__(self, hidden_size: int):
        self.hidden_size = hidden_size

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], input_ids.shape[1], self.hidden_size)


def accumulation(config, batch_size: int, world_size: int) -> int:
    """Micro-batches per optimizer step at ``batch_size`` on ``world_size`` GPUs, as the trainer resolves
    them: ``global_batch`` / (batch x GPUs) where that is whole (``resolve_global_batch``), else ``grad_accum``."""
    if config.global_batch and config.global_batch % (batch_size * world_size) == 0:
        return config.global_batch // (batch_size * world_size)
    return config.grad_accum


@contextlib.contextmanager
def estimation_group(world_size: int):
    """A process group of ``world_size`` ranks for the estimate's DDP, needing no peer: torch's fake
    backend (its collectives return at once and move nothing, so fake tensors pass through them).
    Yields the group to pass to DDP and the collectives (None: the default group).

    With no process group in this process (``--estimate_memory``), it is the default group while the
    estimate runs, destroyed after. Under torchrun (``batch_size: auto``) the run's real group stays
    the default, untouched: a collective of fake tensors on it would give NCCL or gloo storage that
    does not exist, and every rank would have to match each estimate's collectives. So a fake group
    of the run's own size is made beside it (``new_group`` is called by every rank, as every rank
    estimates) and destroyed after.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # importing it registers "fake"

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
        try:
            yield None
        finally:
            dist.destroy_process_group()
        return
    if dist.get_world_size() != world_size:
        raise ValueError(f"world_size {world_size}: this process's group has {dist.get_world_size()} ranks")
    group = dist.new_group(backend="fake")
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


@contextlib.contextmanager
def zero_in_group(group):
    """``sharding: zero1``'s ``ZeroRedundancyOptimizer``, built inside, in ``group`` (None: the default
    group, as the trainer's). Under torchrun the default group is the run's real one, where the
    optimizer's broadcasts of fake parameters would fail; in the fake group they return at once, and
    its partition (sorted by parameter sizes) and local AdamW read no tensor values."""
    original = sd.train.sharding.zero_optimizer
    if group is not None:
        sd.train.sharding.zero_optimizer = lambda params, **kwargs: original(params, process_group=group, **kwargs)
    try:
        yield
    finally:
        sd.train.sharding.zero_optimizer = original


def shard_on_fake_tensors(step, group) -> None:
    """``sharding: fsdp``'s ``sd.train.sharding.shard_unet`` on fake tensors, ``step.model`` the FSDP2
    UNet. FSDP2 builds its device mesh from the process group with a tensor of the ranks, which it
    searches for this rank (``nonzero``: an output shape a fake tensor cannot know); the mesh is built
    here of real tensors, from ``group`` (None: the default group), and given to every ``fully_shard``.
    The rest runs on fake tensors as it is: the split of each parameter (``chunk`` of dim 0), and the
    all-gathers and reduce-scatters, whose outputs the fake backend allocates and leaves unset."""
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    with unset_fake_temporarily():
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
    original = fsdp.fully_shard
    fsdp.fully_shard = lambda module, **kwargs: original(module, mesh=mesh, **kwargs)
    try:
        step.model = sd.train.sharding.shard_unet(step)
    finally:
        fsdp.fully_shard = original


def wrap_ddp_on_fake_tensors(step, allocations: Allocations) -> None:
    """``sd.train.step.wrap_ddp`` on fake tensors, ``step.model`` the DDP module. Two things of DDP read
    tensor values, which fake tensors do not have: the check that every rank's parameters have the
    same shapes (one process's parameters, here: nothing to check; skipped), and the all-reduce of
    each bucket, whose result the fake backend leaves unset: a comm hook averages the bucket in place,
    as the default hook does (``div_`` then an in-place all-reduce: no memory beside the bucket)."""
    import torch.nn.parallel.distributed as ddp_module

    check = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        step.model = sd.train.step.wrap_ddp(step)
    finally:
        ddp_module._verify_param_shape_across_processes = check
    step.ddp.register_comm_hook(step.d.world_size, average_in_place)
    step.ddp.reducer = BucketsRebuiltOnce(step.ddp, allocations)


class BucketsRebuiltOnce:
    """DDP's reducer as DDP's Python code calls it, with its one rebuild of the buckets emulated.

    DDP starts with all gradients in one bucket, and at the first forward pass after a synchronised
    backward it rebuilds them into buckets of ``first_bucket_bytes_cap``, then ``bucket_bytes_cap``
    bytes in the order the gradients became ready. Each new bucket is allocated and its gradients
    copied in; the old bucket goes once every gradient is rebound, after the last new one: for that
    moment both exist, two copies of the gradients (before that forward pass's activations). The
    reducer's own rebuild reads tensor values (it broadcasts the new assignment); here the new buckets
    are allocated and freed at that moment instead, and the one old bucket stays (the same bytes)."""

    def __init__(self, ddp, allocations: Allocations):
        self.reducer, self.ddp, self.allocations = ddp.reducer, ddp, allocations
        self.synchronised = self.rebuilt = False
        self.buckets: list[torch.Tensor] = []
        self.records: set[int] = set()  # the new buckets' records (for the breakdown)
        self.moment = 0  # the clock at which both the old and the new buckets were live

    def __getattr__(self, name):
        return getattr(self.reducer, name)

    def prepare_for_backward(self, *args):  # called before a synchronised backward only
        self.synchronised = True
        return self.reducer.prepare_for_backward(*args)

    def _rebuild_buckets(self) -> bool:
        if self.rebuilt or not self.synchronised:
            return False
        self.rebuilt = True
        params = [p for p in self.ddp.module.parameters() if p.requires_grad]
        config = self.ddp._bucket_config
        assignment, _ = torch.distributed._compute_bucket_assignment_by_size(
            params[::-1], [config.first_bucket_bytes_cap, config.bucket_bytes_cap], [False] * len(params))
        for bucket in assignment:  # each filled with its gradients (the values do not matter here)
            new = torch.empty(sum(params[len(params) - 1 - i].numel() for i in bucket), dtype=params[0].dtype)
            self.buckets.append(new.zero_())
            self.records.add(id(self.allocations.record_of(new)))
        self.moment = self.allocations.clock - 1  # the last new bucket's fill: everything above live
        self.buckets = []  # all rebound: the old bucket would go now; these stand for the new ones
        return False


def average_in_place(world_size: int, bucket):  # no annotations: DDP checks them as objects, these would be strings
    buffer = bucket.buffer()
    buffer.div_(world_size)
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


def estimate(config, batch_size: int | None = None, resolution: int = 512, device: str = "cuda",
             world_size: int = 1) -> Estimate:
    """The peak of one steady-state training step of ``config`` at ``batch_size`` images per micro-batch
    (default: the config's) and ``resolution`` pixels, on each of ``world_size`` GPUs (see ``session``)."""
    with session(config, resolution, device, world_size) as run:
        return run(batch_size or config.batch_size)


def max_batch(config, gpu_memory_gb: float, resolution: int = 512, limit: int = 1024, run=None, world_size: int = 1,
              progress=None, second: int = 8):
    """The largest micro-batch (up to ``limit``; with ``global_batch``, the largest that makes it in whole
    accumulation steps on ``world_size`` GPUs) whose predicted peak fits ``gpu_memory_gb``, and its
    estimate; ``(0, None)`` when not even one image fits. The peak grows about linearly with the batch:
    estimates at 4 and ``second`` images (8, or a batch the caller estimates anyway) give the line, and
    the search starts from the batch it predicts, trying only batches that could be the answer."""
    if run is None:
        with session(config, resolution, world_size=world_size, progress=progress) as run:
            return max_batch(config, gpu_memory_gb, resolution, limit, run, world_size, second=second)

    sizes = list(range(1, limit + 1))
    if config.global_batch:  # none that makes it: every size, and the caller says why none can be used
        sizes = [b for b in sizes if config.global_batch % (b * world_size) == 0] or sizes
    second = second if second != 4 else 8
    at_4, at_second = run(4), run(second)
    per_image = max((at_second.peak_gb - at_4.peak_gb) / (second - 4), 1e-9)
    predicted = second + (gpu_memory_gb - at_second.peak_gb) / per_image
    guess = max(1, bisect.bisect_right(sizes, predicted))  # sizes[guess - 1]: the largest up to the prediction
    index = largest_that_fits(lambda i: run(sizes[i - 1]).peak_gb <= gpu_memory_gb, guess, len(sizes))
    batch = sizes[index - 1] if index else 0
    return batch, run(batch) if batch else None


def largest_that_fits(fits, guess: int = 1, limit: int = 1 << 20) -> int:
    """The largest ``n`` in ``[1, limit]`` with ``fits(n)``, for a ``fits`` true up to some ``n`` and false
    after it; 0 when ``fits(1)`` is false. From ``guess``, a step that doubles until the answer is
    bracketed, then bisection: about 2 log2 of the distance from the guess calls."""
    guess = max(1, min(guess, limit))
    if fits(guess):  # low fits; find a high that does not
        low, high, stride = guess, None, 1
        while high is None:
            if low == limit:
                return low
            candidate = min(low + stride, limit)
            if fits(candidate):
                low, stride = candidate, stride * 2
            else:
                high = candidate
    else:  # high does not fit; find a low that does
        low, high, stride = None, guess, 1
        while low is None:
            candidate = max(high - stride, 1)
            if fits(candidate):
                low = candidate
            elif candidate == 1:
                return 0
            else:
                high, stride = candidate, stride * 2
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def breakdown(allocations: Allocations, step, vae, config, casts: set[int], rebuild: set[int] | None = None,
              at: int | None = None) -> dict:
    """What was live at the peak (or at clock ``at``), by what it is (``rebuild``: DDP's new buckets while
    it rebuilds them)."""
    def records(tensors):
        found = {}
        for tensor in tensors:
            record = allocations.record_of(sd.train.sharding.local(tensor))  # fsdp: this rank's slice
            if record is not None:
                found[id(record)] = record
        return found

    unet = step.unet
    groups = {
        "weights": records([*unet.parameters(), *unet.buffers()]),
        "gradients": records([p.grad for p in unet.parameters() if p.grad is not None]),
        "optimizer_state": records([t for state in sd.train.sharding.local_optimizer(step.optimizer).state.values()
                                    for t in state.values() if isinstance(t, torch.Tensor)]),
        "ema": records([t for ema in [e for e, _ in step.emas()] + step.posthoc + step.posthoc_text
                        for t in ema.shadow + (ema.staging or [])]),
        "text_encoder_and_vae": records([*step.text_encoder.parameters(), *step.text_encoder.buffers(),
                                         *vae.parameters(), *vae.buffers()]),
    }
    master = getattr(step.optimizer, "master_weights", None)
    if master is not None:  # bf16_weights: the fp32 masters and their gradients
        groups["master_weights"] = records([t for m in master.master for t in (m, m.grad) if t is not None])
    held = step.objective.held_tensors()  # a distillation's teacher copy and target network, DPO's reference
    if held:
        groups[step.objective.held_as] = records(held)
    groups["autocast_weight_copies"] = casts
    if sd.train.sharding.is_sharded(unet):  # FSDP2's gathered weights, in storages it resizes in place
        groups["fsdp_gathered_weights"] = allocations.regrown
    if rebuild is not None:
        groups["ddp_bucket_rebuild"] = rebuild
    live = allocations.live_at(allocations.peak_at if at is None else at)
    parts = {name: 0 for name in groups}
    parts["activations_and_temporaries"] = 0
    for record in live:
        name = next((name for name, found in groups.items() if id(record) in found), "activations_and_temporaries")
        parts[name] += record.size
    if config.ema_device == "cpu":  # host memory: not on the card
        parts["ema"] = 0
    if config.cache_text_embeddings:  # the text encoder waits in host memory
        parts["text_encoder_and_vae"] -= sum(
            r.size for key, r in records([*step.text_encoder.parameters(), *step.text_encoder.buffers()]).items()
            if key in {id(x) for x in live})
    return parts


def _zero_item(tensor):
    return False if tensor.dtype == torch.bool else 0.0 if tensor.is_floating_point() else 0


def _zeros_list(tensor):
    import numpy as np

    return np.zeros(tuple(tensor.shape)).tolist()


# What reading a fake tensor's values to the host gives: zeros (fake tensors turn tolist into items).
HOST_READS = {"tolist": _zeros_list, "item": _zero_item, "__bool__": lambda tensor: False}


def adapters_always_on(*models) -> None:
    """PEFT's LoHa and LoKr layers, while training, apply their adapter when ``torch.rand(1) > module_dropout``
    (a host read); on fake tensors that read is zero (``HostReadsAsZeros``) and would leave the adapter out of
    the graph. Their training flag alone is turned off: the forward and backward are those of training (no
    module dropout is set: the adapter always applies)."""
    from peft.tuners.lycoris_utils import LycorisLayer

    for model in models:
        for module in model.modules():
            if isinstance(module, LycorisLayer):
                module.training = False


class HostReadsAsZeros(TorchFunctionMode):
    """A read of device values to the host (``tolist``, ``item``, ``bool``) sees zeros: a fake tensor holds no
    values, and zeros are a finite, non-overflowing step that updates the optimizer and the EMA."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        read = HOST_READS.get(getattr(func, "__name__", ""))
        return read(args[0]) if read is not None else func(*args, **(kwargs or {}))


class ProdigyReads(TorchFunctionMode):
    """What Prodigy's step reads to the host, on fake tensors: ``param.any()`` (whether to keep a copy of its
    start, ``p0``) is True unless the parameter is in ``zeros``, and every statistic it reads (``item``) is
    1, so it goes on to its update as a real step does (with zeros it returns before the update)."""

    def __init__(self, zeros: set[int]):
        super().__init__()
        self.zeros = zeros

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "any" and len(args) == 1 and not kwargs and isinstance(args[0], torch.nn.Parameter):
            return id(args[0]) not in self.zeros
        if name == "item":
            return 1.0
        return func(*args, **(kwargs or {}))


def prodigy_reads_on_fake_tensors(step) -> None:
    """Prodigy's steps on ``step``'s fake tensors run under ``ProdigyReads``. Known to be zero: a LoRA
    adapter's up matrices (``lora_B``), zero at the start, when Prodigy takes its copy of each parameter:
    a zero one gets a single number in its place (prodigyopt 1.1), the rest a full copy."""
    zeros = {id(p) for model in (step.unet, step.text_encoder) for name, p in model.named_parameters()
             if ".lora_B." in name}
    optimizer = step.optimizer
    original = optimizer.step

    def stepped(*args, **kwargs):
        with ProdigyReads(zeros):
            return original(*args, **kwargs)

    optimizer.step = stepped


@contextlib.contextmanager
def storage_resizes_seen_by(allocations: Allocations):
    """Inside, ``allocations`` is told of every storage resized in place (``UntypedStorage.resize_``,
    which no operator sees)."""
    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        out = original(storage, size)
        allocations.resized(storage, size)
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


@contextlib.contextmanager
def module_moves_of_fake_tensors():
    """``Module.to`` for modules of fake tensors: each converted parameter is a new ``Parameter`` in
    its module (and each buffer a new tensor), as torch does when it overwrites parameters on
    conversion. torch's own ``Module.to`` swaps fake parameters in place, which fails while the fake
    mode holds weak references to them."""
    original = torch.nn.Module.to

    def to(module, *args, **kwargs):
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)

        def convert(tensor):
            return tensor.to(device=device or tensor.device,
                             dtype=dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype,
                             memory_format=memory_format if memory_format is not None and tensor.dim() == 4
                             else torch.preserve_format)

        with torch.no_grad():  # as torch's own: the conversion is not part of any graph
            for child in module.modules():
                for name, parameter in child._parameters.items():
                    if parameter is not None and (new := convert(parameter)) is not parameter:
                        child._parameters[name] = torch.nn.Parameter(new, requires_grad=parameter.requires_grad)
                for name, buffer in child._buffers.items():
                    if buffer is not None:
                        child._buffers[name] = convert(buffer)
        return module

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original


# What --estimate_memory suggests when not even one image fits, each only when it is not on already:
# (the setting as a config line, whether the config could still take it, the change).
SAVINGS = (
    ("grad_checkpointing: true", lambda c: not c.grad_checkpointing, dict(grad_checkpointing=True)),
    ("ema_device: cpu", lambda c: c.ema_decay > 0 and c.ema_device != "cpu", dict(ema_device="cpu")),
    ("precision: bf16", lambda c: c.precision == "fp32", dict(precision="bf16")),
    ("optim.name: adamw8bit", lambda c: c.optim.name == "adamw", {"optim.name": "adamw8bit"}),
    ("lora.rank: 16 (a LoRA on init_from's weights)", lambda c: not c.lora.rank, {"lora.rank": 16}),
)


def suggestions(config, resolution: int, batch: int = 1, world_size: int = 1) -> list[tuple[str, float]]:
    """Each of SAVINGS not already on, with the predicted peak (GB) of a step at ``batch`` images with
    that one change: least memory first. One that cannot be estimated here is left out."""
    found = []
    for setting, applies, change in SAVINGS:
        if not applies(config):
            continue
        print(f"estimating with {setting} ...", file=sys.stderr, flush=True)
        try:
            found.append((setting, estimate(dataclasses.replace(config, **change), batch, resolution,
                                            world_size=world_size).peak_gb))
        except Exception as error:  # e.g. no bitsandbytes here: that suggestion is not made
            log.info("no estimate with %s: %s", setting, error)
    return sorted(found, key=lambda item: item[1])


def show_progress(estimate: Estimate, seconds: float) -> None:
    print(f"  micro-batch {estimate.batch_size:>4}: peak {estimate.peak_gb:8.2f} GB  ({seconds:.0f} s)",
          file=sys.stderr, flush=True)


def report(config, resolution: int, gpu_memory_gb: float, world_size: int = 1) -> dict:
    """``SD_Train.py --estimate_memory``: the breakdown at the config's batch and the largest batch that
    fits ``gpu_memory_gb``, printed, for each GPU of a ``world_size``-GPU run; the result as a dict (the
    JSON line). When not even one image fits, the savings not yet on, each with its predicted peak."""
    if config.batch_size and config.global_batch:  # the trainer's own check, before the long work
        resolve_global_batch(config, world_size)
    wrapper = {"zero1": "DDP, AdamW state split by ZeRO-1", "fsdp": "FSDP2"}.get(config.sharding, "DDP")
    print(f"estimating one training step on fake tensors ({config.unet} UNet, {resolution} px"
          f"{f', {wrapper} on {world_size} GPUs' if world_size > 1 else ''}): no GPU or data needed; a line per "
          "batch size tried ...", file=sys.stderr, flush=True)
    with session(config, resolution, world_size=world_size, progress=show_progress) as run:
        batch, at_max = max_batch(config, gpu_memory_gb, resolution, run=run, world_size=world_size,
                                  second=config.batch_size if config.batch_size > 1 else 8)  # shown below anyway
        if batch and config.global_batch:  # the largest that makes global_batch, as batch_size: auto takes
            batch = largest_batch_for(config.global_batch, world_size, batch)
            at_max = run(batch) if batch else None
        shown = config.batch_size or batch or 1  # batch_size: auto shows the batch it would choose
        at_config = run(shown)
    gpus = f", each of {world_size} GPUs in {wrapper}" if world_size > 1 else ""
    unit = config.objective.batch_unit  # what batch_size counts: images, or DPO's pairs
    print(f"Predicted device memory of one training step{gpus}: {config.unet} UNet, {resolution} px, "
          f"micro-batch {shown}{f' {unit}' if unit != 'images' else ''}"
          f"{' (auto)' if not config.batch_size else ''} x grad_accum {at_config.grad_accum}, "
          f"{config.precision}, gradient checkpointing "
          f"{'on' if config.grad_checkpointing else 'off'}, EMA "
          f"{'off' if config.ema_decay == 0 else 'on the CPU' if config.ema_device == 'cpu' else 'on the GPU'}")
    rows = [*((name.replace("_", " "), size) for name, size in at_config.parts.items()),
            ("allocated at the peak", at_config.allocated),
            (f"allocator allowance (x{RESERVE_FACTOR:.2f})", at_config.reserved - at_config.allocated),
            ("CUDA context allowance", CONTEXT_GB * GB), ("peak on the card", at_config.peak_gb * GB)]
    for name, size in rows:
        print(f"  {name:<32}{size / GB:9.3f} GB")
    if batch:
        print(f"Largest micro-batch within {gpu_memory_gb:.2f} GB"
              f"{f' that makes global_batch {config.global_batch}' if config.global_batch else ''}: {batch}"
              f"{f' {unit}' if unit != 'images' else ''} (peak "
              f"{at_max.peak_gb:.2f} GB)")
    advice = []
    if not batch:
        advice = suggestions(config, resolution, world_size=world_size)
        print(f"Not even one image fits within {gpu_memory_gb:.2f} GB with these settings."
              + (" Predicted peak of one image with one change each, least memory first:" if advice else ""))
        for setting, peak in advice:
            print(f"  {setting:<48}{peak:9.3f} GB{'  fits' if peak <= gpu_memory_gb else ''}")
    return {**at_config.as_dict(), "gpu_memory_gb": gpu_memory_gb, "max_batch": batch,
            "fits": at_config.peak_gb <= gpu_memory_gb,
            "suggestions": [{"setting": setting, "peak_gb": round(peak, 3)} for setting, peak in advice]}


# ---------------------------------------------------------------------------------------------
# batch_size: auto
# ---------------------------------------------------------------------------------------------


def auto_batch_size(config, d, gpu_memory_gb: float | None = None) -> int:
    """``batch_size: auto``: the run folder's own choice when it has one (a resume keeps its batch),
    else the largest micro-batch whose predicted peak fits the smallest GPU of the run."""
    saved = Path(config.out_dir) / "config.yaml"
    if saved.exists():
        try:
            chosen = read_saved_config(saved).get("batch_size")
        except ValueError as error:
            raise ConfigError(f"batch_size: auto reads the run's own choice from {error}") from error
        if isinstance(chosen, int) and chosen > 0:
            log.info("batch_size: auto -> %d, as this run chose before (%s)", chosen, saved)
            return chosen
    if gpu_memory_gb is None:
        if d.device.type != "cuda":
            raise ConfigError("batch_size: auto sizes the batch to a CUDA device's memory; on the CPU give a number")
        gpu_memory_gb = torch.cuda.get_device_properties(d.device).total_memory / 1e9
    gpu_memory_gb = min(sd.distributed.all_gather_objects(gpu_memory_gb, d))
    resolution = resolution_of(config)
    log.info("batch_size: auto: estimating the step's memory at a few batch sizes on fake tensors ...")
    batch, estimate = max_batch(config, gpu_memory_gb, resolution, world_size=d.world_size,  # DDP's, on several GPUs
                                progress=lambda found, seconds: log.info("batch_size: auto: micro-batch %d -> peak "
                                                                         "%.2f GB (%.0f s)", found.batch_size,
                                                                         found.peak_gb, seconds))
    if batch == 0:
        raise ConfigError(f"batch_size: auto: not even one {resolution} px image fits {gpu_memory_gb:.1f} GB with "
                          "these settings (SD_Train.py --estimate_memory shows where the memory goes)")
    log.info("batch_size: auto -> %d fits (predicted peak %.2f of %.2f GB)", batch, estimate.peak_gb, gpu_memory_gb)
    if config.global_batch:  # the largest that makes global_batch in whole accumulation steps
        fitting, batch = batch, largest_batch_for(config.global_batch, d.world_size, batch)
        if batch == 0:
            raise ConfigError(f"global_batch {config.global_batch} cannot be split over {d.world_size} GPUs: make "
                              f"it a multiple of {d.world_size}")
        if batch != fitting:
            log.info("batch_size: auto -> %d, the largest up to %d that makes global_batch %d on %d GPU(s)", batch,
                     fitting, config.global_batch, d.world_size)
    return batch


def resolution_of(config) -> int:
    """The image size of the first dataset's latents (``latents.json``), else 512. With aspect-ratio
    buckets, the side of a square of the largest bucket's pixel count (the step's memory grows with
    the pixels)."""
    for entry in config.datasets[:1]:
        try:
            meta = sd.data.training_data.read_latents_meta(Path(str(entry["latents"])))
            side = sd.data.training_data.resolution_of_latents(meta)
        except Exception:  # no folder yet, or no settings in it: the default
            side = None
        if side:
            return side
    return 512
