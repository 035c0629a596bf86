"""sd.data.training_data: epoch batches per rank, mixing, latent stores and caption splits joined to latents, flips,
the validation indices; also the checkpoints' pruning (sd.train.checkpoint) and a subject folder's class images
(sd.data.dreambooth)."""

import json
from pathlib import Path

import numpy as np
import pytest

import sd.data.training_data
import sd.run_folder
import sd.train.checkpoint as ckpt

from data_factory import make_captions, make_dataset, make_latents


def test_rank_batches_are_disjoint_equal_and_cover_the_epoch():
    order = sd.data.training_data.epoch_order([50], [1.0], seed=0, epoch=0)
    assert sorted(order.tolist()) == list(range(50))
    per_rank = [sd.data.training_data.rank_batches(order, r, 3, 4) for r in range(3)]
    assert [len(b) for b in per_rank] == [4, 4, 4]  # 50 // (3 * 4) = 4 batches each; the tail is dropped
    seen = [i for batches in per_rank for b in batches for i in b.tolist()]
    assert len(seen) == len(set(seen)) == 48
    assert set(seen) <= set(order.tolist())


def test_epoch_order_is_deterministic_per_seed_and_epoch():
    a = sd.data.training_data.epoch_order([40, 10], [1.0, 1.0], seed=3, epoch=2)
    assert np.array_equal(a, sd.data.training_data.epoch_order([40, 10], [1.0, 1.0], seed=3, epoch=2))
    assert not np.array_equal(a, sd.data.training_data.epoch_order([40, 10], [1.0, 1.0], seed=3, epoch=3))
    assert not np.array_equal(a, sd.data.training_data.epoch_order([40, 10], [1.0, 1.0], seed=4, epoch=2))


def test_weighted_mix_follows_the_weights_and_repeats_small_sets():
    sizes, weights = [1000, 50, 200], [0.6, 0.2, 0.2]
    order = sd.data.training_data.epoch_order(sizes, weights, seed=0, epoch=0, epoch_size=2000)
    which = np.searchsorted(np.cumsum([0] + sizes), order, side="right") - 1
    assert np.bincount(which).tolist() == [1200, 400, 400]
    small = order[which == 1] - 1000
    assert set(small.tolist()) == set(range(50))  # 400 draws cycle through all 50, 8 times each
    assert np.bincount(small).tolist() == [8] * 50


def _store(tmp_path, shapes, name="latents"):
    keys, arrays = [], []
    for i, shape in enumerate(shapes):
        arrays.append(np.full((2, *shape), i, dtype=np.float16))
        keys += [f"k{i}_{j}" for j in range(2)]
    folder = tmp_path / name
    folder.mkdir()
    for i, array in enumerate(arrays):
        np.save(folder / f"{i:05d}.npy", array)
        (folder / f"{i:05d}.keys.txt").write_text(f"k{i}_0\nk{i}_1\n")
    return folder


def test_latent_store_ram_and_mmap_agree(tmp_path):
    rng = np.random.default_rng(0)
    latents = rng.normal(size=(37, 4, 8, 8)).astype(np.float16)
    keys = [f"key{i}" for i in range(37)]
    folder = make_latents(tmp_path / "lat", keys, latents, shard_size=10)
    ram = sd.data.training_data.LatentStore(folder, threads=4)
    mapped = sd.data.training_data.LatentStore(folder, mmap=True)
    rows = np.array([36, 0, 15, 15, 9])
    assert np.array_equal(ram.gather(rows), latents[rows])
    assert np.array_equal(mapped.gather(rows), latents[rows])
    assert ram.keys == keys and ram.row_of["key15"] == 15


def test_latent_store_reads_the_per_image_layout(tmp_path):
    folder = tmp_path / "per_image"
    folder.mkdir()
    for i in range(3):
        np.save(folder / f"img{i}.npy", np.full((4, 8, 8), i, dtype=np.float16))
    store = sd.data.training_data.LatentStore(folder)
    assert store.keys == ["img0", "img1", "img2"]
    assert store.gather(np.array([2]))[0, 0, 0, 0] == 2


