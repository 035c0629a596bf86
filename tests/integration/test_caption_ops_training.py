"""Caption operations in SD_Train.py runs: each step's captions are drawn from (seed, epoch, position),
so a run stopped and resumed trains bit for bit as the uninterrupted one does.

One rank, tiny presets: 16 tag-captioned samples, batch 4, 4 steps an epoch.
"""

import numpy as np
import pytest
import torch
import yaml

import sd.data.captions
import sd.data.training_data
import sd.model
import sd.run_folder
import sd.train.step
import SD_Train

from data_factory import BASE, make_captions, make_latents
from test_checkpoints import assert_bitwise_equal, main, saved_tensors

TAGS = ["red", "circle", "small", "bright", "outdoors", "blurry", "grain", "night"]
OPS = dict(shuffle_tags=0.5, keep_tokens=1, tag_dropout=0.2)


@pytest.fixture(scope="module")
def tag_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tags")
    keys = [f"t{i:03d}" for i in range(16)]
    captions = [", ".join([f"subject{i % 4}"] + TAGS[i % 3 :]) for i in range(16)]
    latents = np.random.default_rng(0).normal(0, 2, size=(16, 4, 8, 8))
    make_latents(root / "latents", keys, latents)
    make_captions(root / "captions", list(zip(keys, captions)), [])
    return {"dataset": str(root / "captions"), "latents": str(root / "latents"), "weight": 1.0}, captions


def config_file(path, data, run_dir, **fields):
    values = {**BASE, "datasets": [data], "out_dir": str(run_dir), "batch_size": 4, "grad_accum": 1, "max_steps": 6,
              "save_steps": 3, **OPS, **fields}
    path.write_text(yaml.safe_dump(values))
    return ["--config", str(path)]


@pytest.mark.slow
def test_a_run_with_caption_operations_stopped_and_resumed_equals_the_straight_run_bit_for_bit(tmp_path, tag_data):
    data, _ = tag_data
    straight = config_file(tmp_path / "a.yaml", data, tmp_path / "a")
    assert main(straight) == 0
    split = config_file(tmp_path / "b.yaml", data, tmp_path / "b")
    assert main(split + ["--stop_at_step", "2"]) == 0  # mid-epoch 0: a checkpoint at step 2
    assert main(split) == 0  # resumes at step 2, across the epoch end at step 4, to step 6
    final = sd.run_folder.step_dir_name(6)
    assert_bitwise_equal(saved_tensors(tmp_path / "b" / "checkpoints" / final),
                         saved_tensors(tmp_path / "a" / "checkpoints" / final))


def recorded_ids(monkeypatch) -> list:
    """The token ids of every micro-batch the loop hands to train_step, which here only records them."""
    seen = []

    def record(step, micro_batches, step_index, stop_requested=False):
        seen.append(torch.cat([ids for _, ids in micro_batches]))
        return {"loss": 1.0, "grad_norm": 1.0, "bad": False, "overflow": False, "stop": False,
                "loss_quartiles": [None] * 4, "measured": {}}

    monkeypatch.setattr(sd.train.step, "train_step", record)
    return seen


def test_each_step_trains_on_the_captions_its_seed_epoch_and_positions_draw(tmp_path, tag_data, monkeypatch):
    data, captions = tag_data
    seen = recorded_ids(monkeypatch)
    flags = config_file(tmp_path / "c.yaml", data, tmp_path / "run", max_steps=8, ema_decay=0.0, seed=3)
    assert SD_Train.main(flags + ["--stop_at_step", "3"]) == 0
    assert SD_Train.main(flags) == 0  # resumes at step 3 (the next batch built afresh, not read ahead)
    ids = torch.cat(seen)  # 8 steps x 4 samples: epochs 0 and 1 in order
    tokenizer = sd.model.load_tokenizer("tiny")
    ops = sd.data.captions.CaptionOps(**OPS)
    expected, by_sample = [], {}
    for epoch in (0, 1):
        order = sd.data.training_data.epoch_order([16], [1.0], 3, epoch)
        keys = sd.data.captions.draw_keys(3, epoch, np.arange(16))
        texts = sd.data.captions.apply_ops(ops, [captions[i] for i in order], keys)
        expected.append(sd.model.tokenize(tokenizer, texts))
        for i, text in zip(order, texts):
            by_sample.setdefault(int(i), []).append(text)
    assert torch.equal(ids, torch.cat(expected))
    # The same sample trains on another caption in the second epoch (stored ids would repeat)...
    assert sum(first != second for first, second in by_sample.values()) >= 8
    # ... about half of them shuffled, a fifth of the later tags dropped, the subject tag always first.
    assert all(text.startswith(f"subject{i % 4}, ") for i, texts in by_sample.items() for text in texts)
    assert 0 < sum(t != captions[i] for i, texts in by_sample.items() for t in texts) < 32
