"""Caption operations (sd.data.captions) and captions tokenised in the loader (MixedData with a tokenizer)."""

import numpy as np
import pytest
import torch

import sd.data.prefetch
import sd.data.training_data
import sd.model
from sd.data.captions import CaptionOps, apply_ops, caption_ids, draw_keys
from sd.train.config import ConfigError, TrainConfig

from data_factory import make_captions, make_latents

TAGS = [f"tag{i}" for i in range(10)]
CAPTION = ", ".join(TAGS)


@pytest.fixture(scope="module")
def tokenizer():
    return sd.model.load_tokenizer("tiny")


def draws(ops: CaptionOps, n: int, epoch: int = 0, caption: str = CAPTION) -> list[list[str]]:
    """The tags of ``n`` samples' captions (positions 0..n-1 of one epoch) after ``ops``."""
    texts = apply_ops(ops, [caption] * n, draw_keys(7, epoch, np.arange(n)))
    return [ops.tags(text) for text in texts]


def test_the_first_keep_tokens_tags_never_move_nor_drop():
    ops = CaptionOps(shuffle_tags=1.0, keep_tokens=3, tag_dropout=0.3)
    results = draws(ops, 2000)
    assert all(tags[:3] == TAGS[:3] for tags in results)
    assert sum(tags[3:] != TAGS[3:] for tags in results) > 1990  # the rest really moved (or lost tags)
    assert all(set(tags[3:]) <= set(TAGS[3:]) and len(set(tags)) == len(tags) for tags in results)


@pytest.mark.parametrize("p", [0.5, 0.2])
def test_the_shuffled_fraction_is_shuffle_tags(p):
    results = draws(CaptionOps(shuffle_tags=p), 4000)
    assert all(sorted(tags) == sorted(TAGS) for tags in results)  # shuffled only: no tag lost
    shuffled = np.mean([tags != TAGS for tags in results])  # 7 shuffled tags draw the identity 1 in 5040
    assert abs(shuffled - p) < 0.035  # 4.5 standard deviations of 4000 draws


def test_each_tag_drops_at_tag_dropout_and_the_rest_keep_their_order():
    ops = CaptionOps(keep_tokens=2, tag_dropout=0.25)
    results = draws(ops, 3000)
    kept = np.array([[tag in tags for tag in TAGS] for tags in results])
    assert kept[:, :2].all()
    assert abs(1 - kept[:, 2:].mean() - 0.25) < 0.015  # 24000 coins: 4.9 standard deviations
    assert all(tags == [t for t in TAGS if t in tags] for tags in results)  # no shuffle: order kept


def test_the_same_key_draws_the_same_caption_and_another_epoch_another():
    ops = CaptionOps(shuffle_tags=1.0, tag_dropout=0.1)
    assert draws(ops, 50, epoch=3) == draws(ops, 50, epoch=3)
    assert sum(a != b for a, b in zip(draws(ops, 50, epoch=3), draws(ops, 50, epoch=4))) >= 48
    first = draws(ops, 50)
    assert len({tuple(tags) for tags in first}) >= 48  # each position its own draw


def test_an_unchanged_caption_is_kept_verbatim_and_a_changed_one_is_rejoined():
    ops = CaptionOps(shuffle_tags=1.0, keep_tokens=1, tag_separator=", ")
    odd = "a photo,with  spacing ,  odd"
    assert apply_ops(CaptionOps(shuffle_tags=0.0), [odd], draw_keys(0, 0, [0])) == [odd]
    assert apply_ops(ops, ["solo"], draw_keys(0, 0, [0])) == ["solo"]  # nothing after keep_tokens to move
    changed = [t for t in apply_ops(ops, [odd] * 20, draw_keys(0, 0, np.arange(20))) if t != odd]
    assert changed and set(changed) == {"a photo, odd, with  spacing"}  # the one other order, rejoined
    blanks = CaptionOps(shuffle_tags=1.0, tag_separator=" ")
    assert sorted(blanks.tags("b  a c")) == ["a", "b", "c"]
    assert {t for t in apply_ops(blanks, ["b  a c"] * 30, draw_keys(0, 0, np.arange(30)))} >= {"a b c", "c a b"}


def test_caption_ids_tokenise_the_operated_captions_as_the_model_does(tokenizer):
    captions = ["red, circle, small", "blue, square"]
    keys = draw_keys(1, 2, np.array([5, 9]))
    ops = CaptionOps(shuffle_tags=1.0)
    ids = caption_ids(ops, tokenizer, captions, keys)
    assert ids.dtype == np.int64 and ids.shape == (2, 77)
    assert np.array_equal(ids, sd.model.tokenize(tokenizer, apply_ops(ops, captions, keys)).numpy())
    assert np.array_equal(caption_ids(None, tokenizer, captions, keys), sd.model.tokenize(tokenizer, captions).numpy())


# ------------------------------------------------------------------------------ in the loader


def tag_dataset(root, n=24, missing=()):
    """A caption dataset of tag captions joined to tiny latents; ``missing``: keys without a latent."""
    keys = [f"t{i:03d}" for i in range(n)]
    captions = [f"item{i}, " + ", ".join(TAGS[: 3 + i % 5]) for i in range(n)]
    latents = np.random.default_rng(0).normal(size=(n, 4, 8, 8))
    present = [i for i, k in enumerate(keys) if k not in missing]
    make_latents(root / "latents", [keys[i] for i in present], latents[present])
    make_captions(root / "captions", list(zip(keys, captions)), [])
    return root / "captions", root / "latents", keys, captions