def test_shape_mismatch_names_the_files(tmp_path):
    folder = _store(tmp_path, [(4, 8, 8), (4, 8, 8), (4, 16, 16)])
    with pytest.raises(sd.data.training_data.DataError, match=r"00002\.npy \(4, 16, 16\)"):
        sd.data.training_data.LatentStore(folder)


def test_missing_latents_are_counted_and_named(tmp_path):
    folder = _store(tmp_path, [(4, 8, 8)])
    captions = make_captions(tmp_path / "caps", [("k0_0", "a"), ("k0_1", "b"), ("lost", "c"), ("gone", "d")], [])
    store = sd.data.training_data.LatentStore(folder)
    with pytest.raises(sd.data.training_data.DataError, match=r"2 of 4 captions.*'lost', 'gone'"):
        sd.data.training_data.join_split(captions, "train", store)
    joined = sd.data.training_data.join_split(captions, "train", store, allow_missing=True)
    assert joined.keys == ["k0_0", "k0_1"] and joined.rows.tolist() == [0, 1]


def test_mixed_data_batches_join_latents_to_their_tokens(tmp_path):
    entry_a = make_dataset(tmp_path / "a", n_train=8, n_val=0, seed=0, prefix="a")
    entry_b = make_dataset(tmp_path / "b", n_train=4, n_val=0, seed=1, prefix="b")
    splits = [sd.data.training_data.join_split(e["dataset"], "train", sd.data.training_data.LatentStore(e["latents"])) for e in (entry_a, entry_b)]
    data = sd.data.training_data.MixedData(splits, [1.0, 1.0])
    latents, ids = data.batch(np.array([9, 1]))  # 9 = dataset b, sample 1
    store_b = splits[1].store
    assert np.array_equal(latents[0].numpy(), store_b.gather(np.array([store_b.row_of["b00001"]]))[0])
    assert ids.shape == (2, 77) and ids[0].tolist() == splits[1].input_ids[1].tolist()


def per_row_caption_split(dataset_dir, split):
    """The previous load_caption_split: datasets' Python objects row by row (88 us a row)."""
    from datasets import load_from_disk

    table = load_from_disk(str(dataset_dir))[split]
    keys = list(table["key"])
    return keys, np.asarray(table.with_format("numpy")["input_ids"], dtype=np.int64).reshape(len(keys), -1)


def caption_table(keys, ids, ids_type):
    import pyarrow as pa

    if pa.types.is_fixed_size_list(ids_type):
        column = pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1), ids_type.value_type), ids.shape[1])
    else:
        column = pa.array(ids.tolist(), ids_type)
    return pa.table({"key": keys, "caption": [f"c{k}" for k in keys], "input_ids": column})


@pytest.mark.parametrize("ids_type", ["fixed int32 (stage 05)", "list int64", "large_list int16"])
def test_caption_split_arrow_load_equals_the_per_row_load(tmp_path, ids_type):
    import pyarrow as pa
    from datasets import Dataset, DatasetDict
    from datasets.table import InMemoryTable

    kind = {"fixed int32 (stage 05)": pa.list_(pa.int32(), 77), "list int64": pa.list_(pa.int64()),
            "large_list int16": pa.large_list(pa.int16())}[ids_type]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 30000 if "int16" in ids_type else 49408, size=(203, 77))
    table = caption_table([f"k{i:04d}" for i in range(203)], ids, kind)
    splits = DatasetDict({"train": Dataset(InMemoryTable(table.slice(3))),
                          "validation": Dataset(InMemoryTable(table.slice(0, 3)))})
    splits.save_to_disk(str(tmp_path / "ds"), max_shard_size=8000)  # several files: a column of several chunks
    assert len(list((tmp_path / "ds" / "train").glob("*.arrow"))) > 1
    for split, rows in (("train", ids[3:]), ("validation", ids[:3])):
        keys, input_ids = sd.data.training_data.load_caption_split(tmp_path / "ds", split)
        expected_keys, expected_ids = per_row_caption_split(tmp_path / "ds", split)
        assert keys == expected_keys and all(type(k) is str for k in keys)
        assert input_ids.dtype == expected_ids.dtype == np.int64 and np.array_equal(input_ids, expected_ids)
        assert np.array_equal(input_ids, rows)


