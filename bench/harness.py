"""What the benchmarks share: random-weight models of each architecture, synthetic inputs, timing.

Every benchmark builds its models here with fixed seeds, so ours and the peer start from the same
weights and see the same inputs. ``arch`` is ``sd1`` (the SD 1.x UNet, VAE and CLIP ViT-L/14 text
tower, random weights) or ``tiny`` (the CPU presets of sd.model).
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import torch

import sd.cli
import sd.formats
import sd.model
import sd.runtime

ROOT = Path(__file__).resolve().parents[1]
BOS, EOS = 49406, 49407
# Dense bf16 tensor-core peak in TFLOP/s (no sparsity), from the vendors' data sheets. Matched in order
# against torch.cuda.get_device_name(); a device not listed needs --peak_tflops for its MFU.
PEAK_BF16_TFLOPS = (
    ("H200", 989.4),
    ("H100 PCIe", 756.5),
    ("H100 NVL", 835.5),
    ("H100", 989.4),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100", 312.0),
    ("L40S", 362.1),
    ("RTX 4090", 165.2),
    ("RTX 3090", 71.0),
)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def peak_tflops(device: torch.device, override: float | None = None) -> float | None:
    """The device's dense bf16 peak, or None when unknown (then no MFU is printed)."""
    if override:
        return override
    name = device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def argument_parser(doc: str, *, cpu_resolution: int = 64):
    """The flags every benchmark shares: --arch, --resolution, --device, --json."""
    cuda = torch.cuda.is_available()
    parser = sd.cli.ArgumentParser(description=doc)
    parser.add_argument("--arch", choices=["sd1", "tiny"], default="sd1" if cuda else "tiny",
                        help="sd1 (860M UNet) or the tiny CPU preset (default: sd1 on a GPU, else tiny)")
    parser.add_argument("--resolution", type=int, default=512 if cuda else cpu_resolution,
                        help=f"image pixels, latents are 1/8 (default: 512 on a GPU, else {cpu_resolution})")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--json", default="", help="also write the result JSON to this file")
    return parser


def parse_list(text: str, kind=int) -> list:
    return [kind(item) for item in text.split(",") if item.strip()]


# ---------------------------------------------------------------------------------------------
# Random-weight models and synthetic inputs
# ---------------------------------------------------------------------------------------------


def random_text_encoder(arch: str, seed: int = 1):
    """The CLIP text tower of ``arch`` (ViT-L/14 for sd1) with random weights, frozen."""
    from transformers import CLIPTextConfig, CLIPTextModel

    with sd.model._seeded(seed):
        model = CLIPTextModel(CLIPTextConfig(**sd.formats.SINGLE_FILE_ARCHS[arch][2]))
    return model.requires_grad_(False).eval()


def random_vae(arch: str, seed: int = 2):
    """The VAE of ``arch`` with random weights, frozen. diffusers is told to keep quiet (casting the
    VAE to bf16 makes it warn once per build) here, not when this module is imported: the benchmarks'
    children that build no model start without diffusers (3 s less each)."""
    from diffusers import AutoencoderKL
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    with sd.model._seeded(seed):
        model = AutoencoderKL(**sd.formats.SINGLE_FILE_ARCHS[arch][1])
    return model.requires_grad_(False).eval()


def unet_preset(arch: str) -> str:
    return sd.formats.SINGLE_FILE_ARCHS[arch][0]


def vae_factor(arch: str) -> int:
    """Pixels per latent cell: 2 ** (number of VAE down blocks - 1)."""
    return 2 ** (len(sd.formats.SINGLE_FILE_ARCHS[arch][1]["block_out_channels"]) - 1)


def pixel_multiple(arch: str) -> int:
    """What image sides must be multiples of for ``arch``'s UNet: pixels per latent cell times
    2 ** (UNet down blocks - 1), the halvings a latent side goes through (64 for sd1, 16 for tiny)."""
    return vae_factor(arch) * 2 ** (len(sd.model.UNET_PRESETS[unet_preset(arch)]["down_block_types"]) - 1)


