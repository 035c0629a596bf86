"""Reflow (rectification): pairs of noise and the image a flow model's ODE draws from it, as training data.

Training a flow model again on pairs that its own ODE couples (Liu et al. 2022, "Flow straight and fast";
InstaFlow, Liu et al. 2023) straightens its paths, so that 1-2 Euler steps land where many did. This module
draws the pairs (``SD_Reflow.py``): prompt ``i % len(prompts)`` and seed ``seed + i`` give pair ``i``, whose
noise is the one ``SD_ImageGen.py --seed`` draws and whose image is the model's ODE solution from it. They
are written per shard of ``shard_size`` pairs into two folders the rest of the chain reads:

* ``OUT/latents``: ``NNNNN.npy`` (the images' latents, float16, unscaled as ``encode_latents.py`` writes
  them), ``NNNNN.noise.npy`` (the noise, float16), ``NNNNN.keys.txt`` (written last: the shard's done
  marker) and ``latents.json`` (the settings and counts; ``complete`` once every shard is there);
* ``OUT/captions``: ``NNNNN.parquet`` (key, caption, 77 token ids) and ``NNNNN_stats.json``, stage 04's
  layout, so ``pipeline/05_build_hf_dataset.py`` joins the two into the dataset ``reflow: true`` trains on.

A shard is made by rank ``index % world_size`` (torchrun, or ``--rank`` / ``--world_size``), alone: no rank
waits for another. A re-run skips finished shards and refuses other settings; memory holds one shard.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import sd.data.captions
import sd.data.encode
import sd.data.stages
import sd.distributed
import sd.evaluation
import sd.files
import sd.formats
import sd.model
import sd.runtime
import sd.sampling

log = logging.getLogger("sd_reflow")
KEY = "r{:09d}"  # pair i's key


class ReflowError(ValueError):
    """A request that cannot be carried out, with a message that says how to fix it."""


@dataclass(frozen=True)
class Settings:
    """What shapes the pairs: a re-run must ask for the same (``latents.json`` records them)."""

    ckpt: str
    prompts: str
    n: int
    sampler: str
    steps: int
    cfg: float
    negative: str
    seed: int
    flow_shift: float  # 0: the shift the model records
    height: int  # 0 (with width): the size the model was trained at
    width: int
    shard_size: int
    no_ema: bool


def shard_ranges(n: int, shard_size: int) -> list[range]:
    return [range(start, min(start + shard_size, n)) for start in range(0, n, shard_size)]


def shard_done(out: Path, index: int) -> bool:
    stem = f"{index:05d}"
    return ((out / "latents" / f"{stem}.keys.txt").exists()
            and sd.data.stages.output_done(out / "captions", stem, ".parquet"))


def check_recorded(out: Path, settings: Settings) -> None:
    """A folder drawn with other settings is refused, naming the first that differs."""
    meta = sd.data.encode.read_meta(out / "latents")
    recorded = meta.get("reflow")
    if recorded is None:
        if any((out / "latents").glob("*.keys.txt")):
            raise ReflowError(f"{out / 'latents'} holds latents that SD_Reflow.py did not write; use another --out")
        return
    for name, value in asdict(settings).items():
        if recorded.get(name) != value:
            raise ReflowError(f"{out} was drawn with {name}={recorded.get(name)!r} but this run asks for "
                              f"{name}={value!r}; use the same settings or another --out")


def write_meta(out: Path, settings: Settings, pipe: sd.sampling.Pipeline, shape: tuple, total_shards: int) -> dict:
    """``latents.json``: the settings, the VAE's scaling factor, the latent shape, and the counts so far;
    ``complete`` once every shard is done (whichever rank finishes last writes it). Each process writes a
    file of its own and renames it onto ``latents.json``, so ranks never interleave their writes."""
    folder = out / "latents"
    done = sorted(folder.glob("*.keys.txt"))
    count = sum(len(path.read_text(encoding="utf-8").splitlines()) for path in done)
    meta = {"reflow": asdict(settings), "vae": f"the VAE of {settings.ckpt}",
            "scaling_factor": float(pipe.vae.config.scaling_factor), "resolution": max(settings.height, settings.width),
            "latent_shape": list(shape), "dtype": "float16", "shards": len(done), "count": count,
            "complete": len(done) == total_shards}
    mine = folder / f".latents.json.{socket.gethostname()}.{os.getpid()}"
    sd.files.write_json_atomic(mine, meta, indent=2)
    os.replace(mine, folder / "latents.json")
    return meta


def draw_shard(pipe: sd.sampling.Pipeline, settings: Settings, prompts: list[str], indices: range, out: Path,
               index: int, batch_size: int, device: torch.device, bar=None) -> None:
    """Pairs ``indices``: their noise, their images' latents and their captions, written as shard ``index``."""
    stem = f"{index:05d}"
    shape = (pipe.unet.config.in_channels, settings.height // 8, settings.width // 8)
    captions = [prompts[i % len(prompts)] for i in indices]
    ids = sd.model.tokenize(pipe.tokenizer, captions).numpy()
    negative = sd.model.encode_prompt_ids(pipe.text_encoder, sd.model.tokenize(pipe.tokenizer, [settings.negative]))
    noises = np.empty((len(indices), *shape), dtype=np.float16)
    latents = np.empty((len(indices), *shape), dtype=np.float16)
    factor = float(pipe.vae.config.scaling_factor)
    for start in range(0, len(indices), batch_size):
        chunk = list(indices[start : start + batch_size])
        generators = sd.sampling.seed_generators([settings.seed + i for i in chunk])
        noise = sd.sampling.image_noise(generators, shape, len(chunk)).to(device)
        cond = sd.model.encode_prompt_ids(pipe.text_encoder, torch.from_numpy(ids[start : start + len(chunk)]))
        with sd.model.attention_context(device):
            x0 = sd.sampling.sample_latents(pipe.unet, noise, cond.float().to(device),
                                            negative.float().to(device).expand(len(chunk), -1, -1),
                                            sampler=settings.sampler, steps=settings.steps, cfg=settings.cfg,
                                            prediction_type=pipe.prediction_type, flow_shift=settings.flow_shift)
        noises[start : start + len(chunk)] = noise.cpu().numpy()
        latents[start : start + len(chunk)] = sd.model.unscale_latents(x0, factor).cpu().numpy()
        if bar is not None:
            bar.update(len(chunk))
    bad = ~np.isfinite(latents).all(axis=(1, 2, 3))
    if bad.any():
        raise ReflowError(f"{settings.ckpt} drew {int(bad.sum())} images with NaN or infinite latents in shard {stem} "
                          f"(pairs {KEY.format(indices[int(np.flatnonzero(bad)[0])])}, ...): the model is damaged, or "
                          "its precision too low; nothing of that shard was written")
    keys = [KEY.format(i) for i in indices]
    folder = out / "latents"
    sd.files.save_npy_atomic(folder / f"{stem}.noise.npy", noises)
    sd.files.save_npy_atomic(folder / f"{stem}.npy", latents)
    stats = sd.data.stages.ShardStats()
    stats.successes = len(keys)
    table = sd.data.captions.caption_table(keys, captions, ids)
    import pyarrow.parquet as pq

    sd.data.stages.write_output(out / "captions", stem, lambda tmp: pq.write_table(table, tmp), stats, ".parquet")
    sd.files.write_text_atomic(folder / f"{stem}.keys.txt", "".join(k + "\n" for k in keys))  # the done marker


def draw(settings: Settings, out: Path, batch_size: int, d: sd.distributed.Dist, precision: str = "auto") -> dict:
    """Every shard of this rank not done yet; returns ``latents.json`` as this rank leaves it."""
    prompts = sd.evaluation.read_prompts(settings.prompts)
    if not prompts:
        raise ReflowError(f"--prompts {settings.prompts} holds no prompt")
    pipe = sd.formats.load_pipeline(settings.ckpt, use_ema=not settings.no_ema, flow_shift=settings.flow_shift or None)
    if pipe.prediction_type != "flow" and not pipe.flow_matching:
        raise ReflowError(f"{settings.ckpt} predicts {pipe.prediction_type}: reflow straightens the paths of a flow "
                          "model, a prediction_type: flow one or one trained with flow_matching: true (train one "
                          "first: configs/finetune/flow.yaml, docs/training.md)")
    settings = dataclasses.replace(settings, flow_shift=pipe.flow_shift)
    if not (settings.height and settings.width):
        side = pipe.trained_size[0]
        settings = dataclasses.replace(settings, height=side, width=side)
    (out / "latents").mkdir(parents=True, exist_ok=True)
    (out / "captions").mkdir(parents=True, exist_ok=True)
    check_recorded(out, settings)
    pipe.to(d.device, sd.runtime.resolve_precision(precision, d.device))
    shape = (pipe.unet.config.in_channels, settings.height // 8, settings.width // 8)
    ranges = shard_ranges(settings.n, settings.shard_size)
    mine = [i for i in range(len(ranges)) if i % d.world_size == d.rank and not shard_done(out, i)]
    log.info("%d pairs in %d shards of %d; this rank (%d of %d) draws %d shards (%d pairs), %d steps of %s at cfg %g",
             settings.n, len(ranges), settings.shard_size, d.rank, d.world_size, len(mine),
             sum(len(ranges[i]) for i in mine), settings.steps, settings.sampler, settings.cfg)
    write_meta(out, settings, pipe, shape, len(ranges))
    from tqdm.auto import tqdm

    with tqdm(total=sum(len(ranges[i]) for i in mine), desc="reflow pairs", unit="pair", disable=not mine) as bar:
        for index in mine:
            with torch.no_grad():
                draw_shard(pipe, settings, prompts, ranges[index], out, index, batch_size, d.device, bar)
            write_meta(out, settings, pipe, shape, len(ranges))
    return write_meta(out, settings, pipe, shape, len(ranges))


def dataset_command(out: Path) -> str:
    return (f"python pipeline/05_build_hf_dataset.py --captions {out / 'captions'} --latents {out / 'latents'} "
            f"--out {out / 'dataset'} --val_fraction 0")


def summary(meta: dict, out: Path) -> str:
    if not meta["complete"]:
        return (f"{meta['count']} pairs in {meta['shards']} shards so far in {out}; the other ranks' shards are still "
                "missing (run again to draw any a stopped rank left)")
    return (f"{meta['count']} pairs in {meta['shards']} shards in {out}; next: {dataset_command(out)}, then train "
            f"with reflow: true on datasets: [{{dataset: {out / 'dataset'}, latents: {out / 'latents'}}}]")