@pytest.mark.parametrize("ids, message", [
    ([[1] * 77, [1] * 76], "input_ids rows have 76 to 77 tokens, expected 77 each"),
    ([[1] * 76, [1] * 76], "input_ids have 76 tokens, expected 77"),
    ([[1] * 77, None], "1 input_ids rows are empty (null)"),
    ([[0.5] * 77, [1.0] * 77], "input_ids of type list<item: double> are not lists of token ids"),
])
def test_caption_split_token_ids_of_the_wrong_shape_are_one_error(tmp_path, ids, message):
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_dict({"key": ["a", "b"], "input_ids": ids})}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(sd.data.training_data.DataError) as info:
        sd.data.training_data.load_caption_split(tmp_path / "ds", "train")
    assert str(tmp_path / "ds") in str(info.value) and message in str(info.value)
    Dataset.from_dict({"key": ["a"], "input_ids": [[1] * 77]}).save_to_disk(str(tmp_path / "single"))
    with pytest.raises(sd.data.training_data.DataError, match="is a single table, not train/validation splits"):
        sd.data.training_data.load_caption_split(tmp_path / "single", "train")


def test_prune_keeps_newest_and_every_kth(tmp_path):
    for step in (2, 4, 6, 8, 10):
        folder = tmp_path / sd.run_folder.step_dir_name(step)
        folder.mkdir()
        (folder / sd.run_folder.MANIFEST).write_text(json.dumps({"hash": sd.run_folder.HASH, "files": {}}))
        (folder / sd.run_folder.COMPLETE).write_text("ok")
    (tmp_path / sd.run_folder.step_dir_name(12)).mkdir()  # incomplete: never counted, never the newest
    (tmp_path / ".tmp_step_00000014").mkdir()
    ckpt.prune(tmp_path, keep_last=2, keep_every=4)
    assert [s for s, _ in sd.run_folder.complete_checkpoints(tmp_path)] == [4, 8, 10]
    assert not (tmp_path / ".tmp_step_00000014").exists()
    assert sd.run_folder.latest_checkpoint(tmp_path).name == "step_00000010"


def test_validation_indices_share_the_count_by_weight_and_spread_over_each_dataset():
    indices = sd.data.training_data.validation_indices([100, 50, 0, 10], [1.0, 1.0, 5.0, 2.0], 40)
    which = np.searchsorted(np.cumsum([0, 100, 50, 0, 10]), indices, side="right") - 1
    # 40 by weight 1:1:2 is 10, 10, 20; dataset 3 holds only 10, and the other 10 go to datasets 0 and 1 by weight
    assert np.bincount(which, minlength=4).tolist() == [15, 15, 0, 10]
    assert len(set(indices.tolist())) == 40
    first = indices[which == 0]
    assert first.min() == 0 and first.max() >= 90  # spread over all of dataset 0, not its first rows
    assert sd.data.training_data.validation_indices([3, 2], [1.0, 1.0], 100).tolist() == [0, 1, 2, 3, 4]
    assert sd.data.training_data.validation_indices([0, 0], [1.0, 1.0], 8).tolist() == []


# ---------------------------------------------------------------------------------------------
# Damaged latent folders: one DataError naming the file, never a traceback from numpy or json
# ---------------------------------------------------------------------------------------------


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


