"""Automatic captions and tags for images: the models behind ``pipeline/03c_caption_images.py``.

* ``Captioner``: an image-to-text model through transformers (BLIP, Florence-2, or another model whose
  processor takes images and a prompt), batched, greedy or beam search, its text cleaned.
* ``Tagger``: a WD14-style booru tagger (SmilingWolf's ONNX models: ``model.onnx`` + ``selected_tags.csv``)
  through onnxruntime, returning every tag scored at least ``TAG_FLOOR`` with its category, so the
  thresholds can be changed without running the model again.
* ``ComposeOptions`` and ``compose``: one sample's final caption from its existing caption, the generated
  one and its tags (a trigger word first, the tags thresholded, dropped, de-underscored).

torch and transformers are imported where a model is loaded, not with this module (a stage's --help stays quick).
Models load from a hub id or a local folder; one that cannot be loaded is a ``ModelLoadError``, one line
naming the model and the ways to fix it, never a silent fallback.
"""

from __future__ import annotations

import csv
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

import sd.cli

CAPTIONERS = {"blip": "Salesforce/blip-image-captioning-large", "florence2": "florence-community/Florence-2-base"}
# What each family is asked: BLIP captions without a prompt; Florence-2 is told its task by a task token.
DEFAULT_PROMPTS = {"blip": "", "florence2": "<DETAILED_CAPTION>"}
TAGGERS = {"wd14": "SmilingWolf/wd-swinv2-tagger-v3"}
# Small random models built offline (sd.data.tiny_captioners), to try the stage without the hub: the captioner's
# words are nonsense, the tagger's tags follow the image's colours (red theme, blue theme, ...).
TINY = "tiny"
TAGGER_FILES = ("model.onnx", "selected_tags.csv")
TAG_FLOOR = 0.1  # tags scored below this are not kept at all; the thresholds apply when captions are composed
# WD14's categories in selected_tags.csv
GENERAL, CHARACTER, RATING = 0, 4, 9
MIN_WORD_CHARACTERS = 4  # a tag with fewer letters and digits is an emoticon (^_^, o_o): its underscores stay


class ModelLoadError(RuntimeError):
    """A captioning or tagging model that cannot be loaded, in one line naming it and the fixes."""


def _fixes(name: str, what: str) -> str:
    import sd.model

    offline = sd.model.hub_options(name)
    reach = ("the hub cannot be reached (HF_HUB_OFFLINE set, or no network) and it is not in the local cache; "
             if offline else "")
    return (f"{reach}give a local folder holding the {what} (hf download {name} --local-dir DIR on a "
            "machine with internet, then copy DIR here), or run where the hub is reachable")


# ---------------------------------------------------------------------------------------------
# Captioner
# ---------------------------------------------------------------------------------------------


@dataclass
class Captioner:
    processor: object
    model: object
    family: str  # the config's model_type: blip, florence2, or another image-text-to-text model
    prompt: str
    max_length: int
    num_beams: int
    device: object
    dtype: object

    @property
    def decoder_only_output(self) -> bool:
        """Whether ``generate`` returns the prompt's tokens before the new ones (BLIP does; encoder-decoder
        models such as Florence-2 return only the answer)."""
        return not getattr(self.model.config, "is_encoder_decoder", False)

    def caption(self, images: list) -> list[str]:
        """One caption per PIL image, in order (greedy decoding, or beam search with ``num_beams``)."""
        import torch

        texts = [self.prompt] * len(images) if self.prompt else None
        inputs = self.processor(images=images, text=texts, return_tensors="pt")
        inputs = {name: value.to(self.device, dtype=self.dtype) if value.is_floating_point() else value.to(self.device)
                  for name, value in inputs.items()}
        with torch.inference_mode():
            tokens = self.model.generate(**inputs, max_new_tokens=self.max_length, num_beams=self.num_beams,
                                         do_sample=False)
        decoded = self.processor.batch_decode(tokens, skip_special_tokens=True)
        return [clean_caption(text, self.prompt if self.decoder_only_output else "") for text in decoded]


def clean_caption(text: str, prompt: str = "") -> str:
    """``text`` on one line with single spaces, the prompt it was asked to continue taken off its front."""
    text = " ".join(text.split())
    prompt = " ".join(prompt.split())
    if prompt and text.lower().startswith(prompt.lower()):
        text = text[len(prompt):].strip()
    return text


