"""The headers of the model files we write (``sd.metadata``): the model spec's keys, sd-scripts' training keys
from a run's config, and the bounds on what is read to write them."""

import hashlib
import json
import types

import pytest
import safetensors.torch
import torch

import sd.metadata
import sd.model
from data_factory import make_captions


@pytest.mark.parametrize("kind, architecture, implementation", [
    ("checkpoint", "stable-diffusion-v1", sd.metadata.STABILITY),
    ("lora", "stable-diffusion-v1/lora", "diffusers"),
    ("textual-inversion", "stable-diffusion-v1/textual-inversion", sd.metadata.STABILITY),
    ("controlnet", "stable-diffusion-v1/controlnet", sd.metadata.STABILITY),
])
def test_the_model_spec_names_the_architecture_and_the_key_layout(kind, architecture, implementation):
    keys = sd.metadata.modelspec(kind, "x", "v_prediction", (512, 384), 0.0)
    assert keys["modelspec.architecture"] == architecture and keys["modelspec.implementation"] == implementation
    assert keys["modelspec.resolution"] == "512x384" and keys["modelspec.date"] == "1970-01-01T00:00:00+00:00"
    assert keys["modelspec.prediction_type"] == keys["modelspec.predict_key"] == "v"
    assert all(isinstance(v, str) for v in keys.values())


def test_a_model_s_resolution_unknown_from_its_training_is_its_unet_s_as_sd_scripts_defaults_it():
    """sd-scripts writes modelspec.resolution in every file (library/sai_model_spec.py determine_resolution: its
    512 default for SD 1.x); ours falls back to what the UNet makes, its sample_size latents times 8."""
    from diffusers import UNet2DConditionModel

    tiny = UNet2DConditionModel(**sd.model.UNET_PRESETS["tiny"])
    assert sd.metadata.model_resolution(tiny) == (64, 64)
    assert sd.metadata.model_resolution(types.SimpleNamespace(config=types.SimpleNamespace(sample_size=[8, 12]))) == (
        96, 64)  # diffusers' (height, width) latents
    assert sd.metadata.model_resolution(object()) == (512, 512)
    keys = sd.metadata.modelspec("lora", "x", "epsilon", sd.metadata.model_resolution(tiny), 86400.0)
    assert keys["modelspec.resolution"] == "64x64" and keys["modelspec.date"] == "1970-01-02T00:00:00+00:00"


def test_an_export_of_a_model_that_is_no_run_of_ours_has_its_resolution_and_date_too(tmp_path):
    """The modelspec of a file exported from a model file (not a run): the UNet's resolution, the file's time."""
    import os

    from diffusers import UNet2DConditionModel

    import sd.imagegen.headers

    source = tmp_path / "base.safetensors"
    source.write_bytes(b"")
    os.utime(source, (86400.0, 86400.0))
    model = types.SimpleNamespace(prediction_type="epsilon", unet=UNet2DConditionModel(**sd.model.UNET_PRESETS["tiny"]))
    keys = sd.imagegen.headers.file_header("checkpoint", tmp_path / "out.safetensors", model, str(source))
    assert (keys["modelspec.resolution"], keys["modelspec.date"], keys["modelspec.title"]) == (
        "64x64", "1970-01-02T00:00:00+00:00", "out")


RUN = dict(batch_size=2, grad_accum=2, epochs=1)  # 16 samples on one rank: 8 micro-batches, 4 steps an epoch


@pytest.mark.parametrize("step, epoch, position, expected", [
    (0, 0, 0, "0"),  # nothing trained yet
    (2, 0, 4, "1"),  # within the first epoch
    (4, 1, 0, "1"),  # the first epoch just finished (our epoch counts those completed)
    (6, 1, 4, "2"),  # within the second
    (12, 3, 0, "3"),  # the third finished
])
def test_ss_epoch_is_the_epoch_of_the_last_step_counted_from_1_as_sd_scripts_saves_it(step, epoch, position,
                                                                                        expected):
    state = dict(step=step, epoch=epoch, position=position, world_size=1, data_samples=16)
    keys = sd.metadata.kohya_training_keys(sd.metadata.TrainingRecord(RUN, state, None, None), "out")
    assert keys["ss_epoch"] == expected and keys["ss_steps"] == str(step)


@pytest.mark.parametrize("config, state, epochs, max_steps", [
    (dict(max_steps=12), dict(step=2, epoch=0, position=4, data_samples=16), "3", "12"),  # counted: 16 // 2 // 2
    (dict(max_steps=10), dict(step=10, epoch=2, position=4, data_samples=16), "3", "10"),  # a part of one: whole
    (dict(max_steps=10), dict(step=10, epoch=2, position=4, data_samples=0), "3", "10"),  # measured: (10 - 2) / 2
    (dict(max_steps=12, epoch_size=32), dict(step=2, epoch=0, position=4, data_samples=16), "2", "12"),
    (dict(max_steps=12, steps_per_epoch=5), dict(step=2, epoch=0, position=4, steps_per_epoch=6), "2", "12"),
    (dict(max_steps=12), dict(step=2, epoch=0, position=4, data_samples=16, world_size=2), "6", "12"),
    (dict(max_steps=12), dict(step=2, epoch=0, position=4), "1", "12"),  # unknown: the epochs begun
    (dict(max_steps=0, epochs=3), dict(step=2, epoch=0, position=4, data_samples=16), "3", "12"),
])
def test_ss_num_epochs_is_a_number_a_max_steps_run_counts_as_sd_scripts_does(config, state, epochs, max_steps):
    """sd-scripts' train_network.py: num_train_epochs = ceil(max_train_steps / steps per epoch), max_train_steps
    = epochs x steps per epoch when given epochs; the steps per epoch are the record's, else measured over its
    completed epochs, else counted from its samples and batch."""
    record = sd.metadata.TrainingRecord({**RUN, **config}, {"world_size": 1, **state}, None, None)
    keys = sd.metadata.kohya_training_keys(record, "out")
    assert (keys["ss_num_epochs"], keys["ss_max_train_steps"]) == (epochs, max_steps)


