"""The distributed set-up: one process per device under torchrun, world size 1 without it.

NCCL on CUDA, gloo on the CPU. A single process runs the same code with ``world_size == 1``, where
the collectives below do nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

import sd.runtime


class Stopped(Exception):
    """A stop was asked for on some rank during work between collectives: every rank raises it at the
    same collective, where each has learnt of it, so none is left waiting in one."""


class Failed(Exception):
    """Work between collectives failed on another rank: every rank leaves at the same collective, where each
    has learnt of it (the failing rank with its own error, the others with this one naming it), so none is
    left waiting in a collective for a rank that will not come."""


def failure_text(error: BaseException, rank: int) -> str:
    """How a rank's error is told to the others: one line."""
    lines = str(error).strip().splitlines()
    return f"rank {rank}: {type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def raise_failures(told: list[str | None], mine: BaseException | None) -> None:
    """After a collective that carried every rank's ``failure_text`` (None: its work went well): this rank's
    own error if it failed, else ``Failed`` naming the ranks that did; nothing when none did."""
    if mine is not None:
        raise mine
    failures = [text for text in told if text]
    if failures:
        raise Failed("; ".join(failures))


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool
    local_world_size: int = 1  # the ranks on this machine
    group: object = None  # the process group of the collectives and DDP; None: the default group

    @classmethod
    def single(cls, device="cpu") -> "Dist":
        """One process on ``device`` (tests and benchmarks)."""
        return cls(0, 1, 0, torch.device(device), True)


def cpu_threads(share: int) -> int:
    """This process's CPU threads: its ``share`` of the cores, and no more than ``OMP_NUM_THREADS`` where
    that is set (a job sharing the machine with others says so there)."""
    limit = os.environ.get("OMP_NUM_THREADS", "")
    return max(1, min(share, int(limit)) if limit.isdigit() and int(limit) > 0 else share)


def setup(device_choice: str = "auto") -> Dist:
    """Read torchrun's environment, pick this rank's device and join the process group."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = sd.runtime.pick_device(device_choice, local_rank)
    if device.type == "mps":  # the trainer runs on CUDA or the CPU
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the ranks on one machine share its cores
        torch.set_num_threads(cpu_threads((os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return Dist(rank, world_size, local_rank, device, rank == 0, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world_size > 1:
        dist.all_reduce(values, group=d.group)
    return values


def barrier(d: Dist) -> None:
    if d.world_size > 1:
        dist.barrier()


def all_gather_objects(value, d: Dist) -> list:
    """Every rank's ``value`` (picklable, small), in rank order, on every rank."""
    if d.world_size == 1:
        return [value]
    gathered = [None] * d.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def independent(device_choice: str = "auto", rank: int | None = None, world_size: int | None = None) -> Dist:
    """This process's rank, world size and device, without joining a process group.

    For workers that share nothing but a folder (``encode_latents.py`` splits its shards by rank): under
    torchrun the ranks come from its environment, from a launcher without it (a SLURM array) as
    ``rank`` and ``world_size``. Nothing here waits for another process.
    """
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = sd.runtime.pick_device(device_choice, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "cpu" and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > 1:
        # The ranks on one machine share its cores (the ones this process may run on, under SLURM too).
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(cpu_threads(cores // int(os.environ["LOCAL_WORLD_SIZE"])))
    return Dist(rank, world_size, local_rank, device, rank == 0)