DAMAGE = {
    "truncated shard": ("00001.npy", _truncate, "is not a readable latent .npy file"),
    "garbage shard": ("00000.npy", lambda p: p.write_bytes(b"\x93NUMPY garbage" * 10), "is not a readable latent .npy"),
    "text shard": ("00000.npy", lambda p: np.save(p, np.full((2, 4, 8, 8), "a")), "holds <U1 values, not float"),
    "bad json": ("latents.json", lambda p: p.write_text('{"vae": "tiny", "sca'), "is not readable JSON"),
    "json list": ("latents.json", lambda p: p.write_text("[1, 2]"), "is not a JSON object"),
    "bad scaling factor": ("latents.json", lambda p: p.write_text('{"scaling_factor": "0.18"}'),
                           "scaling_factor '0.18' is not a number"),
    "bad utf-8 keys": ("00000.keys.txt", lambda p: p.write_bytes(b"k0_0\n\xff\xfe\n"), "is not readable UTF-8"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
@pytest.mark.parametrize("mmap", [False, True])
def test_a_damaged_latent_folder_is_one_error_naming_the_file(tmp_path, case, mmap):
    folder = _store(tmp_path, [(4, 8, 8), (4, 8, 8)])
    (folder / "latents.json").write_text('{"vae": "tiny", "scaling_factor": 0.18215, "complete": true}')
    name, damage, message = DAMAGE[case]
    damage(folder / name)
    with pytest.raises(sd.data.training_data.DataError) as info:
        sd.data.training_data.LatentStore(folder, mmap=mmap)
    assert str(folder / name) in str(info.value) and message in str(info.value)
    assert "\n" not in str(info.value)


def test_keys_files_are_split_at_newlines_only(tmp_path):
    keys = ["a", "line\u2028sep", "next\x85line", "form\x0cfeed", "z"]  # str.splitlines would cut each of these
    folder = make_latents(tmp_path / "lat", keys, np.zeros((5, 4, 8, 8), np.float16))
    assert sd.data.training_data.latent_keys(folder) == keys
    assert len(sd.data.training_data.LatentStore(folder)) == 5


def test_a_damaged_per_image_latent_is_one_error_naming_the_file(tmp_path):
    folder = tmp_path / "per_image"
    folder.mkdir()
    for i in range(3):
        np.save(folder / f"img{i}.npy", np.full((4, 8, 8), i, dtype=np.float16))
    _truncate(folder / "img1.npy")
    with pytest.raises(sd.data.training_data.DataError, match=r"img1\.npy is not a readable latent \.npy file"):
        sd.data.training_data.LatentStore(folder)


def test_an_unfinished_latent_folder_is_refused_naming_it(tmp_path):
    folder = _store(tmp_path, [(4, 8, 8)])
    (folder / "latents.json").write_text('{"vae": "tiny", "scaling_factor": 0.18215, "complete": false}')
    with pytest.raises(sd.data.training_data.DataError, match=f"latent folder {folder} is not completely encoded"):
        sd.data.training_data.LatentStore(folder)
    with pytest.raises(sd.data.training_data.DataError, match="not completely encoded"):
        sd.data.training_data.latent_keys(folder)
    (folder / "latents.json").write_text('{"vae": "tiny", "scaling_factor": 0.18215, "complete": true}')
    assert len(sd.data.training_data.LatentStore(folder)) == 2
    (folder / "latents.json").write_text('{"vae": "tiny", "scaling_factor": 0.18215}')  # written before the flag
    assert len(sd.data.training_data.LatentStore(folder)) == 2


@pytest.mark.parametrize("case", ["truncated shard", "bad json", "unfinished"])
def test_the_trainer_names_a_damaged_latent_file_in_one_line(tmp_path, capsys, case):
    import yaml

    import SD_Train

    entry = make_dataset(tmp_path / "data", n_train=8, n_val=0)
    latents = tmp_path / "data" / "latents"
    if case == "unfinished":
        (latents / "latents.json").write_text('{"vae": "tiny", "scaling_factor": 0.18215, "complete": false}')
        named = f"latent folder {latents.resolve()} is not completely encoded"
    else:
        name, damage, message = DAMAGE[case]
        damage(latents / name.replace("00001", "00000"))
        named = f"{latents.resolve() / name.replace('00001', '00000')} {message}"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"datasets": [entry], "unet": "tiny", "vae": "tiny", "text_encoder": "tiny",
                                      "device": "cpu", "precision": "fp32", "batch_size": 2, "max_steps": 1,
                                      "out_dir": str(tmp_path / "run")}))
    capsys.readouterr()  # the dataset's own progress output
    assert SD_Train.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("SD_Train.py: error") and err.count("\n") == 1 and named in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("mmap", [False, True])
