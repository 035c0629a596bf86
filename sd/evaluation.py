"""Scores of generated images: FID, CLIP score and Inception Score (``SD_Eval.py``'s help has the
definitions and the choice of feature extractors).

Images are cut into batches in index order; batch k is made (or read) and scored on rank k mod world
size, and every batch's features are added to the running statistics in batch order, so the scores
are the same on any number of ranks. Memory is bounded by the batch: the statistics are running sums
over chunks of features, never the features of the whole set. ``TrainingEval`` is what the trainer
runs every ``eval_every`` steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import sd.cli
import sd.data.shards
import sd.distributed
import sd.files
import sd.model
import sd.runtime
import sd.sampling
from sd.distributed import Dist
from sd.settings import setting, NON_NEGATIVE, COUNT
from sd.cli import ConfigError

log = logging.getLogger("sd_eval")
FEATURES = ("inception", "tiny")
DEFAULT_CLIP_MODEL = "openai/clip-vit-large-patch14"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI's CLIP (and LAION's OpenCLIP) pixel normalisation
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IS_SPLITS = 10
TINY_SEED = 0
MAX_IMAGE_BYTES = 256 * 2**20


KEEP_BEST = ("", "fid", "clip_score")  # keep_best: what ranks the checkpoints (none, lowest FID, highest CLIP score)


@dataclass(frozen=True)
class ValidationConfig:
    """The validation loss and sample grid (validate_every and validation_prompts are top-level)."""

    data_captions: int = setting("captions of the training data (drawn with seed, the same all run) sampled "
                                 "in the grid after validation_prompts: the model's progress on its own "
                                 "data; not with control, whose prompts take images; 0 = none", 4,
                                 allowed=NON_NEGATIVE)
    samples: int = setting("held-out samples used for the validation loss", 256, allowed=COUNT)
    steps: int = setting("DDIM steps of the validation samples", 50, allowed=COUNT)
    cfg: float = setting("classifier-free guidance scale of the validation samples", 7.5,
                         allowed=NON_NEGATIVE)
    sampler: str = setting("sampler of the validation samples: auto (flow_euler for a flow run, ddim "
                           "otherwise), ddim, dpm++, euler, lcm (a distill: lcm run: e.g. 4 validation_steps "
                           "at validation_cfg 1), onestep (auto in a distill: dmd run: validation_steps dmd.steps at "
                           "validation_cfg 1), flow_euler or flow_heun", "auto")
    width: int = setting("width of the validation samples in pixels, a multiple of 8; 0 = the training "
                         "latents' size (with aspect-ratio buckets: the bucket nearest square)", 0,
                         allowed=NON_NEGATIVE)
    height: int = setting("height of the validation samples in pixels, a multiple of 8; 0 = as "
                          "validation_width's default", 0, allowed=NON_NEGATIVE)

    def check(self, config, check_paths: bool = True) -> None:
        """The grid's sampler at its steps and guidance, and its size."""
        problem = sd.sampling.settings_error(config.sampler, self.steps, self.cfg)
        if problem:
            raise ConfigError(f"validation.sampler {self.sampler}, validation.steps {self.steps}, validation.cfg "
                              f"{self.cfg:g} (the validation grid's and the evaluation's sampling): {problem}")
        if self.width % 8 or self.height % 8 or bool(self.width) != bool(self.height):
            raise ConfigError("validation.width and validation.height: both multiples of 8, or both 0 (got "
                              f"{self.width}x{self.height})")


@dataclass(frozen=True)
class EvalConfig:
    """FID and CLIP score during training."""

    every: int = setting("FID and CLIP score (SD_Eval.py) of the EMA weights every N optimizer steps and at the "
                         "last, logged to "
                         "metrics.jsonl as eval_fid / eval_clip_score; 0 = never", 0, allowed=NON_NEGATIVE)
    prompts: str = setting("prompts of the evaluation: a text file (one per line) or a .tsv/.csv with a caption "
                           "column; image i uses seed + i", "")
    n: int = setting("evaluate on the first N of eval_prompts (one image each)", 500, allowed=COUNT)
    reference: str = setting("reference of the FID: a folder of images (statistics cached in it) or an .npz "
                             "(mu, sigma) computed with the same eval_features", "")
    features: str = setting("FID network: inception (torch-fidelity's InceptionV3, needs torch-fidelity) or tiny "
                            "(offline stand-ins)", "inception")
    clip_model: str = setting("CLIP of the CLIP score (hub id or folder; empty = no CLIP score); the stand-in "
                              "with eval_features tiny", "openai/clip-vit-large-patch14")
    batch_size: int = setting("images per generation and feature batch of the evaluation", 16, allowed=COUNT)

    def check(self, config, check_paths: bool = True) -> None:
        """The features, the inputs the evaluation needs, and ``keep_best``, which ranks checkpoints by it."""
        if self.features not in ("inception", "tiny"):
            raise ConfigError("eval.features: inception or tiny")
        if config.keep_best not in KEEP_BEST:
            raise ConfigError(f"keep_best: {', '.join(repr(m) for m in KEEP_BEST)}, got {config.keep_best!r}")
        if config.keep_best and not self.every:
            raise ConfigError(f"keep_best: {config.keep_best} ranks the checkpoints by the in-training evaluation: "
                              "set eval.every (with eval.prompts and eval.reference), or keep_best: ''")
        if config.keep_best == "clip_score" and not self.clip_model:
            raise ConfigError("keep_best: clip_score needs the CLIP score: set eval.clip_model, or keep_best: fid")
        if self.every and not (self.prompts and self.reference):
            raise ConfigError("eval.every > 0 needs eval.prompts (a prompts file) and eval.reference (a folder of "
                              "images or an .npz)")
        for name, value in (("eval_prompts", self.prompts), ("eval_reference", self.reference)):
            if check_paths and self.every and not Path(value).exists():
                raise ConfigError(f"{name}: {value} does not exist")

