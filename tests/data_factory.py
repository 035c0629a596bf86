"""Small training inputs in the formats of docs/data.md and docs/latents.md, built on the spot for tests."""

import json
from pathlib import Path

import numpy as np
import torch

import sd.model
import sd.run_folder

# The tiny training settings the trainer tests share (every model random and small, fp32 on the CPU).
BASE = dict(unet="tiny", vae="tiny", text_encoder="tiny", precision="fp32", device="cpu", grad_checkpointing=False,
            batch_size=2, grad_accum=2, lr=1e-3, warmup_steps=2, ema_decay=0.9, log_every=1, save_steps=100,
            validate_every=0, validation_prompts=["a red circle", "a blue square"], validation_data_captions=0,
            validation_steps=3, validation_samples=8, cfg_dropout=0.1, seed=0)

WORDS = ["red circle", "blue square", "green triangle", "yellow star"]


def make_latents(folder: Path, keys: list[str], latents: np.ndarray, shard_size: int = 16,
                 flipped: np.ndarray | None = None) -> Path:
    """Write ``NNNNN.npy`` + ``NNNNN.keys.txt`` shards and ``latents.json`` like encode_latents.py
    (with ``flipped``, also ``NNNNN.flip.npy`` as ``--flip`` does)."""
    folder.mkdir(parents=True, exist_ok=True)
    for shard, start in enumerate(range(0, len(keys), shard_size)):
        np.save(folder / f"{shard:05d}.npy", latents[start : start + shard_size].astype(np.float16))
        if flipped is not None:
            np.save(folder / f"{shard:05d}.flip.npy", flipped[start : start + shard_size].astype(np.float16))
        (folder / f"{shard:05d}.keys.txt").write_text("\n".join(keys[start : start + shard_size]) + "\n")
    meta = {"vae": "tiny", "scaling_factor": sd.model.SD1_SCALING_FACTOR, "count": len(keys),
            "resolution": int(latents.shape[-1]) * 8, "latent_shape": list(latents.shape[1:]),
            **({"flip": True} if flipped is not None else {})}
    (folder / "latents.json").write_text(json.dumps(meta))
    return folder


def make_captions(folder: Path, train: list[tuple[str, str]], validation: list[tuple[str, str]]) -> Path:
    """A datasets DatasetDict with train/validation splits of key, caption, input_ids."""
    from datasets import Dataset, DatasetDict

    tokenizer = sd.model.load_tokenizer("tiny")

    def split(rows):
        keys = [k for k, _ in rows]
        captions = [c for _, c in rows]
        ids = sd.model.tokenize(tokenizer, captions).numpy().astype(np.int32) if rows else np.zeros((0, 77), np.int32)
        return Dataset.from_dict({"key": keys, "caption": captions, "input_ids": ids.tolist()})

    # An empty split is left out: datasets cannot load back an empty split it saved.
    splits = {name: split(rows) for name, rows in (("train", train), ("validation", validation)) if rows}
    DatasetDict(splits).save_to_disk(str(folder))
    return folder


def make_dataset(root: Path, n_train: int = 64, n_val: int = 8, size: int = 8, seed: int = 0,
                 prefix: str = "s", flip: bool = False) -> dict:
    """A learnable toy set: each caption's class fixes a distinct latent pattern (plus a little noise)."""
    rng = np.random.default_rng(seed)
    patterns = rng.normal(0, 4, size=(len(WORDS), 4, size, size))
    n = n_train + n_val
    classes = np.arange(n) % len(WORDS)
    latents = patterns[classes] + rng.normal(0, 0.2, size=(n, 4, size, size))
    keys = [f"{prefix}{i:05d}" for i in range(n)]
    captions = [f"a {WORDS[c]}" for c in classes]
    make_latents(root / "latents", keys, latents, flipped=latents[..., ::-1] if flip else None)
    rows = list(zip(keys, captions))
    make_captions(root / "captions", rows[:n_train], rows[n_train:])
    return {"dataset": str(root / "captions"), "latents": str(root / "latents"), "weight": 1.0}