def test_flip_reads_each_samples_mirrored_latents_by_its_coin(tmp_path, mmap):
    rng = np.random.default_rng(0)
    latents = rng.normal(size=(40, 4, 8, 8)).astype(np.float16)
    keys = [f"key{i}" for i in range(40)]
    folder = make_latents(tmp_path / "lat", keys, latents, shard_size=16, flipped=latents[..., ::-1])
    store = sd.data.training_data.LatentStore(folder, mmap=mmap, flip=True)
    rows = np.arange(40)[::-1].copy()  # sample i of the split is row 39 - i of the store
    data = sd.data.training_data.MixedData([sd.data.training_data.JoinedSplit("d", store, rows, np.zeros((40, 77), np.int64), keys[::-1])], [1.0])
    order = sd.data.training_data.epoch_order(data.sizes, data.weights, seed=3, epoch=1)
    coins = sd.data.training_data.flip_coins(3, 1, len(order))
    for start in (0, 20):  # two batches of 20: each takes about half from the mirrored latents
        batch = slice(start, start + 20)
        got, _ = data.batch(order[batch], coins[batch])
        source = rows[order[batch]]
        expected = np.where(coins[batch, None, None, None], latents[source][..., ::-1], latents[source])
        assert np.array_equal(got.numpy(), expected)
        assert 5 <= coins[batch].sum() <= 15
        again, _ = data.batch(order[batch], coins[batch])
        assert np.array_equal(again.numpy(), got.numpy())
    plain, _ = data.batch(order)
    assert np.array_equal(plain.numpy(), latents[rows[order]])  # no coins: the latents as encoded
    assert abs(sd.data.training_data.flip_coins(3, 1, 20_000).mean() - 0.5) < 0.02


def test_flip_coins_depend_only_on_seed_epoch_and_position():
    coins = sd.data.training_data.flip_coins(7, 2, 64)
    np.random.seed(1)
    np.random.random(100)  # the process's other random streams do not move them
    assert np.array_equal(sd.data.training_data.flip_coins(7, 2, 64), coins)
    assert np.array_equal(sd.data.training_data.flip_coins(7, 2, 100)[:64], coins)  # a position's coin is its own
    assert not np.array_equal(sd.data.training_data.flip_coins(7, 3, 64), coins)
    assert not np.array_equal(sd.data.training_data.flip_coins(8, 2, 64), coins)


def test_flip_without_flipped_latents_names_the_folder(tmp_path):
    folder = make_latents(tmp_path / "lat", ["a", "b"], np.zeros((2, 4, 8, 8)))
    with pytest.raises(sd.data.training_data.DataError, match=f"data.flip: latent folder {folder} has no flipped latents.*"
                                                r"00000\.flip\.npy.*encode_latents\.py --flip"):
        sd.data.training_data.LatentStore(folder, flip=True)
    assert sd.data.training_data.LatentStore(folder).flipped is None
    (folder / "00000.flip.npy").write_bytes(b"\x93NUMPY damaged")
    with pytest.raises(sd.data.training_data.DataError, match=r"00000\.flip\.npy is not a readable latent \.npy file"):
        sd.data.training_data.LatentStore(folder, flip=True)
    with pytest.raises(sd.data.training_data.DataError, match="not loaded"):
        sd.data.training_data.LatentStore(folder).gather(np.array([0]), np.array([True]))