class EvalError(ValueError):
    """A bad input or setting the user can fix; the message names it."""


# =============================================================================================
# Statistics
# =============================================================================================


class FeatureStats:
    """Running mean and covariance of features: float64 sums over fixed chunks of rows, in arrival order.

    Rows are gathered into chunks of ``chunk`` before each update, so the second moment is a few large
    matrix products rather than one small one per batch (as fast as ``np.cov`` over all the features,
    with memory bounded by the chunk); the chunks depend only on the order of the rows, never on how
    they arrive, so the result does not either.
    """

    def __init__(self, dim: int, chunk: int = 1024):
        self.n = 0
        self.non_finite = 0  # rows holding a NaN or an infinity: FID of them is undefined
        self.total = np.zeros(dim)
        self.outer = np.zeros((dim, dim))
        self.buffer = np.empty((chunk, dim))
        self.filled = 0

    def add(self, features: np.ndarray) -> None:  # (B, D)
        features = np.asarray(features)
        self.non_finite += int((~np.isfinite(features).all(axis=1)).sum())
        while len(features):
            take = min(len(features), len(self.buffer) - self.filled)
            self.buffer[self.filled : self.filled + take] = features[:take]
            self.filled += take
            features = features[take:]
            if self.filled == len(self.buffer):
                self._flush()

    def _flush(self) -> None:
        rows = self.buffer[: self.filled]
        self.n += self.filled
        self.total += rows.sum(0)
        self.outer += rows.T @ rows
        self.filled = 0

    def mean_cov(self, where: str = "") -> tuple[np.ndarray, np.ndarray]:
        """``mu`` and the unbiased covariance ``sigma`` (as ``np.cov``), for at least 2 samples (of ``where``)."""
        if self.filled:
            self._flush()
        prefix = f"{where}: " if where else ""
        if self.n < 2:
            raise EvalError(f"{prefix}FID needs at least 2 readable images, got {self.n}")
        if self.non_finite:
            raise EvalError(f"{prefix}{self.non_finite} of {self.n} images have features that are not finite (NaN "
                            "or inf), so FID is undefined: the feature network's weights or its precision are at fault")
        mu = self.total / self.n
        return mu, (self.outer - self.n * np.outer(mu, mu)) / (self.n - 1)


def psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    """The symmetric square root of a symmetric positive semi-definite matrix (negative rounding noise -> 0)."""
    values, vectors = np.linalg.eigh((matrix + matrix.T) / 2)
    return (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    """``|mu1 - mu2|^2 + tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^(1/2))``, in float64.

    ``tr (sigma1 sigma2)^(1/2)`` is taken as the sum of the square roots of the eigenvalues of the
    symmetric ``sigma1^(1/2) sigma2 sigma1^(1/2)``, which has the same eigenvalues: with fewer images
    than feature dimensions both covariances are singular, where ``scipy.linalg.sqrtm`` of the product
    returns complex values and needs an offset on the diagonal; the symmetric form stays real.
    """
    mu1, mu2 = np.asarray(mu1, np.float64), np.asarray(mu2, np.float64)
    sigma1, sigma2 = np.asarray(sigma1, np.float64), np.asarray(sigma2, np.float64)
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape:
        raise EvalError(f"FID of {mu1.shape[0]}-d features against {mu2.shape[0]}-d reference statistics: "
                        "compute both with the same --features")
    root = psd_sqrt(sigma1)
    middle = root @ sigma2 @ root
    trace_sqrt = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0, None)).sum()
    diff = mu1 - mu2
    value = float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2 * trace_sqrt)
    return max(value, 0.0)  # >= 0 exactly; a set against itself can round to -1e-12