@pytest.mark.parametrize("clip_skip, expected", [(None, "None"), (1, "None"), (2, "2")])
def test_ss_clip_skip_is_the_runs_as_sd_scripts_writes_it(clip_skip, expected):
    """sd-scripts writes str(args.clip_skip): "None" for a run at the last layer, "2" for CLIP skip 2."""
    config = {**RUN, **({} if clip_skip is None else {"clip_skip": clip_skip})}
    keys = sd.metadata.kohya_training_keys(sd.metadata.TrainingRecord(config, {}, None, None), "out")
    assert keys["ss_clip_skip"] == expected


def test_a_local_path_is_named_by_its_last_part_and_a_hub_id_as_it_is(tmp_path):
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "model").mkdir()
    assert sd.metadata.public_name(str(tmp_path / "owner" / "model")) == "model"
    assert sd.metadata.public_name("/home/someone/models/base.safetensors") == "base.safetensors"
    assert sd.metadata.public_name("runwayml/stable-diffusion-v1-5") == "runwayml/stable-diffusion-v1-5"
    assert sd.metadata.public_name("tiny") == "tiny" and sd.metadata.public_name("") is None


def test_tags_are_counted_over_a_bounded_head_of_the_captions_and_the_most_frequent_kept(tmp_path, monkeypatch):
    rows = [(f"k{i}", caption) for i, caption in enumerate(
        ["cat, sky , red", "cat, dog", "dog,cat", "sky", "cat, cat"])]
    folder = make_captions(tmp_path / "captions", rows, [])
    total, tags = sd.metadata.caption_tags(folder)
    assert total == 5 and tags == {"cat": 5, "dog": 2, "sky": 2, "red": 1}
    assert list(tags) == ["cat", "dog", "sky", "red"]  # by count, then by name
    monkeypatch.setattr(sd.metadata, "TAG_CAPTIONS", 3)
    monkeypatch.setattr(sd.metadata, "TOP_TAGS", 2)
    assert sd.metadata.caption_tags(folder) == (5, {"cat": 3, "dog": 2})
    assert sd.metadata.caption_tags(tmp_path / "missing") is None


def test_folders_of_the_same_name_are_told_apart_as_sd_scripts_does(tmp_path):
    rows = [("a", "x, y")]
    entries = [{"dataset": str(make_captions(tmp_path / p / "captions", rows, [])), "latents": str(tmp_path / "none")}
               for p in ("one", "two")]
    keys = sd.metadata.dataset_keys({"datasets": entries})
    assert json.loads(keys["ss_dataset_dirs"]) == {"captions": {"n_repeats": 1, "img_count": 1},
                                                   "captions (2)": {"n_repeats": 1, "img_count": 1}}
    assert json.loads(keys["ss_tag_frequency"])["captions (2)"] == {"x": 1, "y": 1}


def test_the_optimizer_and_schedule_read_as_sd_scripts_records_them():
    config = dict(optimizer="adamw8bit", weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, lr=1e-4, min_lr_ratio=0.0)
    keys = sd.metadata.kohya_training_keys(sd.metadata.TrainingRecord(config, {}, None, None), "out")
    assert keys["ss_optimizer"] == "bitsandbytes.optim.adamw.AdamW8bit(weight_decay=0.01,betas=(0.9, 0.999))"
    assert keys["ss_lr_scheduler"] == "cosine" and keys["ss_text_encoder_lr"] == "None"
    assert all(isinstance(v, str) for v in keys.values())


def test_the_content_hash_is_the_tensor_data_after_the_header_whatever_the_header_holds():
    tensors = {"b": torch.arange(6, dtype=torch.float32), "a": torch.ones(2, 2, dtype=torch.float16)}
    hashes = sd.metadata.content_hashes(tensors, {"ss_x": "1", "other": "2"})
    for header in ({}, {"ss_x": "1", "modelspec.title": "long " * 50}):
        data = safetensors.torch.save(tensors, header or None)
        start = 8 + int.from_bytes(data[:8], "little")
        assert hashes["sshs_model_hash"] == hashlib.sha256(data[start:]).hexdigest()
    assert len(hashes["sshs_legacy_hash"]) == 8


def test_bucket_info_sums_each_bucket_over_the_shards(tmp_path):
    latents = tmp_path / "latents"
    latents.mkdir()
    for shard, layout in enumerate([[([64, 48], 3), ([48, 64], 1)], [([64, 48], 2)]]):
        (latents / f"{shard:05d}.buckets.json").write_text(
            json.dumps({"buckets": [{"size": size, "count": n} for size, n in layout]}))
    (latents / "00002.buckets.json").write_text("not json")
    assert sd.metadata.bucket_counts(latents) == {(64, 48): 5, (48, 64): 1}
    rows = [("a", "x")]
    entry = {"dataset": str(make_captions(tmp_path / "captions", rows, [])), "latents": str(latents)}
    info = json.loads(sd.metadata.dataset_keys({"datasets": [entry]})["ss_bucket_info"])
    assert info["buckets"] == {"0": {"resolution": [48, 64], "count": 1}, "1": {"resolution": [64, 48], "count": 5}}