def loader(root, tokenizer, ops, **kwargs):
    captions_dir, latents_dir, keys, captions = tag_dataset(root, **kwargs)
    store = sd.data.training_data.LatentStore(latents_dir)
    split = sd.data.training_data.join_split(captions_dir, "train", store, allow_missing=True, captions=True)
    return sd.data.training_data.MixedData([split], [1.0], tokenizer=tokenizer, ops=ops), split, captions


def test_the_loader_reads_each_samples_caption_even_with_samples_dropped(tmp_path, tokenizer):
    data, split, captions = loader(tmp_path, tokenizer, None, missing={"t003", "t010"})
    kept = [c for i, c in enumerate(captions) if i not in (3, 10)]
    assert split.captions.read(np.arange(len(split))) == kept
    indices = np.array([20, 2, 3, 9])
    _, ids = data.batch(indices)
    # No operation: the captions as written, whose ids are the dataset's stored ones; those are not held
    # (the loader makes its own: 616 bytes a sample, 800 MB a rank at 1.3M samples)
    assert split.input_ids.shape == (len(split), 0)
    keys, stored = sd.data.training_data.load_caption_split(tmp_path / "captions", "train")
    kept = stored[[keys.index(key) for key in split.keys]]
    assert torch.equal(ids, torch.from_numpy(kept[indices]))


def test_loader_batches_depend_on_the_draw_keys_alone(tmp_path, tokenizer):
    data, split, captions = loader(tmp_path, tokenizer, CaptionOps(shuffle_tags=1.0, keep_tokens=1, tag_dropout=0.2))
    batches, flips, keys = sd.data.training_data.epoch_plan(data, 3, 1, 0, 1, 4)
    assert all(f is None for f in flips)
    assert [k[:, :2].tolist() for k in keys] == [[[3, 1]] * 4] * len(batches)
    positions = np.concatenate([k[:, 2] for k in keys])
    assert positions.tolist() == list(range(24))  # one rank, square latents: the order sliced as it is
    prefetch = sd.data.prefetch.Prefetcher(data, pin=False)
    try:
        prefetch.ahead((1, 0), batches[:2], flips[:2], keys[:2])
        built_ahead = prefetch.take((1, 0), batches[:2], flips[:2], keys[:2])
    finally:
        prefetch.close()
    for (latents, ids), rows, k in zip(built_ahead, batches, keys):
        texts = apply_ops(data.ops, [captions[i] for i in rows], k)
        assert torch.equal(ids, sd.model.tokenize(tokenizer, texts))
        assert [t.split(", ")[0] for t in texts] == [f"item{i}" for i in rows]  # keep_tokens 1
        again = data.batch(rows[::-1], None, k[::-1])  # another batch, the same keys: the same captions
        assert torch.equal(again[1], ids.flip(0)) and torch.equal(again[0], latents.flip(0))
    other_epoch = sd.data.training_data.epoch_plan(data, 3, 2, 0, 1, 4)[2][0]
    _, moved = data.batch(batches[0], None, other_epoch)
    assert not torch.equal(moved, built_ahead[0][1])


def test_a_sample_trains_on_other_token_ids_in_another_epoch(tmp_path, tokenizer):
    """What the stored ids cannot do: one sample's caption differs between the epochs of a run."""
    data, _, _ = loader(tmp_path, tokenizer, CaptionOps(shuffle_tags=1.0))
    ids_of = []
    for epoch in (0, 1):
        batches, _, keys = sd.data.training_data.epoch_plan(data, 0, epoch, 0, 1, 4)
        by_sample = {}
        for rows, k in zip(batches, keys):
            for row, ids in zip(rows, data.batch(rows, None, k)[1]):
                by_sample[int(row)] = ids
        ids_of.append(by_sample)
    differ = [i for i in ids_of[0] if not torch.equal(ids_of[0][i], ids_of[1][i])]
    assert len(differ) >= 20  # of 24: a few short captions draw one order again


def test_a_split_without_caption_text_is_refused_by_a_tokenising_loader(tmp_path, tokenizer):
    captions_dir, latents_dir, _, _ = tag_dataset(tmp_path)
    split = sd.data.training_data.join_split(captions_dir, "train", sd.data.training_data.LatentStore(latents_dir))
    with pytest.raises(sd.data.training_data.DataError, match="captions=True"):
        sd.data.training_data.MixedData([split], [1.0], tokenizer=tokenizer)


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize("fields, message", [
    (dict(shuffle_tags=0.5, instance_dir="x", instance_prompt="a sks dog"), "captions.shuffle_tags changes dataset captions"),
    (dict(tag_dropout=0.1, instance_dir="x", instance_prompt="a sks dog"), "captions.tag_dropout changes dataset captions"),
    (dict(shuffle_tags=1.0, cache_text_embeddings=True), "no fixed set whose embeddings could be cached"),
    (dict(tag_separator=""), "captions.tag_separator must not be empty"),
    (dict(shuffle_tags=1.5), r"captions.shuffle_tags must be in \[0, 1\], got 1.5"),
    (dict(keep_tokens=-1), "captions.keep_tokens must be >= 0"),
])
def test_caption_operation_conflicts_are_config_errors(fields, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**fields).validate(check_paths=False)


def test_caption_operations_alone_and_keep_tokens_without_them_are_accepted():
    TrainConfig(shuffle_tags=0.5, keep_tokens=1, tag_dropout=0.1).validate(check_paths=False)
    TrainConfig(keep_tokens=2, cache_text_embeddings=True).validate(check_paths=False)