class InceptionScore:
    """Inception Score over ``splits`` consecutive parts of ``n`` images, from running sums per part."""

    def __init__(self, n: int, splits: int = IS_SPLITS):
        self.n, self.splits = n, max(1, min(splits, n))
        self.p_sum: np.ndarray | None = None
        self.neg_entropy = np.zeros(self.splits)
        self.count = np.zeros(self.splits)
        self.non_finite = 0  # images whose logits hold a NaN or an infinity: their class probabilities are undefined

    def add(self, logits: np.ndarray, first_index: int) -> None:  # (B, C)
        logits = np.asarray(logits, np.float64)
        self.non_finite += int((~np.isfinite(logits).all(axis=1)).sum())
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        if self.p_sum is None:
            self.p_sum = np.zeros((self.splits, p.shape[1]))
        for i, row in enumerate(p):
            part = (first_index + i) * self.splits // self.n
            self.p_sum[part] += row
            self.neg_entropy[part] += _xlogx(row).sum()
            self.count[part] += 1

    def value(self, where: str = "") -> tuple[float, float]:
        """Mean and standard deviation over the splits of ``exp(E[KL(p(y|x) || p(y))])`` (a split whose
        images were all unreadable is left out); an ``EvalError`` when any image's logits were not finite."""
        if self.non_finite:
            raise EvalError(f"{where + ': ' if where else ''}{self.non_finite} of {int(self.count.sum())} images have "
                            "Inception logits that are not finite (NaN or inf), so the Inception Score is undefined: "
                            "the feature network's weights or its precision are at fault")
        used = self.count > 0
        p_mean = self.p_sum[used] / self.count[used, None]
        kl = self.neg_entropy[used] / self.count[used] - _xlogx(p_mean).sum(1)
        scores = np.exp(kl)
        return float(scores.mean()), float(scores.std())


def _xlogx(p: np.ndarray) -> np.ndarray:
    return np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)


def save_stats(path: Path, mu: np.ndarray, sigma: np.ndarray, n: int, features: str, fingerprint: str = "") -> None:
    """``mu``, ``sigma`` (pytorch-fid's keys), the image count, the extractor and the source's fingerprint."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            np.savez(handle, mu=mu, sigma=sigma, n=np.int64(n), features=np.str_(features),
                     fingerprint=np.str_(fingerprint))

    sd.files.write_atomic(path, write)


def load_stats(path: Path, features: str, dim: int) -> dict:
    """Reference statistics from an ``.npz`` (ours, pytorch-fid's or clean-fid's), checked against the extractor."""
    try:
        with np.load(path, allow_pickle=False) as data:
            stats = {name: data[name] for name in data.files}
    except (OSError, ValueError) as error:
        raise EvalError(f"{path}: not a readable .npz of FID statistics ({error})") from error
    if "mu" not in stats or "sigma" not in stats:
        raise EvalError(f"{path}: FID statistics need arrays 'mu' and 'sigma' (found {sorted(stats)})")
    recorded = str(stats["features"]) if "features" in stats else None
    if recorded is not None and recorded != features:
        raise EvalError(f"{path}: statistics of --features {recorded}, but this evaluation uses --features {features}")
    if stats["mu"].shape != (dim,) or stats["sigma"].shape != (dim, dim):
        raise EvalError(f"{path}: statistics of {stats['mu'].shape[-1]}-d features; --features {features} gives "
                        f"{dim}-d features: compute the reference with the same --features")
    return {"mu": finite_array(path, "mu", stats["mu"]), "sigma": finite_array(path, "sigma", stats["sigma"]),
            "n": int(stats["n"]) if "n" in stats else None, "fingerprint": str(stats.get("fingerprint", ""))}


def finite_array(path: Path, name: str, array: np.ndarray) -> np.ndarray:
    """``array`` as float64; values that are not numbers, or not finite, name the file: a NaN in ``mu``
    would make FID NaN, one in ``sigma`` stops the eigendecomposition."""
    if array.dtype.kind not in "biuf":
        raise EvalError(f"{path}: '{name}' holds {array.dtype} values, not numbers")
    bad = array.size - int(np.isfinite(array).sum())
    if bad:
        raise EvalError(f"{path}: '{name}' holds {bad} of {array.size} values that are not finite (NaN or inf); "
                        "compute the statistics again from the reference images")
    return array.astype(np.float64)


def clip_similarity(image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> np.ndarray:
    """Per pair, ``100 * max(cos(image, text), 0)``: torchmetrics' CLIPScore, before its mean."""
    cos = torch.nn.functional.cosine_similarity(image_embeds.double(), text_embeds.double(), dim=-1)
    return (100 * cos.clamp(min=0)).cpu().numpy()