def empty_prompt_ids(length: int = sd.model.TOKENIZER_MAX_LENGTH) -> torch.Tensor:
    """The empty prompt as the CLIP tokenizer pads it: BOS, then EOS to the end."""
    return torch.tensor([[BOS] + [EOS] * (length - 1)])


def synthetic_batch(batch: int, latent_size: int | tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Unscaled fp16 latents ``(B, 4, L, L)`` (or ``(B, 4, h, w)`` for ``latent_size=(h, w)``, an
    aspect-ratio bucket) as the latent store holds them, and 77 token ids each.

    Captions are 8 to 40 random tokens between BOS and EOS padding, like real prompts.
    """
    height, width = (latent_size, latent_size) if isinstance(latent_size, int) else latent_size
    g = torch.Generator().manual_seed(seed)
    latents = (torch.randn(batch, 4, height, width, generator=g) / sd.model.SD1_SCALING_FACTOR).half()
    ids = torch.full((batch, sd.model.TOKENIZER_MAX_LENGTH), EOS)
    ids[:, 0] = BOS
    for row in range(batch):
        length = int(torch.randint(8, 41, (1,), generator=g))
        ids[row, 1 : 1 + length] = torch.randint(300, 49000, (length,), generator=g)
    return latents, ids


# ---------------------------------------------------------------------------------------------
# Timing and memory
# ---------------------------------------------------------------------------------------------


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: torch.device) -> dict:
    """Peak allocated and reserved GPU memory since the last reset (None on a CPU)."""
    if device.type != "cuda":
        return {"peak_allocated_gb": None, "peak_reserved_gb": None}
    return {"peak_allocated_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
            "peak_reserved_gb": round(torch.cuda.max_memory_reserved(device) / 2**30, 2)}


def time_steps(step, device: torch.device, warmup: int, steps: int) -> float:
    """Seconds per call of ``step`` after ``warmup`` untimed calls (compilation happens there)."""
    for _ in range(warmup):
        step()
    sd.runtime.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sd.runtime.synchronize(device)
    return (time.perf_counter() - start) / steps


def release(device: torch.device) -> None:
    """Free what the last measurement held, compiled graphs included, before building the next."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def out_of_memory_errors() -> tuple:
    return (torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else (torch.cuda.OutOfMemoryError,)


def print_table(rows: list[dict], label, columns: list[tuple[str, str, str]]) -> None:
    """One line per row: ``label(row)``, then each (key, heading, format) column; None prints as '-', and a
    row that ran out of memory or failed (``error``) says so instead."""
    print(f"{'':44}" + "".join(f"{heading:>12}" for _, heading, _ in columns))
    for row in rows:
        cells = ["-" if row.get(key) is None else format(row[key], fmt) for key, _, fmt in columns]
        if row.get("oom"):
            cells = ["out of memory"]
        elif row.get("error"):
            cells = [f"failed: {row['error']}"]
        print(f"{label(row):44}" + "".join(f"{cell:>12}" for cell in cells))


def emit(result: dict, json_path: str | None) -> None:
    """The machine-readable result: one JSON line on stdout, and the file ``--json`` names."""
    line = json.dumps(result)
    print(line)
    if json_path:
        Path(json_path).write_text(line + "\n")


def built_steps(entries: list, device, warm, time_alone=None) -> list:
    """For each ``(row, build)``: ``build(row)`` makes a step (noting what it likes in ``row``),
    ``warm(step)`` runs its warm-up; with ``time_alone`` the step is timed by ``time_alone(row, step)``
    and freed, else kept for timing rounds that share the device. A step that runs out of memory marks
    its row ``oom``. Returns the kept steps (None where freed or out of memory)."""
    steps = []
    for row, build in entries:
        try:
            step = build(row)
            warm(step)
            if time_alone is not None:
                time_alone(row, step)
                step = None
        except out_of_memory_errors():
            row["oom"], step = True, None
        steps.append(step)
        if step is None:
            release(device)
    return steps
