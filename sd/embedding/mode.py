"""Textual inversion as a training mode (``embedding_token``): a new token in the tokenizer and text
encoder, starting from ``embedding_init``'s embedding; its vectors alone train and are saved
(``embedding``, the file AUTOMATIC1111 and ComfyUI load)."""

from __future__ import annotations

from dataclasses import dataclass

import logging

import torch

import sd.embedding.tokens
import sd.training_mode
from sd.cli import ConfigError
from sd.settings import setting, refused, Range, NON_NEGATIVE, COUNT, SCHEDULE

log = logging.getLogger("sd_train")


@dataclass(frozen=True)
class EmbeddingConfig:
    """Textual inversion: a new token learned for a subject, alone or beside a LoRA (pivotal tuning)."""

    token: str = setting("textual inversion: learn this new token (a word not in the tokenizer, e.g. <my-cat>) "
                         "from prompts that use it; the UNet and text encoder stay frozen (with lora_rank > 0 a "
                         "LoRA trains beside it: pivotal tuning). Needs init_from", "",
                         resume=refused("the learned token"))
    init: str = setting("textual inversion: the word(s) whose embedding the new token starts from (e.g. cat)",
                        "", resume=refused("the learned token"))
    vectors: int = setting("textual inversion: vectors of the new token (each takes one of the prompt's 75 "
                           "token places)", 1, allowed=COUNT, resume=refused("the learned token"))
    lr: float = setting("pivotal tuning (embedding_token with lora_rank > 0): the learned token's peak learning "
                        "rate, beside the LoRA's lr; 0 = lr", 0.0, allowed=NON_NEGATIVE,
                        resume=refused(SCHEDULE))
    train_fraction: float = setting("pivotal tuning: the fraction of the run's steps in which the token trains; "
                                    "after them it stays as learned while the LoRA goes on (0.5: the first "
                                    "half)", 1.0, allowed=Range(0, 1, low_open=True, high_open=False),
                                    resume=refused(SCHEDULE))