# =============================================================================================
# Feature extractors
# =============================================================================================


class TinyInception(torch.nn.Module):
    """The offline stand-in for InceptionV3 with its interface: uint8 ``(B, 3, H, W)`` of any size in,
    ``(features (B, 64), logits (B, 10))`` out; resized to 32 px as Inception resizes to 299.

    Random convolutions with He-scaled weights (activations keep unit scale through the layers); the
    features are the spatial mean and standard deviation of the last layer's 32 channels, whose
    values are never all zero (no ReLU there), so no feature dimension is dead. They are scaled by
    ``scale`` so that FIDs of visibly different sets land in the units-to-hundreds range of Inception's.
    """

    size, dim, classes, scale = 32, 64, 10, 10.0

    def __init__(self):
        super().__init__()
        conv = torch.nn.Conv2d
        self.body = torch.nn.Sequential(conv(3, 32, 3, padding=1), torch.nn.ReLU(), conv(32, 64, 3, stride=2, padding=1),
                                        torch.nn.ReLU(), conv(64, self.dim // 2, 3, stride=2, padding=1))
        for layer in self.body:
            if isinstance(layer, conv):
                torch.nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                torch.nn.init.zeros_(layer.bias)
        self.fc = torch.nn.Linear(self.dim, self.classes)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.nn.functional.interpolate(images.float(), size=(self.size, self.size), mode="bilinear",
                                            align_corners=False)
        maps = self.body((x - 128) / 128)  # (B, 32, 8, 8)
        features = self.scale * torch.cat([maps.mean((2, 3)), maps.std((2, 3))], dim=1)
        return features, self.fc(features)


TINY_CLIP = dict(projection_dim=32,
                 text_config=dict(vocab_size=49408, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=77),
                 vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4))


def load_inception(features: str) -> tuple[torch.nn.Module, int]:
    """The FID network and its feature width."""
    if features == "tiny":
        with sd.model._seeded(TINY_SEED):
            return TinyInception().eval().requires_grad_(False), TinyInception.dim
    try:
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
    except ImportError as error:
        raise EvalError(f"--features inception needs torch-fidelity: pip install torch-fidelity (it needs torchvision); "
                        f"or --features tiny for the offline stand-ins ({error})") from error
    return FeatureExtractorInceptionV3("inception-v3-compat", ["2048", "logits_unbiased"]), 2048


def load_clip(features: str, clip_model: str):
    """``(CLIPModel, tokenizer)``: the tiny stand-in, or ``clip_model`` (a hub id or local folder)."""
    from transformers import CLIPConfig, CLIPModel

    if features == "tiny":
        with sd.model._seeded(TINY_SEED):
            model = CLIPModel(CLIPConfig(**TINY_CLIP))
        tokenizer = sd.model.load_tokenizer("tiny")
    else:
        model, tokenizer = CLIPModel.from_pretrained(clip_model), sd.model.load_tokenizer(clip_model)
    return model.eval().requires_grad_(False), tokenizer


class Extractors:
    """The FID network (features and logits) and, when prompts are scored, CLIP."""

    def __init__(self, features: str = "inception", clip_model: str | None = DEFAULT_CLIP_MODEL):
        if features not in FEATURES:
            raise EvalError(f"--features must be one of {', '.join(FEATURES)}, got {features!r}")
        self.name, self.clip_model = features, clip_model
        self.inception, self.dim = load_inception(features)
        self.clip, self.tokenizer = load_clip(features, clip_model) if clip_model else (None, None)
        self.device = torch.device("cpu")

    def to(self, device: torch.device) -> "Extractors":
        self.device = torch.device(device)
        self.inception.to(self.device)
        if self.clip is not None:
            self.clip.to(self.device)
        return self

    @torch.no_grad()
    def features(self, images: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Features ``(B, D)`` and logits ``(B, C)`` of RGB uint8 images ``(H, W, 3)`` (sizes may differ)."""
        features, logits = [None] * len(images), [None] * len(images)
        for rows in _same_size_groups(images):
            x = torch.from_numpy(np.stack([images[i] for i in rows])).permute(0, 3, 1, 2).to(self.device)
            with torch.autocast(self.device.type, enabled=False):
                f, l = self.inception(x)
            for i, fi, li in zip(rows, f.float().cpu().numpy(), l.float().cpu().numpy()):
                features[i], logits[i] = fi, li
        return np.stack(features), np.stack(logits)

    @torch.no_grad()
    def clip_scores(self, images: list[np.ndarray], prompts: list[str]) -> np.ndarray:
        """``100 * max(cos, 0)`` of each image with its prompt (text truncated to CLIP's 77 tokens)."""
        input_ids = sd.model.tokenize(self.tokenizer, prompts)  # padded after the end token, which the causal
        with torch.autocast(self.device.type, enabled=False):  # mask keeps out of the pooled embedding
            text = _projected(self.clip.get_text_features(input_ids=input_ids.to(self.device)))
            size = self.clip.config.vision_config.image_size
            pixels = torch.stack([clip_pixels(image, size) for image in images]).to(self.device)
            image_embeds = _projected(self.clip.get_image_features(pixel_values=pixels))
        return clip_similarity(image_embeds, text)


def _projected(output) -> torch.Tensor:
    """transformers 4 returns the projected embeddings, 5 an output whose ``pooler_output`` they are."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def clip_pixels(image: np.ndarray, size: int) -> torch.Tensor:
    """CLIP's preprocessing: shortest side to ``size`` (bicubic, antialiased), centre crop, normalise."""
    x = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float()
    h, w = x.shape[-2:]
    scale = size / min(h, w)
    new_h, new_w = max(size, round(h * scale)), max(size, round(w * scale))
    x = torch.nn.functional.interpolate(x, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    x = x[0, :, top : top + size, left : left + size].clamp(0, 255) / 255
    return (x - torch.tensor(CLIP_MEAN)[:, None, None]) / torch.tensor(CLIP_STD)[:, None, None]


def _same_size_groups(images: list[np.ndarray]) -> list[list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, image in enumerate(images):
        groups.setdefault(image.shape, []).append(i)
    return list(groups.values())


# =============================================================================================
# The evaluation loop: batches shared out across ranks, results added in batch order
# =============================================================================================


@dataclass
class Totals:
    """Everything the scores are computed from; the same on every rank."""

    stats: FeatureStats
    inception: InceptionScore | None
    clip_sum: float = 0.0
    clip_n: int = 0
    skipped: list = field(default_factory=list)

    def add(self, part: dict) -> None:
        if part["features"] is not None:
            self.stats.add(part["features"])
            if self.inception is not None:
                self.inception.add(part["logits"], part["first"])
        if part.get("clip") is not None:
            self.clip_sum += float(part["clip"].sum())
            self.clip_n += len(part["clip"])
        self.skipped += part["skipped"]


def gather_in_order(n_batches: int, work, d: Dist, desc: str = "evaluate", stop=None):
    """Yield ``work(k)`` for k = 0 .. n_batches - 1 in order on every rank; rank r computes k = r, r + W, ...

    Every rank takes part in each round's gather (a rank past the last batch contributes None), so no
    rank waits in a collective while another works alone for longer than one batch. ``stop``: asked
    before each batch (and by ``work``'s sampler between denoising steps, ``sd.sampling.Interrupted``);
    its answer travels with the round's gather, and once any rank's is True every rank raises
    ``sd.distributed.Stopped`` after that same gather. An error in ``work`` travels the same way: the
    failing rank raises it after the gather, every other rank ``sd.distributed.Failed`` naming it.
    """
    from tqdm.auto import tqdm

    stop = stop or (lambda: False)
    with tqdm(total=n_batches, desc=desc, unit="batch", disable=not d.is_main, leave=False) as bar:
        for first in range(0, n_batches, d.world_size):
            k = first + d.rank
            mine, error = None, None
            if k < n_batches and not stop():
                try:
                    mine = work(k)
                except sd.sampling.Interrupted:
                    pass  # stop() is True now: the gather below tells every rank
                except Exception as failed:  # noqa: BLE001 - told to every rank below, then raised here
                    if d.world_size == 1:
                        raise
                    error = failed
            told = error and sd.distributed.failure_text(error, d.rank)
            gathered = sd.distributed.all_gather_objects((mine, stop(), told), d)
            if any(stopping for _, stopping, _ in gathered):
                raise sd.distributed.Stopped
            sd.distributed.raise_failures([text for _, _, text in gathered], error)
            for part, _, _ in gathered:
                if part is not None:
                    yield part
                    bar.update(1)


def batches_of(n: int, batch_size: int) -> list[range]:
    return [range(start, min(start + batch_size, n)) for start in range(0, n, batch_size)]


def score_parts(parts, n: int, extractors: Extractors, inception_score: bool) -> Totals:
    totals = Totals(FeatureStats(extractors.dim), InceptionScore(n) if inception_score else None)
    for part in parts:
        totals.add(part)
    return totals


def scores_of(totals: Totals, reference: dict, inception_score: bool, where: str = "") -> dict:
    mu, sigma = totals.stats.mean_cov(where)
    result = {"fid": frechet_distance(mu, sigma, reference["mu"], reference["sigma"]), "n": totals.stats.n}
    if totals.clip_n:
        result["clip_score"] = totals.clip_sum / totals.clip_n
    if inception_score:
        result["inception_score"], result["inception_score_std"] = totals.inception.value(where)
    return result


# ---------------------------------------------------------------------------------------------
# Image folders
# ---------------------------------------------------------------------------------------------


def image_files(folder: Path) -> list[Path]:
    """The images directly in ``folder``, sorted by name."""
    if not folder.is_dir():
        raise EvalError(f"{folder}: no such folder of images")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower().lstrip(".") in sd.data.shards.IMAGE_EXTENSIONS)
    if not files:
        raise EvalError(f"{folder}: no images (.{', .'.join(sd.data.shards.IMAGE_EXTENSIONS)})")
    return files


def read_image(path: Path, size: int = 0) -> np.ndarray:
    """RGB uint8; ``size``: the centre square scaled to ``size`` px. Raises ``sd.data.shards.ImageSkip``."""
    image = sd.data.shards.decode_image(sd.files.read_file_bounded(path, MAX_IMAGE_BYTES), path.suffix.lstrip("."))
    return sd.data.shards.resize_center_crop(image, size) if size else image


def scored_part(extractors: Extractors, images: list[np.ndarray], prompts: list[str] | None, first: int,
                skipped: list | None = None) -> dict:
    """One batch's contribution (``Totals.add``): features, logits and, with prompts and CLIP, CLIP scores."""
    part = {"first": first, "skipped": skipped or [], "features": None, "logits": None, "clip": None}
    if images:
        part["features"], part["logits"] = extractors.features(images)
        if prompts is not None and extractors.clip is not None:
            part["clip"] = extractors.clip_scores(images, prompts)
    return part


def folder_work(files: list[Path], batches: list[range], extractors: Extractors, prompts: list[str] | None,
                size: int = 0):
    """``work(k)`` for ``gather_in_order``: features (and CLIP scores) of the k-th batch of ``files``."""
    def work(k: int) -> dict:
        images, texts, skipped = [], [], []
        for i in batches[k]:
            try:
                images.append(read_image(files[i], size))
                texts.append(prompts[i] if prompts else None)
            except (sd.data.shards.ImageSkip, OSError) as error:
                skipped.append(f"{files[i].name}: {error}")
        return scored_part(extractors, images, texts if prompts else None, batches[k].start, skipped)

    return work


def files_fingerprint(files: list[Path], size: int) -> str:
    """Names, sizes and modification times of the reference images: a change invalidates the cache."""
    digest = hashlib.sha256(f"size={size}".encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def reference_stats(reference: str, extractors: Extractors, d: Dist, batch_size: int, size: int = 0) -> dict:
    """``mu`` / ``sigma`` of the reference: an ``.npz``, or a folder's images (computed across the ranks once,
    then cached in the folder as ``fid_stats.<features>[.<size>].npz``)."""
    path = Path(reference)
    if path.suffix == ".npz" or path.is_file():
        if not path.is_file():
            raise EvalError(f"--reference {path}: no such file")
        return {**load_stats(path, extractors.name, extractors.dim), "path": str(path)}
    files, _ = listed_images(path)
    cache = path / f"fid_stats.{extractors.name}{f'.{size}' if size else ''}.npz"
    fingerprint = files_fingerprint(files, size)
    if cache.exists():
        try:
            stats = load_stats(cache, extractors.name, extractors.dim)
        except EvalError as error:  # a damaged cache: the images are there to compute it again
            log.warning("%s; computing again", error)
        else:
            if stats["fingerprint"] == fingerprint:
                return {**stats, "path": str(cache)}
            log.info("%s: the reference images changed since it was written; computing again", cache)
    batches = batches_of(len(files), batch_size)
    parts = gather_in_order(len(batches), folder_work(files, batches, extractors, None, size), d, desc="reference")
    totals = score_parts(parts, len(files), extractors, False)
    _log_skipped(totals.skipped, path)
    mu, sigma = totals.stats.mean_cov(str(path))
    if d.is_main:
        try:
            save_stats(cache, mu, sigma, totals.stats.n, extractors.name, fingerprint)
            log.info("reference statistics of %d images cached in %s", totals.stats.n, cache)
        except OSError as error:  # a read-only reference folder: computed again next time
            log.warning("could not cache the reference statistics in %s: %s", cache, error)
    return {"mu": mu, "sigma": sigma, "n": totals.stats.n, "fingerprint": fingerprint, "path": str(cache)}


def _log_skipped(skipped: list, where) -> None:
    if skipped:
        log.warning("%s: skipped %d unreadable images, first: %s", where, len(skipped), skipped[0])


# ---------------------------------------------------------------------------------------------
# Generated images
# ---------------------------------------------------------------------------------------------


@dataclass
class Sampling:
    """How the evaluated images are generated: the settings of SD_ImageGen.py."""

    steps: int = 50
    cfg: float = 7.5
    sampler: str = "ddim"
    negative: str = ""
    seed: int = 0
    height: int = 512
    width: int = 512


def generated_work(pipe, prompts: list[str], batches: list[range], settings: Sampling, extractors: Extractors,
                   device: torch.device, images_dir: Path | None = None, source: str = "", stop=None):
    """``work(k)`` for ``gather_in_order``: generate the k-th batch of prompts (image i: seed + i) and score it.

    With ``images_dir`` each image is kept as ``NNNNNN.png`` and a batch already there is read back
    instead (a re-run resumes); PNG is lossless, so the scores are the same either way. ``stop``: see
    ``gather_in_order``.
    """

    def work(k: int) -> dict:
        rows = batches[k]
        paths = [images_dir / f"{i:06d}.png" for i in rows] if images_dir is not None else None
        if paths and all(p.exists() for p in paths):
            images = [read_image(p) for p in paths]
        else:
            images = sd.sampling.generate_batch(pipe, [prompts[i] for i in rows], settings.negative,
                                                [settings.seed + i for i in rows], steps=settings.steps,
                                                cfg=settings.cfg, sampler=settings.sampler, height=settings.height,
                                                width=settings.width, device=device, stop=stop)
            for i, path, image in zip(rows, paths or [], images):
                sd.sampling.save_png(path, image, sd.sampling.parameters_text(
                    prompts[i], settings.negative, settings.seed + i, settings, source,
                    sd.model.clip_skip_of(pipe.text_encoder)))
        return scored_part(extractors, images, [prompts[i] for i in rows], rows.start)

    return work


def evaluate_pipeline(pipe, prompts: list[str], settings: Sampling, extractors: Extractors, reference: dict,
                      d: Dist, batch_size: int, images_dir: Path | None = None, inception_score: bool = False,
                      source: str = "", stop=None) -> dict:
    """Generate one image per prompt with ``pipe`` (shared out across the ranks) and score them; ``stop``:
    see ``gather_in_order``."""
    if images_dir is not None:
        claim_images_dir(images_dir, {"ckpt": source, **vars(settings), "batch_size": batch_size, "n": len(prompts),
                                      "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest()}, d)
    batches = batches_of(len(prompts), batch_size)
    work = generated_work(pipe, prompts, batches, settings, extractors, d.device, images_dir, source, stop)
    totals = score_parts(gather_in_order(len(batches), work, d, desc="generate+score", stop=stop), len(prompts),
                         extractors, inception_score)
    if images_dir is not None and d.is_main:
        records = [{"file": f"{i:06d}.png", "prompt": prompt, "negative": settings.negative, "seed": settings.seed + i}
                   for i, prompt in enumerate(prompts)]
        sd.files.write_json_atomic(images_dir / "images.json", records)
    return scores_of(totals, reference, inception_score,
                     str(images_dir) if images_dir is not None else "the generated images")


def claim_images_dir(images_dir: Path, generation: dict, d: Dist) -> None:
    """Record how the folder's images are generated (``generation.json``); a folder made with other
    settings is refused, so a re-run never scores stale images with new ones."""
    record = images_dir / "generation.json"
    if record.exists():
        try:
            before = json.loads(record.read_text())
        except ValueError as error:
            raise EvalError(f"{record}: not JSON ({error}); delete it or use a fresh --images") from error
        changed = sorted(k for k in set(before) | set(generation) if before.get(k) != generation.get(k))
        if changed:
            raise EvalError(f"{images_dir} holds images generated with other settings ({', '.join(changed)} differ: "
                            f"{before.get(changed[0])!r} then, {generation.get(changed[0])!r} now); use a fresh "
                            "--images folder or delete this one")
        return
    sd.distributed.barrier(d)  # every rank has looked before rank 0 writes it
    images_dir.mkdir(parents=True, exist_ok=True)
    if d.is_main:
        sd.files.write_json_atomic(record, generation)


def evaluate_folder(images_dir: Path, prompts: list[str] | None, extractors: Extractors, reference: dict, d: Dist,
                    batch_size: int, inception_score: bool = False) -> dict:
    """Score the images of a folder (``listed_images``); ``prompts``: line i belongs to the i-th image by
    name (default: the folder's ``images.json``)."""
    files, listed = listed_images(images_dir)
    if prompts is not None and len(prompts) != len(files):
        raise EvalError(f"{len(prompts)} prompts for {len(files)} images in {images_dir}: give one prompt per image "
                        "(line i for the i-th image by name)")
    prompts = prompts if prompts is not None else listed
    if extractors.clip is None:
        prompts = None
    batches = batches_of(len(files), batch_size)
    parts = gather_in_order(len(batches), folder_work(files, batches, extractors, prompts), d, desc="score")
    totals = score_parts(parts, len(files), extractors, inception_score)
    _log_skipped(totals.skipped, images_dir)
    result = scores_of(totals, reference, inception_score, str(images_dir))
    if totals.skipped:
        result["skipped"] = totals.skipped
    return result


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def read_prompts(path: str | Path, n: int | None = None) -> list[str]:
    """The first ``n`` prompts of a text file (one per line) or a .tsv / .csv with a ``caption`` column
    (the COCO captions files of MLPerf's evaluation)."""
    path = Path(path)
    if not path.is_file():
        raise EvalError(f"prompts file {path} does not exist")
    if path.suffix in (".tsv", ".csv"):
        import csv

        with open(path, newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle, delimiter="\t" if path.suffix == ".tsv" else ",")
            if "caption" not in (reader.fieldnames or []):
                raise EvalError(f"{path}: a .tsv/.csv of prompts needs a 'caption' column (has {reader.fieldnames})")
            prompts = [row["caption"].strip() for row in reader]
    else:
        prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if n is not None and n > len(prompts):
        raise EvalError(f"{path} has {len(prompts)} prompts, fewer than the {n} asked for (--num_prompts, eval_n)")
    if not prompts:
        raise EvalError(f"{path}: no prompts")
    return prompts[:n] if n else prompts


def listed_images(images_dir: Path) -> tuple[list[Path], list[str] | None]:
    """The images of a folder and their prompts: those ``images.json`` names (SD_ImageGen.py and this
    script write it; SD_ImageGen.py's ``grid.png`` beside them is not one of them), else every image
    with no prompts; sorted by name."""
    records_path = images_dir / "images.json"
    if not records_path.exists():
        return image_files(images_dir), None
    try:
        records = {r["file"]: r["prompt"] for r in json.loads(records_path.read_text())}
    except (ValueError, KeyError, TypeError) as error:
        raise EvalError(f"{records_path}: not a list of {{file, prompt}} records ({error})") from error
    missing = sorted(name for name in records if not (images_dir / name).is_file())
    if missing:
        raise EvalError(f"{records_path} names {len(missing)} images that are not in {images_dir}, e.g. {missing[0]}")
    if not records:
        raise EvalError(f"{records_path}: no images")
    names = sorted(records)
    return [images_dir / name for name in names], [records[name] for name in names]


# =============================================================================================
# During training
# =============================================================================================


@dataclass(frozen=True)
class EvalSettings:
    """The config fields the trainer's evaluation reads: what it scores with and against, and the
    validation sampler it draws its images with."""

    eval_prompts: str = ""
    eval_n: int = 0
    eval_reference: str = ""
    eval_features: str = "inception"
    eval_clip_model: str = ""
    eval_batch_size: int = 16
    validation_steps: int = 30
    validation_cfg: float = 7.5
    validation_sampler: str = "ddim"
    seed: int = 0

    @classmethod
    def from_config(cls, config) -> "EvalSettings":
        return sd.cli.view_of(cls, config, validation_sampler=config.sampler)


@dataclass
class TrainingEval:
    """The trainer's evaluation: a fixed prompt subset scored against cached reference statistics."""

    prompts: list[str]
    extractors: Extractors
    reference: dict
    settings: Sampling
    batch_size: int

    @classmethod
    def build(cls, settings: EvalSettings, d: Dist, width: int, height: int) -> "TrainingEval":
        """At the start of a run, on every rank (a reference folder's statistics are computed across them)."""
        extractors = Extractors(settings.eval_features, settings.eval_clip_model or None).to(d.device)
        try:
            reference = reference_stats(settings.eval_reference, extractors, d, settings.eval_batch_size)
        finally:
            extractors.to("cpu")  # on the GPU only while it evaluates
        sampling = Sampling(steps=settings.validation_steps, cfg=settings.validation_cfg,
                            sampler=settings.validation_sampler, seed=settings.seed, height=height, width=width)
        return cls(read_prompts(settings.eval_prompts, settings.eval_n), extractors, reference, sampling,
                   settings.eval_batch_size)

    def __call__(self, pipe, d: Dist, stop=None) -> dict:
        """The scores of ``pipe``; ``stop``: see ``gather_in_order`` (``sd.distributed.Stopped`` on every rank)."""
        self.extractors.to(d.device)
        try:
            scores = evaluate_pipeline(pipe, self.prompts, self.settings, self.extractors, self.reference, d,
                                       self.batch_size, stop=stop)
        finally:
            self.extractors.to("cpu")
        return {f"eval_{name}": value for name, value in scores.items()}