def test_flip_reads_the_per_image_layout(tmp_path):
    folder = tmp_path / "per_image"
    folder.mkdir()
    for i in range(3):
        np.save(folder / f"img{i}.npy", np.full((4, 8, 8), i, dtype=np.float16))
        np.save(folder / f"img{i}.flip.npy", np.full((4, 8, 8), -i, dtype=np.float16))
    store = sd.data.training_data.LatentStore(folder, flip=True)
    assert store.keys == ["img0", "img1", "img2"]
    got = store.gather(np.array([2, 1, 2]), np.array([True, False, False]))
    assert got[:, 0, 0, 0].tolist() == [-2, 1, 2]


def rss_kb(kind: str) -> int:
    """This process's resident memory of one kind (``RssAnon``: its own; ``RssFile``: mapped files)."""
    for line in open("/proc/self/status"):
        if line.startswith(kind + ":"):
            return int(line.split()[1])
    raise KeyError(kind)


def test_the_store_maps_the_shard_files_and_keeps_no_copy_of_its_own(tmp_path):
    """Every rank of a machine maps the same files: the page cache holds the one copy they share."""
    n = 1536  # 48 MiB of 4x64x64 float16 latents in 6 shards
    latents = np.random.default_rng(0).normal(size=(n, 4, 64, 64)).astype(np.float16)
    folder = make_latents(tmp_path / "lat", [f"k{i}" for i in range(n)], latents, shard_size=256)
    del latents
    before = rss_kb("RssAnon")
    store = sd.data.training_data.LatentStore(folder, threads=2)
    grown_mb = (rss_kb("RssAnon") - before) / 1024
    assert grown_mb < 12, f"the process grew by {grown_mb:.0f} MB for 48 MB of latents"  # a private copy: 48
    assert [Path(a.filename).name for a in store.arrays] == [f"{i:05d}.npy" for i in range(6)]
    assert all(isinstance(a, np.memmap) for a in store.arrays)
    rows = np.array([1500, 3, 700, 4, 1499])
    expected = np.concatenate([np.load(folder / f"{r // 256:05d}.npy")[[r % 256]] for r in rows])
    assert np.array_equal(store.gather(rows), expected)


def test_the_machines_ranks_split_the_first_read_of_the_files(tmp_path, monkeypatch):
    latents = np.zeros((10, 4, 2, 2), dtype=np.float16)
    folder = make_latents(tmp_path / "lat", [f"k{i}" for i in range(10)], latents, shard_size=2)
    read = []
    monkeypatch.setattr(sd.data.training_data, "read_through", lambda path: read.append(path.name) or 0)
    sd.data.training_data.LatentStore(folder, share=(1, 2))
    assert sorted(read) == ["00001.npy", "00003.npy"]  # rank 1 of 2 reads every second file from the second
    read.clear()
    sd.data.training_data.LatentStore(folder, mmap=True)
    assert read == []  # on demand: nothing read at start


def test_dreambooth_generates_100_class_images_in_all_by_default_whatever_the_instance_count(tmp_path):
    import sd.data.dreambooth
    import sd.train.config

    config = sd.train.config.TrainConfig(datasets=[], class_dir=str(tmp_path / "class"))
    assert config.subject.num_class_images == 100
    settings = sd.data.dreambooth.DreamBoothSettings.from_config(config)
    assert len(sd.data.dreambooth.missing_class_images(settings)) == 100
    (tmp_path / "class").mkdir()
    for i in range(30):  # the user's own images count
        (tmp_path / "class" / f"mine_{i}.png").write_bytes(b"")
    assert len(sd.data.dreambooth.missing_class_images(settings)) == 70