class LearnedToken(sd.training_mode.Mode):
    what = "learned token"
    frozen_base = True
    whole_unet = False
    unet_trains = False
    unet_blocks_train = False
    retokenises = True  # the stored token ids lack the new token

    def own_learning_rates(self) -> list[str]:
        return ["embedding.lr at 0"] if self.config.embedding.lr not in (0, self.config.lr) else []

    @classmethod
    def wanted(cls, config) -> bool:
        return bool(config.embedding.token)

    @classmethod
    def check(cls, config, check_paths: bool = True) -> None:
        """Textual inversion's settings, and the modes it cannot be combined with."""
        defaults = {"lr": 0, "train_fraction": 1}  # embedding's fields that only pivotal tuning reads
        pivotal = {f"embedding.{name}": default for name, default in defaults.items()
                   if getattr(config.embedding, name) != default}
        if pivotal and not (config.embedding.token and config.lora.rank):
            raise ConfigError(f"{' and '.join(pivotal)} set the learned token's schedule beside a LoRA (pivotal "
                              "tuning): set embedding.token and lora.rank > 0, or leave "
                              f"{' and '.join(f'{name} at {default}' for name, default in pivotal.items())}"
                              f"{' (a token trained alone takes lr)' if 'embedding.lr' in pivotal else ''}")
        if not config.embedding.token:
            if config.embedding.init:
                raise ConfigError("embedding.init is the start of a learned token: set embedding.token too")
            return
        try:
            sd.embedding.tokens.check_token(config.embedding.token)
        except ValueError as error:
            raise ConfigError(f"embedding.token: {error}") from None
        if not config.embedding.init.strip():
            raise ConfigError("embedding.token needs embedding.init: a word close to the concept that the token "
                              "starts from (e.g. dog)")
        if not config.init_from:
            raise ConfigError("embedding.token learns a token for existing weights: set init_from (a diffusers "
                              "folder or hub id, a single file, or a run of ours)")
        if config.cache_text_embeddings:
            raise ConfigError("cache_text_embeddings needs a fixed text encoder, and textual inversion trains it: "
                              "turn the cache off")
        if config.embedding.vectors > 75:
            raise ConfigError(f"embedding.vectors: at most 75 (a prompt's places), got {config.embedding.vectors}")
        if config.subject.instance_dir and config.embedding.token not in config.subject.instance_prompt.lower().split():
            raise ConfigError(f"subject.instance_prompt {config.subject.instance_prompt!r} does not use "
                              f"embedding.token {config.embedding.token!r}: write it into the prompt, e.g. 'a photo "
                              f"of {config.embedding.token}'")
        if config.sharding != "none":
            raise ConfigError(f"sharding: {config.sharding} splits a full fine-tune's state; a learned token is a few "
                              "KB that every GPU holds whole: set sharding: none")

    def check_data(self, data) -> None:
        """Captions that hold the token, or the token learns nothing: none is refused, fewer than half warned."""
        splits = [split for split in getattr(data, "splits", []) if split.captions is not None]
        if not splits:  # DreamBooth: its instance prompt holds the token (``check``)
            return
        token = self.config.embedding.token
        holding = [split.captions.count_word(token) for split in splits]
        total = sum(len(split.captions) for split in splits)
        if not sum(holding):
            raise ConfigError(f"embedding.token {token!r} is in none of the {total} training captions of "
                              f"{', '.join(split.name for split in splits)}: the token would learn nothing. Write it "
                              f"into the captions (e.g. 'a photo of {token}'), or use subject.instance_dir with an "
                              "subject.instance_prompt that holds it")
        if sum(holding) < total / 2:
            log.warning("embedding.token %s is in only %d of the %d training captions (%.0f%%): the others train "
                        "nothing for it and cost their steps", token, sum(holding), total, 100 * sum(holding) / total)

    def before_data(self, unet, text_encoder, tokenizer) -> None:
        """The new token in the tokenizer and text encoder, before any prompt is tokenised; it alone trains
        (beside a LoRA, which then stores the frozen base in the autocast type after adding its adapters)."""
        config = self.config
        sd.embedding.tokens.freeze_for_inversion(unet, text_encoder, "fp32" if config.lora.rank else config.precision)
        try:
            start = sd.embedding.tokens.initial_vectors(tokenizer, text_encoder, config.embedding.init,
                                                        config.embedding.vectors)
            sd.embedding.tokens.add_token(tokenizer, text_encoder, config.embedding.token, start, trainable=True)
        except sd.embedding.tokens.EmbeddingError as error:
            raise ConfigError(f"embedding.token: {error}") from error
        log.info("textual inversion: token %s, %d vector(s) of %d values starting from %r; the UNet and text "
                 "encoder are frozen%s", config.embedding.token, config.embedding.vectors, start.shape[1],
                 config.embedding.init, " but for the LoRA's adapters (pivotal tuning)" if config.lora.rank else "")

    def estimate_before_data(self, unet, text_encoder) -> None:
        """The new rows (zeros: their values do not change the memory), as ``before_data`` adds them."""
        config = self.config
        sd.embedding.tokens.freeze_for_inversion(unet, text_encoder, "fp32" if config.lora.rank else config.precision)
        sd.embedding.tokens.attach_rows(text_encoder, torch.zeros(config.embedding.vectors,
                                                                  text_encoder.config.hidden_size),
                                        [config.embedding.token] * config.embedding.vectors, trainable=True)

    def attach(self, unet, text_encoder):
        """The token trains (a LoRA attached before it froze the text encoder's parameters but its adapters)."""
        sd.embedding.tokens.added_embeddings(text_encoder)[0].vectors.requires_grad_(True)
        return unet

    def fingerprinted(self, unet, text_encoder) -> list[torch.Tensor]:
        return list(unet.parameters()) + list(text_encoder.parameters())

    def trained_weights(self, step) -> dict[str, object]:
        return {"embedding": sd.embedding.tokens.LearnedToken(step.text_encoder)}