def load_captioner(name_or_path: str, *, device, dtype, prompt: str | None = None, max_length: int = 75,
                   num_beams: int = 1) -> Captioner:
    """The captioning model ``name_or_path`` (a hub id or a local folder; ``blip`` and ``florence2`` name
    the default models of those families) in ``dtype`` on ``device``, asked ``prompt`` (None: its family's
    default)."""
    import transformers

    import sd.model

    if name_or_path == TINY:
        from sd.data import tiny_captioners

        with tempfile.TemporaryDirectory() as folder:  # read whole by from_pretrained; gone once loaded
            return load_captioner(str(tiny_captioners.tiny_blip(Path(folder) / "blip")), device=device,
                                  dtype=dtype, prompt=prompt, max_length=max_length, num_beams=num_beams)
    name = CAPTIONERS.get(name_or_path, name_or_path)
    options = sd.model.hub_options(name)
    try:
        config = transformers.AutoConfig.from_pretrained(name, **options)
        processor = transformers.AutoProcessor.from_pretrained(name, **options)
        model = transformers.AutoModelForImageTextToText.from_pretrained(name, **options)
    except (OSError, ValueError, KeyError, ImportError) as error:
        raise ModelLoadError(f"captioning model {name}: cannot be loaded ({sd.cli.first_line(error)}); "
                             f"{_fixes(name, 'model and its processor')}") from error
    family = config.model_type
    if family == "florence2" and prompt is not None and not prompt.startswith("<"):
        raise ModelLoadError(f"captioning model {name}: Florence-2 takes a task token as its prompt "
                             f"(<CAPTION>, <DETAILED_CAPTION>, <MORE_DETAILED_CAPTION>), not {prompt!r}")
    model.requires_grad_(False).eval().to(device=device, dtype=dtype)  # (from_pretrained's dtype argument is
    # spelled torch_dtype before transformers 4.56)
    return Captioner(processor, model, family, DEFAULT_PROMPTS.get(family, "") if prompt is None else prompt,
                     max_length, num_beams, device, dtype)


# ---------------------------------------------------------------------------------------------
# Tagger
# ---------------------------------------------------------------------------------------------


@dataclass
class Tagger:
    session: object  # onnxruntime.InferenceSession
    names: list[str]
    categories: np.ndarray  # (T,) int
    size: int  # the square side the model reads
    batched: bool  # whether the model takes more than one image a call

    def tag(self, images: list) -> list[list[tuple[str, float, int]]]:
        """Per PIL image, ``(tag, score, category)`` of every tag scored at least ``TAG_FLOOR``, best first."""
        batch = np.stack([self.pixels(image) for image in images])
        input_name = self.session.get_inputs()[0].name
        if self.batched:
            scores = self.session.run(None, {input_name: batch})[0]
        else:
            scores = np.concatenate([self.session.run(None, {input_name: one[None]})[0] for one in batch])
        results = []
        for row in np.asarray(scores, np.float32):
            picked = np.flatnonzero(row >= TAG_FLOOR)
            picked = picked[np.argsort(-row[picked], kind="stable")]
            results.append([(self.names[i], round(float(row[i]), 4), int(self.categories[i])) for i in picked])
        return results

    def pixels(self, image) -> np.ndarray:
        """WD14's input: the image padded to a square with white, scaled to ``size`` (bicubic), BGR, float32
        0..255, channels last."""
        from PIL import Image

        image = image.convert("RGB")
        side = max(image.size)
        square = Image.new("RGB", (side, side), (255, 255, 255))
        square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
        if side != self.size:
            square = square.resize((self.size, self.size), Image.BICUBIC)
        return np.asarray(square, np.float32)[:, :, ::-1].copy()


def tagger_files(name: str) -> tuple[Path, Path]:
    """``model.onnx`` and ``selected_tags.csv`` of a local folder, or downloaded from the hub id ``name``."""
    folder = Path(name)
    if folder.is_dir():
        paths = [folder / file for file in TAGGER_FILES]
        missing = [path.name for path in paths if not path.is_file()]
        if missing:
            raise FileNotFoundError(f"{folder} has no {' or '.join(missing)}")
        return paths[0], paths[1]
    if not sd.cli.looks_like_hub_id(name):
        raise FileNotFoundError(f"{name} is neither a folder nor a hub id")
    from huggingface_hub import hf_hub_download

    import sd.model

    options = sd.model.hub_options(name)
    model, tags = (Path(hf_hub_download(name, file, **options)) for file in TAGGER_FILES)
    return model, tags