def train_tiny_run(root: Path, n_train: int, **fields) -> Path:
    """A tiny single-process training run on a fresh toy dataset under ``root``; returns its run folder.
    ``fields`` override the tiny fp32 CPU defaults (``max_steps``, ``validation_prompts``, ...)."""
    import SD_Train
    from sd.distributed import Dist
    from sd.train.config import TrainConfig

    data = make_dataset(root / "data", n_train=n_train, n_val=0)
    values = dict(datasets=[data], unet="tiny", vae="tiny", text_encoder="tiny", precision="fp32", device="cpu",
                  grad_checkpointing=False, batch_size=8, grad_accum=1, lr=3e-3, out_dir=str(root / "run"),
                  validation_cfg=4.0, validation_data_captions=0, seed=5)
    config = TrainConfig(**{**values, **fields})
    config.validate()
    assert SD_Train.train(config, Dist.single()) == 0
    return root / "run"


def assert_bitwise_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def checkpoint_state(run_dir: Path, step: int, weights: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint of rank 0 holds: the weight files ``weights`` (those present), the optimizer's
    moments and the RNGs (torch's and the noise generator's)."""
    from safetensors.torch import load_file


    folder = run_dir / "checkpoints" / sd.run_folder.step_dir_name(step)
    tensors = {}
    for name in weights:
        if (folder / f"{name}.safetensors").exists():
            tensors.update({f"{name}.{k}": v for k, v in load_file(folder / f"{name}.safetensors").items()})
    for index, state in torch.load(folder / "optimizer.pt", weights_only=True)["state"].items():
        tensors.update({f"opt.{index}.{k}": torch.as_tensor(v) for k, v in state.items()})
    rng = torch.load(folder / "rng_rank0.pt", weights_only=True)["rng"]
    tensors.update({"rng.torch": rng["torch"], "rng.noise": rng["noise"]})
    return tensors


def make_base_pipeline(folder: Path) -> Path:
    """A tiny diffusers pipeline folder whose UNet has non-zero output layers (a trained model's stand-in):
    the base of LoRA, DreamBooth and textual-inversion runs."""
    import sd.formats

    sd.formats.export_diffusers(folder, sd.model.build_unet("tiny", seed=3, from_scratch=False),
                                sd.model.load_vae("tiny"), sd.model.load_text_encoder("tiny"),
                                sd.model.load_tokenizer("tiny"))
    return folder


def draw_subject(folder: Path) -> Path:
    """Four 40 px pictures of a subject for DreamBooth and textual inversion: a cyan square on white,
    placed at random (seeded)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(4):
        image = np.full((40, 40, 3), 255, np.uint8)
        top, left = rng.integers(0, 20, 2)
        image[top : top + 16, left : left + 16] = (20, 190, 200)
        Image.fromarray(image).save(folder / f"sks_{i}.png")
    return folder


def make_pairs(root: Path, n_train: int = 16, n_val: int = 4, size: int = 8, seed: int = 0) -> dict:
    """Preference pairs of a toy set, as encode_latents.py --pairs writes them (shards of 8, each with its
    NNNNN.rejected.npy) with their captions: each caption's class fixes a latent pattern; the preferred latent is
    its own class's, the rejected one the next class's (the wrong picture for the caption)."""
    rng = np.random.default_rng(seed)
    patterns = rng.normal(0, 5, size=(len(WORDS), 4, size, size))  # about unit variance once scaled
    n = n_train + n_val
    classes = np.arange(n) % len(WORDS)
    preferred = patterns[classes] + rng.normal(0, 0.5, size=(n, 4, size, size))
    rejected = patterns[(classes + 1) % len(WORDS)] + rng.normal(0, 0.5, size=(n, 4, size, size))
    keys = [f"p{i:05d}" for i in range(n)]
    folder = make_latents(root / "latents", keys, preferred, shard_size=8)
    for shard, start in enumerate(range(0, n, 8)):
        np.save(folder / f"{shard:05d}.rejected.npy", rejected[start : start + 8].astype(np.float16))
    rows = list(zip(keys, [f"a {WORDS[c]}" for c in classes]))
    make_captions(root / "captions", rows[:n_train], rows[n_train:])
    return {"dataset": str(root / "captions"), "latents": str(folder)}
