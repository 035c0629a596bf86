"""Process start-up, device choice and precision names: the one place for global settings.

Every entry point calls ``start_process()`` first thing in ``main``; no module changes environment
variables or torch flags when imported or deep inside a function.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import warnings
from typing import TYPE_CHECKING

import sd.faults

if TYPE_CHECKING:
    import torch

# torch is imported where it is used, not with this module: the data stages import this module for
# start_process alone and never compute with torch (importing it is 2.5 s of a stage's start-up).
PRECISIONS = ("fp32", "bf16", "fp16")
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # precision -> torch dtype name


def start_process(*, threads: int | None = None, uses_torch: bool = True) -> None:
    """Settings that must precede any CUDA work, and the library defaults every script wants.

    - ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: less fragmentation with changing
      shapes; it is read when CUDA initialises, so it is set before any tensor reaches a GPU.
    - TF32 matmuls and convolutions on Ampere and newer (fp32 parts of bf16 training).
    - ``NO_ALBUMENTATIONS_UPDATE=1``: img2dataset's albumentations import otherwise calls out.
    - ``threads``: CPU threads for this process (several processes on one CPU share its cores).
    - The test-only fault points of ``sd.faults`` (armed by ``SD_FAULT``; inert otherwise).
    - Muted: huggingface_hub's warning that diffusers passes it ``local_dir_use_symlinks``, and
      bitsandbytes' notice, on CPUs with AVX-512 BF16, that its optional 4-bit CPU kernels are not
      installed, with the ``kernels`` package's warning about looking for them offline (diffusers imports
      bitsandbytes with every model; nothing here uses 4-bit layers).
    ``uses_torch=False`` (the data stages, which compute nothing with torch) leaves torch's settings
    out and torch unimported. A value the user already set in the environment is kept.
    """
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    logging.getLogger("kernels").setLevel(logging.ERROR)  # its hub lookup for those kernels, offline
    # diffusers passes huggingface_hub an argument it has deprecated, on every hub id it looks up: not the user's
    warnings.filterwarnings("ignore", message=".*local_dir_use_symlinks.*", category=UserWarning)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    if uses_torch:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        if threads is not None:
            torch.set_num_threads(max(1, threads))
    sd.faults.arm_from_environment()


def pick_device(choice: str = "auto", local_rank: int | None = None) -> torch.device:
    """``auto``: CUDA (this process's ``local_rank`` GPU), then Apple MPS, then the CPU."""
    import torch

    if choice != "auto":
        device = torch.device(choice)
        if device.type == "cuda" and device.index is None and local_rank is not None:
            device = torch.device("cuda", local_rank)
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank or 0)
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def dtype_of(precision: str) -> torch.dtype:
    """``fp32`` / ``bf16`` / ``fp16`` -> the torch dtype."""
    import torch

    if precision not in DTYPE_NAMES:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return getattr(torch, DTYPE_NAMES[precision])


def default_precision(device: torch.device) -> str:
    """What inference runs in when not told: bf16 on CUDA, fp16 on MPS, fp32 on the CPU."""
    import torch

    return {"cuda": "bf16", "mps": "fp16"}.get(torch.device(device).type, "fp32")


def resolve_precision(choice: str | None, device: torch.device) -> torch.dtype:
    """``auto`` (or None) -> the device default; otherwise the named precision."""
    return dtype_of(default_precision(device) if choice in (None, "", "auto") else choice)


def autocast(precision: str, device: torch.device):
    """Mixed-precision autocast for ``bf16`` / ``fp16``; nothing for ``fp32``."""
    import contextlib

    import torch

    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype_of(precision))


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (timings, peak memory)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


class SignalInterrupt(KeyboardInterrupt):
    """A stop signal other than SIGINT outside the training loop (loading, class images): it interrupts
    what runs, as Ctrl-C does, and the process exits with 128 + ``signum``."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def interrupting_signals():
    """Within the body, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 raise ``SignalInterrupt`` where the process is
    (SIGINT raises KeyboardInterrupt anyway), instead of killing it: what is finished stays (written
    atomically) and the message says so. A training loop's ``StopSignal`` takes over inside it."""
    def interrupt(signum, frame):
        raise SignalInterrupt(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in STOP_SIGNALS if sig != signal.SIGINT}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class StopSignal:
    """SIGTERM, SIGINT, SIGHUP, SIGUSR1 or SIGUSR2 (what schedulers send before a time limit, e.g. SLURM's
    ``--signal=USR1@120``): finish the current optimizer step (or cut short its validation or
    evaluation), save, exit with 128 + signal."""

    def __init__(self):
        self.signum = 0
        self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum, frame):
        self.signum = signum

    def requested(self) -> bool:
        """Whether a stop signal reached this rank (the ranks agree on it at their next collective)."""
        return self.signum != 0

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