def read_tag_table(path: Path) -> tuple[list[str], np.ndarray]:
    """Tag names and categories of a ``selected_tags.csv`` (columns ``name`` and ``category``)."""
    with open(path, newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    if not rows or "name" not in rows[0] or "category" not in rows[0]:
        raise ValueError(f"{path} has no name and category columns")
    return [row["name"] for row in rows], np.array([int(row["category"]) for row in rows])


def onnx_providers(device) -> list:
    """onnxruntime's providers for ``device``: CUDA on that GPU when onnxruntime has it, else the CPU."""
    import onnxruntime

    available = onnxruntime.get_available_providers()
    if getattr(device, "type", "cpu") == "cuda" and "CUDAExecutionProvider" in available:
        return [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def load_tagger(name_or_path: str, *, device=None, threads: int | None = None) -> Tagger:
    """The WD14 tagger ``name_or_path`` (a hub id or a local folder with ``model.onnx`` and
    ``selected_tags.csv``; ``wd14`` names the default model, ``tiny`` a small one built here)."""
    name = TAGGERS.get(name_or_path, name_or_path)
    try:
        onnxruntime = sd.cli.import_extra("onnxruntime", "caption", "the tagger")
        if name_or_path == TINY:
            from sd.data import tiny_captioners

            with tempfile.TemporaryDirectory() as folder:  # onnxruntime holds the model in memory once loaded
                return load_tagger(str(tiny_captioners.tiny_tagger(Path(folder) / "tagger")), device=device,
                                   threads=threads)
    except sd.cli.MissingExtra as error:
        raise ModelLoadError(f"tagger {name}: {error}; onnxruntime-gpu runs it on a GPU") from error
    try:
        model_path, tags_path = tagger_files(name)
        names, categories = read_tag_table(tags_path)
        options = onnxruntime.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        session = onnxruntime.InferenceSession(str(model_path), options, providers=onnx_providers(device))
    except Exception as error:  # noqa: BLE001 - hub, file and onnxruntime errors alike: one line, the fixes
        raise ModelLoadError(f"tagger {name}: cannot be loaded ({sd.cli.first_line(error)}); "
                             f"{_fixes(name, 'model.onnx and selected_tags.csv')}") from error
    shape = session.get_inputs()[0].shape  # (batch, height, width, 3)
    outputs = session.get_outputs()[0].shape
    if len(shape) != 4 or shape[3] != 3 or (isinstance(outputs[-1], int) and outputs[-1] != len(names)):
        raise ModelLoadError(f"tagger {name}: expects input (batch, side, side, 3) and one score per row of "
                             f"selected_tags.csv, found input {shape} and output {outputs} for {len(names)} tags")
    size = shape[1] if isinstance(shape[1], int) else 448
    return Tagger(session, names, categories, size, batched=not isinstance(shape[0], int) or shape[0] != 1)


# ---------------------------------------------------------------------------------------------
# Composing a caption
# ---------------------------------------------------------------------------------------------

EXISTING = ("keep", "replace", "join")


@dataclass(frozen=True)
class ComposeOptions:
    """How a sample's final caption is made from what it had and what the models said."""

    existing: str = "keep"  # keep: a caption already there stays; replace: the generated one; join: both
    trigger: str = ""  # put first in every caption (a trigger word, a class), unless it is there already
    tags_first: bool = False  # tags before the generated caption (booru order) instead of after it
    threshold: float = 0.35  # general tags scored at least this are kept
    character_threshold: float = 0.85  # character tags scored at least this are kept
    rating_tags: bool = False  # the most likely rating tag (general, sensitive, questionable, explicit) kept
    replace_underscores: bool = True  # long_hair -> long hair (emoticons such as ^_^ keep theirs)
    drop_tags: tuple = ()  # tags never written (either spelling)
    min_tag_count: int = 1  # tags kept by fewer images than this in the whole dataset are dropped

    def record(self) -> dict:
        return {**asdict(self), "drop_tags": sorted(self.drop_tags)}


def tag_text(tag: str, options: ComposeOptions) -> str:
    if options.replace_underscores and sum(c.isalnum() for c in tag) >= MIN_WORD_CHARACTERS:
        return tag.replace("_", " ")
    return tag


def kept_tags(tags: list, options: ComposeOptions) -> list[str]:
    """The tags a sample keeps before dataset-wide counts: characters first, then general tags, then the
    rating, each over its threshold, best first; dropped tags left out; spelled as written."""
    drop = {form for tag in options.drop_tags for form in (tag, tag.replace("_", " "), tag.replace(" ", "_"))}
    characters = [t for t, s, c in tags if c == CHARACTER and s >= options.character_threshold]
    general = [t for t, s, c in tags if c not in (CHARACTER, RATING) and s >= options.threshold]
    ratings = [t for t, s, c in tags if c == RATING][:1] if options.rating_tags else []
    picked = []
    for tag in characters + general + ratings:
        text = tag_text(tag, options)
        if tag not in drop and text not in drop and text not in picked:
            picked.append(text)
    return picked


def compose(existing: str, generated: str, tags: list[str], options: ComposeOptions,
            counts: Counter | None = None) -> str:
    """The final caption: trigger, then the caption (kept, generated or both), tags after it (or before it
    with ``tags_first``); ``counts`` (images per tag over the dataset) applies ``min_tag_count``."""
    if counts is not None and options.min_tag_count > 1:
        tags = [tag for tag in tags if counts[tag] >= options.min_tag_count]
    existing, generated = existing.strip(), generated.strip()
    if options.existing == "keep" and existing:
        text, tags = existing, []
    elif options.existing == "join":
        text = ", ".join(part for part in (existing, generated) if part)
    else:
        text = generated
    parts = [*tags, text] if options.tags_first else [text, *tags]
    parts = [part for part in parts if part]
    trigger = options.trigger.strip()
    if trigger and not (parts and parts[0].lower().startswith(trigger.lower())):
        parts = [trigger, *[part for part in parts if part != trigger]]
    return ", ".join(parts)


def caption_tags(caption: str) -> list[str]:
    """A caption's comma-separated pieces, trimmed, empty ones left out: what ``ss_tag_frequency`` counts."""
    return [piece.strip() for piece in caption.split(",") if piece.strip()]


def tag_counts(captions) -> Counter:
    """Images per tag over ``captions`` (a tag counted once per caption)."""
    counts = Counter()
    for caption in captions:
        counts.update(set(caption_tags(caption)))
    return counts
