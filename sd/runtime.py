"""Process start-up, device choice and precision names: the one place for global settings.

Every entry point calls ``start_process()`` first thing in ``main``; no module changes environment
variables or torch flags when imported or deep inside a function.
"""

from __future__ import annotations

import logging
import os

import torch

import sd.faults

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def start_process(*, threads: int | None = None) -> None:
    """Settings that must precede any CUDA work, and the library defaults every script wants.

    - ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: less fragmentation with changing
      shapes; it is read when CUDA initialises, so it is set before any tensor reaches a GPU.
    - TF32 matmuls and convolutions on Ampere and newer (fp32 parts of bf16 training).
    - ``NO_ALBUMENTATIONS_UPDATE=1``: img2dataset's albumentations import otherwise calls out.
    - ``threads``: CPU threads for this process (several processes on one CPU share its cores).
    - The test-only fault points of ``sd.faults`` (armed by ``SD_FAULT``; inert otherwise).
    - bitsandbytes' notice, on CPUs with AVX-512 BF16, that its optional 4-bit CPU kernels are not
      installed (diffusers imports it with every model; nothing here uses 4-bit layers) is muted.
    A value the user already set in the environment is kept.
    """
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if threads is not None:
        torch.set_num_threads(max(1, threads))
    sd.faults.arm_from_environment()


def pick_device(choice: str = "auto", local_rank: int | None = None) -> torch.device:
    """``auto``: CUDA (this process's ``local_rank`` GPU), then Apple MPS, then the CPU."""
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
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return DTYPES[precision]


def default_precision(device: torch.device) -> str:
    """What inference runs in when not told: bf16 on CUDA, fp16 on MPS, fp32 on the CPU."""
    return {"cuda": "bf16", "mps": "fp16"}.get(torch.device(device).type, "fp32")


def resolve_precision(choice: str | None, device: torch.device) -> torch.dtype:
    """``auto`` (or None) -> the device default; otherwise the named precision."""
    return dtype_of(default_precision(device) if choice in (None, "", "auto") else choice)


def autocast(precision: str, device: torch.device):
    """Mixed-precision autocast for ``bf16`` / ``fp16``; nothing for ``fp32``."""
    import contextlib

    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype_of(precision))


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (timings, peak memory)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
