"""Caption operations at each training step, and caption text tokenised in the loader.

A tag caption is tags joined by a separator (``"1girl, solo, long hair, smile"``). ``CaptionOps`` says
what a step does to it, kohya's sd-scripts' way: the first ``keep_tokens`` tags stay in place and are
never dropped; each later tag is dropped with probability ``tag_dropout``; and with probability
``shuffle_tags`` the remaining later tags are shuffled. ``caption_ids`` applies the operations to a
batch of captions and tokenises the result with the tokenizer it is given, so a mode that changes the
tokenizer (textual inversion's new tokens) can also re-tokenise captions with no operation at all.

Every draw for a sample comes from a generator of its own, seeded by the sample's key
(``draw_keys``: the run's seed, the epoch and the sample's position in the epoch's order): a
function of where the sample sits in the run, never of when its batch is built or what was drawn
before, so a resumed run draws exactly what the uninterrupted one did. The whole-caption drop for
classifier-free guidance is not here: it stays ``cfg_dropout``, done in the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import sd.model
from sd.settings import setting, refused, NON_NEGATIVE, FRACTION, MATH
from sd.cli import ConfigError

_CAPTION_STREAM = 0x63617074  # "capt": keeps these draws apart from every other stream seeded from the run


@dataclass(frozen=True)
class CaptionsConfig:
    """Caption operations at each step (tag captions): shuffling and dropping tags."""

    shuffle_tags: float = setting("tag captions: probability that a sample's tags after the first keep_tokens are "
                                  "shuffled, drawn anew at every step; 0 = off (0.5: half the samples)", 0.0,
                                  allowed=FRACTION, resume=refused(MATH))
    keep_tokens: int = setting("tag captions: tags at the front of each caption that shuffle_tags and tag_dropout "
                               "leave in place", 0, allowed=NON_NEGATIVE, resume=refused(MATH))
    tag_dropout: float = setting("tag captions: probability that each tag after the first keep_tokens is left out of "
                                 "a sample's caption at a step; 0 = off", 0.0, allowed=FRACTION, resume=refused(MATH))
    tag_separator: str = setting("tag captions: what joins the tags; captions are split on its non-blank part (on "
                                 "blanks if it is blank)", ", ", resume=refused(MATH))

    def check(self, config, check_paths: bool = True) -> None:
        """``shuffle_tags`` / ``tag_dropout`` and the settings they cannot run with, each refused with the way out."""
        if self.tag_separator == "":
            raise ConfigError("captions.tag_separator must not be empty; use ', ' (tags joined by commas) or ' ' "
                              "(by blanks)")
        if not (self.shuffle_tags or self.tag_dropout):
            return
        on = "captions.shuffle_tags" if self.shuffle_tags else "captions.tag_dropout"
        if config.subject.instance_dir:
            raise ConfigError(f"{on} changes dataset captions at each step; a DreamBooth run (subject.instance_dir) "
                              "has one fixed subject.instance_prompt: set captions.shuffle_tags: 0 and "
                              "captions.tag_dropout: 0, or train on datasets")
        if config.cache_text_embeddings:
            raise ConfigError(f"{on} makes a new prompt at each step, so the prompts are no fixed set whose "
                              "embeddings could be cached: set cache_text_embeddings: false, or "
                              "captions.shuffle_tags: 0 and captions.tag_dropout: 0")

@dataclass(frozen=True)
class CaptionOps:
    """What a step does to a tag caption (all off by default: the caption is used as written)."""

    shuffle_tags: float = 0.0  # probability that a sample's tags after the first keep_tokens are shuffled
    keep_tokens: int = 0  # tags at the front that never move and are never dropped
    tag_dropout: float = 0.0  # probability that each tag after the first keep_tokens is dropped
    tag_separator: str = ", "  # what joins the tags; split on its non-blank part (or on blanks, if it is blank)

    @property
    def active(self) -> bool:
        """Whether a step can change a caption at all."""
        return self.shuffle_tags > 0 or self.tag_dropout > 0

    def tags(self, caption: str) -> list[str]:
        """The caption's tags, each stripped of surrounding blanks; empty ones left out."""
        mark = self.tag_separator.strip()
        return [t.strip() for t in caption.split(mark or None) if t.strip()]

    def apply(self, caption: str, rng: np.random.Generator) -> str:
        """One draw of the operations for one caption. A caption they leave unchanged (no tag dropped,
        not shuffled) comes back exactly as written, so it tokenises as the dataset's stored ids do."""
        shuffle = rng.random() < self.shuffle_tags
        tags = self.tags(caption)
        head, rest = tags[: self.keep_tokens], tags[self.keep_tokens :]
        kept = [tag for tag, u in zip(rest, rng.random(len(rest))) if u >= self.tag_dropout]
        if shuffle:
            kept = [kept[i] for i in rng.permutation(len(kept))]
        if kept == rest:  # nothing dropped, and the shuffle (if any) drew the identity
            return caption
        return self.tag_separator.join(head + kept)


def draw_keys(seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
    """``(B, 3)`` int64 keys ``(seed, epoch, position)`` of samples at ``positions`` of an epoch's order."""
    positions = np.asarray(positions, dtype=np.int64)
    return np.stack([np.full(len(positions), seed % 2**63), np.full(len(positions), epoch), positions], 1)


def sample_rng(key) -> np.random.Generator:
    """The generator of one sample's caption draws: a function of its key alone (non-negative integers)."""
    return np.random.default_rng([_CAPTION_STREAM, *(int(k) for k in key)])


def apply_ops(ops: CaptionOps | None, captions: list[str], keys: np.ndarray) -> list[str]:
    """Each caption after its own draw of ``ops`` (seeded by its row of ``keys``); None: unchanged."""
    if ops is None or not ops.active:
        return list(captions)
    return [ops.apply(caption, sample_rng(key)) for caption, key in zip(captions, keys)]


def caption_ids(ops: CaptionOps | None, tokenizer, captions: list[str], keys_for_rng: np.ndarray) -> np.ndarray:
    """``(B, 77)`` int64 token ids of ``captions`` after ``ops`` (``keys_for_rng``: ``(B, k)`` non-negative
    integers, one row per caption, e.g. ``draw_keys``), tokenised with ``tokenizer`` as SD 1.x was
    trained (``sd.model.tokenize``). ``ops`` None or inactive: the captions as written, re-tokenised."""
    texts = apply_ops(ops, captions, keys_for_rng)
    if not texts:
        return np.zeros((0, sd.model.TOKENIZER_MAX_LENGTH), dtype=np.int64)
    return sd.model.tokenize(tokenizer, texts).numpy().astype(np.int64, copy=False)


def caption_table(keys: list[str], captions: list[str], input_ids: np.ndarray):
    """A caption shard's table as ``pipeline/04_preprocess_to_cache.py`` writes it (and 05 reads it): ``key``,
    ``caption`` and ``input_ids`` (77 int32 CLIP token ids a row)."""
    import pyarrow as pa

    ids = pa.FixedSizeListArray.from_arrays(pa.array(np.asarray(input_ids, dtype=np.int32).reshape(-1), type=pa.int32()),
                                            sd.model.TOKENIZER_MAX_LENGTH)
    return pa.table({"key": pa.array(keys, pa.string()), "caption": pa.array(captions, pa.string()), "input_ids": ids})
