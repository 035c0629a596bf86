import importlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import encode_latents
import sd.data.encode
import sd.data.shards
import sd.data.training_data
import sd.files
import sd.model
import sd.original_layout

from shard_factory import clean_shard, image_bytes, random_image

ROOT = Path(__file__).resolve().parents[2]
MAX_PIXELS = 150 * 150


def build_shards(folder: Path) -> dict[str, np.ndarray]:
    """Three shards: clean images, every kind of bad sample, and a truncated tar."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    pixels = clean_shard(folder / "00000.tar", [f"a{i}" for i in range(5)], rng)
    # A JPEG that needs resizing (80x64 -> 80x64 crop to 64x64): only its shape is checked.
    wide = sd.data.shards.ShardSample("a5", image_bytes(random_image(rng, 64, 80), "JPEG"), "jpg", "wide", None)
    samples, _ = sd.data.shards.read_shard((folder / "00000.tar").read_bytes())
    sd.data.shards.write_shard(folder / "00000.tar", samples + [wide])

    pixels.update(clean_shard(folder / "00001.tar", ["b0", "b1", "b2"], rng))
    samples, _ = sd.data.shards.read_shard((folder / "00001.tar").read_bytes())
    jpeg = image_bytes(random_image(rng, 64, 64), "JPEG")
    samples += [
        sd.data.shards.ShardSample("b3", os.urandom(500) + b"\xff\xd9", "jpg", "garbage bytes"),
        sd.data.shards.ShardSample("b4", jpeg[: len(jpeg) // 2], "jpg", "cut-off jpeg"),
        sd.data.shards.ShardSample("b5", image_bytes(random_image(rng, 64, 64), "PNG"), "png", None),
        sd.data.shards.ShardSample("b6", image_bytes(random_image(rng, 200, 200), "PNG"), "png", "too many pixels"),
        sd.data.shards.ShardSample("b7", None, "", "a caption without an image"),
    ]
    sd.data.shards.write_shard(folder / "00001.tar", samples)

    pixels.update(clean_shard(folder / "00002.tar", ["c0", "c1", "c2", "c3"], rng))
    data = (folder / "00002.tar").read_bytes()
    cut = data.index(b"c2.png") + 512 + 100  # inside c2's image data
    (folder / "00002.tar").write_bytes(data[:cut])
    return pixels


def encode(shards: Path, out: Path, *extra) -> int:
    return encode_latents.main(["--shards", str(shards / "*.tar"), "--out", str(out), "--vae", "tiny",
                                "--resolution", "64", "--batch_size", "2", "--workers", "3",
                                "--max_pixels", str(MAX_PIXELS), *map(str, extra)])


def expected_means(pixels: list[np.ndarray], flip: bool = False) -> np.ndarray:
    vae = sd.model.load_vae("tiny")
    batch = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).float() / 127.5 - 1
    if flip:
        batch = batch.flip(-1)
    with torch.no_grad():
        return vae.encode(batch).latent_dist.mean.numpy()


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    root = tmp_path_factory.mktemp("enc")
    pixels = build_shards(root / "shards")
    assert encode(root / "shards", root / "latents", "--flip") == 0
    return root, pixels


def test_latents_are_the_posterior_means_of_the_images_in_key_order(encoded):
    root, pixels = encoded
    out = root / "latents"
    expected_keys = {"00000": [f"a{i}" for i in range(6)], "00001": ["b0", "b1", "b2"], "00002": ["c0", "c1"]}
    for stem, keys in expected_keys.items():
        assert (out / f"{stem}.keys.txt").read_text().split() == keys
        latents = np.load(out / f"{stem}.npy")
        assert latents.dtype == np.float16 and latents.shape == (len(keys), 4, 8, 8)
        saved = io.BytesIO()  # written a batch at a time, yet exactly what np.save writes for the array
        np.save(saved, latents)
        assert (out / f"{stem}.npy").read_bytes() == saved.getvalue()
        exact = [k for k in keys if k != "a5"]  # a5 went through the resize path
        want = expected_means([pixels[k] for k in exact])
        got = latents[[keys.index(k) for k in exact]].astype(np.float32)
        np.testing.assert_allclose(got, want.astype(np.float16).astype(np.float32), rtol=2e-3, atol=1e-4)
        flipped = np.load(out / f"{stem}.flip.npy")
        want_flip = expected_means([pixels[k] for k in exact], flip=True)
        np.testing.assert_allclose(flipped[[keys.index(k) for k in exact]].astype(np.float32), want_flip,
                                   rtol=2e-3, atol=1e-3)
        assert not np.allclose(flipped.astype(np.float32), latents.astype(np.float32))


def test_bad_samples_are_skipped_counted_and_named(encoded):
    root, _ = encoded
    out = root / "latents"
    meta = json.loads((out / "latents.json").read_text())
    assert meta["skipped"] == {"no_caption": 1, "no_image": 1, "too_large": 1, "truncated_image": 1,
                               "truncated_tar": 1, "undecodable": 1}
    assert meta["count"] == 11 and meta["shards"] == 3
    assert (meta["vae"], meta["resolution"], meta["latent_shape"]) == ("tiny", 64, [4, 8, 8])
    assert meta["scaling_factor"] == pytest.approx(0.18215)
    report = json.loads((out / "00001.report.json").read_text())
    assert report["encoded"] == 3
    assert report["skipped"] == {"undecodable": ["b3"], "truncated_image": ["b4"], "no_caption": ["b5"],
                                 "too_large": ["b6"], "no_image": ["b7"]}
    assert json.loads((out / "00002.report.json").read_text())["skipped"] == {"truncated_tar": ["c2"]}


def test_the_trainer_reads_the_output(encoded):
    root, _ = encoded
    store = sd.data.training_data.LatentStore(root / "latents")
    assert len(store) == 11 and store.sample_shape == (4, 8, 8)
    assert np.array_equal(store.gather(np.array([store.row_of["b1"]]))[0], np.load(root / "latents" / "00001.npy")[1])


def test_a_rerun_encodes_nothing(encoded, caplog):
    root, _ = encoded
    out = root / "latents"
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != "latents.json"}
    caplog.set_level("INFO")
    assert encode(root / "shards", out, "--flip") == 0
    after = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != "latents.json"}
    assert before == after
    assert "3 already encoded, 0 to do" in caplog.text


@pytest.mark.slow
def test_a_run_killed_mid_shard_resumes_to_the_same_files(encoded, tmp_path):
    root, _ = encoded
    out = tmp_path / "latents"
    # --dtype, the earlier spelling of --precision (docs/latents.md): fp32 is what the reference run used on the CPU.
    cmd = [sys.executable, str(ROOT / "encode_latents.py"), "--shards", str(root / "shards" / "*.tar"), "--out",
           str(out), "--vae", "tiny", "--resolution", "64", "--batch_size", "2", "--workers", "3",
           "--max_pixels", str(MAX_PIXELS), "--flip", "--dtype", "fp32"]
    killed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "SD_FAULT": "after_npy:00001"})
    assert killed.returncode == -9
    assert (out / "00000.keys.txt").exists()
    assert (out / "00001.npy").exists() and not (out / "00001.keys.txt").exists()  # not done
    assert not (out / "00002.npy").exists()
    assert encode(root / "shards", out, "--flip", "--dtype", "fp32") == 0  # the same command, resumed in this process
    reference = root / "latents"
    names = sorted(p.name for p in reference.iterdir() if p.name != "latents.json")
    assert sorted(p.name for p in out.iterdir() if p.name != "latents.json") == names
    for name in names:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert json.loads((out / "latents.json").read_text())["count"] == 11


def same_files(folder: Path, reference: Path) -> None:
    """Every file (hidden leftovers included) byte for byte: latents, flips, keys, reports, latents.json."""
    names = sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in folder.iterdir()) == names
    for name in names:
        assert (folder / name).read_bytes() == (reference / name).read_bytes(), name


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [1, 2])
def test_two_ranks_under_torchrun_write_what_one_process_writes(encoded, tmp_path, nodes):
    """Two ranks on one node, or on two "nodes" (two launchers of one rank each, local rank 0 on both,
    meeting by c10d rendezvous on the loopback address), write the files one process writes."""
    root, _ = encoded
    # The two CPU ranks share the cores, a thread each; the CPU convolutions round differently with another
    # thread count, so the single process they are held to runs on one thread too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert encode(root / "shards", tmp_path / "one", "--flip") == 0
    finally:
        torch.set_num_threads(threads)
    out = tmp_path / "latents"
    args = [str(ROOT / "encode_latents.py"), "--shards", str(root / "shards" / "*.tar"), "--out", str(out), "--vae",
            "tiny", "--resolution", "64", "--batch_size", "2", "--workers", "3", "--max_pixels", str(MAX_PIXELS),
            "--flip"]
    launch = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        launchers = [[*launch, "--standalone", "--nproc_per_node=2", *args]]
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        launchers = [[*launch, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                      f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=encode", *args]] * 2
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}  # as torchrun sets for two ranks on one node
    running = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=environment) for cmd in launchers]
    stderr = ""
    for process in running:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-4000:]
        stderr += err
    assert "rank 0 of 2: 2 shards, 0 already encoded, 2 to do" in stderr  # 00000 and 00002
    assert "rank 1 of 2: 1 shards, 0 already encoded, 1 to do" in stderr  # 00001
    same_files(out, tmp_path / "one")
    assert json.loads((out / "latents.json").read_text())["complete"] is True


def test_ranks_without_torchrun_split_the_shards_and_the_last_to_finish_writes_the_totals(encoded, tmp_path,
                                                                                         monkeypatch):
    root, _ = encoded
    out = tmp_path / "latents"
    assert encode(root / "shards", out, "--flip", "--rank", 1, "--world_size", 2) == 0
    assert sorted(p.name for p in out.glob("*.keys.txt")) == ["00001.keys.txt"]
    assert json.loads((out / "latents.json").read_text())["complete"] is False  # rank 0 has not run

    def kill_at(name, key):
        if (name, key) == ("after_npy", "00000"):
            raise Killed

    monkeypatch.setattr(sd.faults, "point", kill_at)
    with pytest.raises(Killed):  # rank 0 dies after its first shard's .npy, before its done marker
        encode(root / "shards", out, "--flip", "--rank", 0, "--world_size", 2)
    monkeypatch.undo()
    assert (out / "00000.npy").exists() and not (out / "00000.keys.txt").exists()
    assert encode(root / "shards", out, "--flip", "--rank", 1, "--world_size", 2) == 0  # nothing to do, not last
    assert json.loads((out / "latents.json").read_text())["complete"] is False
    assert encode(root / "shards", out, "--flip", "--rank", 0, "--world_size", 2) == 0  # redoes 00000, then 00002
    same_files(out, root / "latents")


@pytest.mark.parametrize("flags, environment, message", [
    (["--rank", "0"], {}, "--rank and --world_size go together"),
    (["--rank", "2", "--world_size", "2"], {}, "--rank must be in 0..1 (--world_size 2), got 2"),
    (["--rank", "0", "--world_size", "2"], {"WORLD_SIZE": "2"}, "under torchrun (WORLD_SIZE is set) leave them out"),
])
def test_bad_ranks_are_one_line_errors(flags, environment, message, monkeypatch, capsys):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        encode_latents.parse_args(["--shards", "x/*.tar", "--out", "o", *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err


def test_decoded_images_in_flight_stay_under_the_limit_on_shards_larger_than_it(tmp_path, monkeypatch, caplog):
    rng = np.random.default_rng(5)
    shards, out = tmp_path / "shards", tmp_path / "latents"
    for shard in range(2):  # two, so that the look-ahead crosses a shard boundary
        clean_shard(shards / f"{shard:05d}.tar", [f"s{shard}_{i:02d}" for i in range(20)], rng, size=16)
    limit = sd.data.encode.in_flight_limit(batch_size=2, workers=2)
    assert limit < 20
    # Counted from the outside: an image counts once decoded, and until it is handed to the VAE.
    lock, count = threading.Lock(), {"now": 0, "peak": 0}
    decode, encode_batch = sd.data.encode.decode_sample, sd.data.encode.Encoder.__call__

    def counting_decode(*args):
        key, result = decode(*args)
        with lock:
            count["now"] += not isinstance(result, str)  # a skip reason is not an image
            count["peak"] = max(count["peak"], count["now"])
        return key, result

    def counting_encode(self, images):
        with lock:
            count["now"] -= len(images)
        return encode_batch(self, images)

    monkeypatch.setattr(sd.data.encode, "decode_sample", counting_decode)
    monkeypatch.setattr(sd.data.encode.Encoder, "__call__", counting_encode)
    caplog.set_level("INFO")
    assert encode_latents.main(["--shards", str(shards / "*.tar"), "--out", str(out), "--vae", "tiny",
                                "--resolution", "16", "--batch_size", "2", "--workers", "2"]) == 0
    assert count["now"] == 0 and 2 <= count["peak"] <= limit  # a batch needs 2 decoded; never more than the limit
    assert f"images were decoded ahead of the VAE (limit {limit})" in caplog.text
    assert [len(np.load(out / f"0000{shard}.npy")) for shard in range(2)] == [20, 20]
    assert (out / "00001.keys.txt").read_text().split() == [f"s1_{i:02d}" for i in range(20)]


def test_the_reader_holds_a_few_samples_of_a_shard_not_the_shard(tmp_path):
    import tracemalloc

    from shard_factory import sparse_tar

    # 40 samples of 4 MB images (holes: nothing on disk); the tar was read whole before: 160 MB.
    members = [member for i in range(40) for member in ((f"k{i:02d}.png", 4 << 20), (f"k{i:02d}.txt", b"a caption"))]
    sparse_tar(tmp_path / "00000.tar", members)
    tracemalloc.start()
    keys = []
    for job, sample in sd.data.encode.read_ahead([tmp_path / "00000.tar"], depth=2):
        keys.append(sample.key if sample is not None else None)
        del sample
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert keys == [f"k{i:02d}" for i in range(40)] + [None] and job.truncated is None and job.failed is None
    assert peak < 24 << 20, peak  # the depth, one being read and one being handed over: ~5 images, not 40


def test_a_key_that_comes_back_later_is_skipped_and_the_first_kept(tmp_path):
    rng = np.random.default_rng(7)
    png = [image_bytes(random_image(rng, 64, 64), "PNG") for _ in range(3)]
    samples = [sd.data.shards.ShardSample("a", png[0], "png", "first a"), sd.data.shards.ShardSample("b", png[1], "png", "b"),
               sd.data.shards.ShardSample("a", png[2], "png", "a again")]
    sd.data.shards.write_shard(tmp_path / "shards" / "00000.tar", samples)
    assert encode(tmp_path / "shards", tmp_path / "latents") == 0
    assert (tmp_path / "latents" / "00000.keys.txt").read_text().split() == ["a", "b"]
    report = json.loads((tmp_path / "latents" / "00000.report.json").read_text())
    assert report["skipped"] == {"duplicate_key": ["a"]}
    first = expected_means([sd.data.shards.resize_center_crop(sd.data.shards.decode_image(png[0], "png"), 64)])
    np.testing.assert_allclose(np.load(tmp_path / "latents" / "00000.npy")[0].astype(np.float32), first[0],
                               atol=2e-3, rtol=0)
    # Stage 04 keeps the same first "a" and skips the same later one.
    stage04 = importlib.import_module("pipeline.04_preprocess_to_cache")
    read, cut = stage04.tar_samples(tmp_path / "shards" / "00000.tar")
    assert [(s.key, s.caption, s.problem) for s in read] == [("a", "first a", None), ("b", "b", None),
                                                             ("a", "a again", "duplicate_key")] and cut is None


def test_non_finite_latents_stop_naming_the_key(tmp_path, capsys):
    vae = sd.model.load_vae("tiny")
    with torch.no_grad():
        vae.encoder.conv_in.weight.fill_(float("nan"))
    vae.save_pretrained(tmp_path / "nan_vae")
    clean_shard(tmp_path / "shards" / "00000.tar", ["x0", "x1"], np.random.default_rng(1))
    code = encode_latents.main(["--shards", str(tmp_path / "shards" / "*.tar"), "--out", str(tmp_path / "out"),
                                "--vae", str(tmp_path / "nan_vae"), "--resolution", "64"])
    assert code == 1
    assert "non-finite latents for keys ['x0', 'x1']" in capsys.readouterr().err
    assert not (tmp_path / "out" / "00000.npy").exists() and not (tmp_path / "out" / "00000.keys.txt").exists()


def folder_state(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.iterdir()}


@pytest.mark.parametrize("flags, message", [
    (["--resolution", "128", "--flip"], "was encoded with resolution=64 but this run asks for resolution=128"),
    (["--resolution", "64"], "was encoded with flip=True but this run asks for flip=False"),
])
def test_a_different_encoding_into_the_same_folder_is_refused(encoded, capsys, flags, message):
    root, _ = encoded
    before = folder_state(root / "latents")
    capsys.readouterr()
    assert encode_latents.main(["--shards", str(root / "shards" / "*.tar"), "--out", str(root / "latents"),
                                "--vae", "tiny", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(root / "latents") in err and message in err
    assert folder_state(root / "latents") == before  # nothing written


class Killed(BaseException):
    """Stands for SIGKILL in-process: nothing in the encoder catches it."""


def test_settings_are_written_before_any_shard_and_a_killed_folder_keeps_them(tmp_path, monkeypatch, capsys):
    shards, out = tmp_path / "shards", tmp_path / "latents"
    rng = np.random.default_rng(3)
    clean_shard(shards / "00000.tar", ["p0", "p1"], rng)
    clean_shard(shards / "00001.tar", ["q0", "q1"], rng)

    def kill_at(name, key):
        if (name, key) == ("after_npy", "00000"):
            meta = json.loads((out / "latents.json").read_text())  # already there when the first shard lands
            assert (meta["resolution"], meta["latent_shape"], meta["complete"]) == (64, [4, 8, 8], False)
            raise Killed

    monkeypatch.setattr(sd.faults, "point", kill_at)
    with pytest.raises(Killed):
        encode(shards, out)
    monkeypatch.undo()
    meta = json.loads((out / "latents.json").read_text())
    assert (meta["vae"], meta["resolution"], meta["flip"], meta["dtype"]) == ("tiny", 64, False, "float16")
    assert meta["complete"] is False and meta["count"] == 0
    before = folder_state(out)
    capsys.readouterr()
    code = encode_latents.main(["--shards", str(shards / "*.tar"), "--out", str(out), "--vae", "tiny",
                                "--resolution", "128"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert f"{out} was encoded with resolution=64 but this run asks for resolution=128" in err
    assert folder_state(out) == before
    assert encode(shards, out) == 0
    meta = json.loads((out / "latents.json").read_text())
    assert (meta["complete"], meta["count"], meta["shards"]) == (True, 4, 2)


def test_a_folder_from_before_latents_json_is_checked_by_its_shards(encoded, tmp_path, capsys):
    root, _ = encoded
    old = tmp_path / "old"
    old.mkdir()
    for name in ("00000.npy", "00000.keys.txt", "00000.report.json"):
        (old / name).write_bytes((root / "latents" / name).read_bytes())
    assert encode_latents.main(["--shards", str(root / "shards" / "*.tar"), "--out", str(old), "--vae", "tiny",
                                "--resolution", "128"]) == 2
    assert "latent_shape=[4, 8, 8] but this run asks for latent_shape=[4, 16, 16]" in capsys.readouterr().err
    assert not (old / "latents.json").exists()


def test_a_damaged_latents_json_is_a_one_line_error(encoded, tmp_path, capsys):
    out = tmp_path / "latents"
    out.mkdir()
    (out / "latents.json").write_text('{"vae": "tiny", "resol')
    root, _ = encoded
    assert encode_latents.main(["--shards", str(root / "shards" / "*.tar"), "--out", str(out), "--vae", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out / 'latents.json'} is not readable JSON" in err
    assert sorted(p.name for p in out.iterdir()) == ["latents.json"]


def test_no_matching_shards_is_a_one_line_error(tmp_path, capsys):
    assert encode_latents.main(["--shards", str(tmp_path / "*.tar"), "--out", str(tmp_path / "o"), "--vae", "tiny"]) == 2
    assert "no shards match" in capsys.readouterr().err


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        encode_latents.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--shards", "--out", "--vae", "--resolution", "--batch_size", "--workers", "--precision",
                 "--compile", "--device", "--flip", "--max_pixels", "--max_encode_pixels", "--max_aspect", "--prefetch", "--rank",
                 "--world_size"):
        assert f"  {flag} " in out, flag
    assert "--dtype" not in out.split("options:")[1]  # the old spelling works, not listed as a flag


ARGS = ["--shards", "x/*.tar", "--out", "o"]


def test_precision_is_named_once_and_the_old_dtype_spelling_still_works(capsys):
    assert encode_latents.parse_args(ARGS).precision == "auto"
    assert encode_latents.parse_args([*ARGS, "--precision", "bf16"]).precision == "bf16"
    assert encode_latents.parse_args([*ARGS, "--dtype", "fp16"]).precision == "fp16"
    with pytest.raises(SystemExit) as exit_info:
        encode_latents.parse_args([*ARGS, "--dtype", "fp8"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("encode_latents.py: error: argument --dtype: invalid choice: 'fp8' "
                                       "(choose from 'auto', 'fp32', 'bf16', 'fp16')\n")
    with pytest.raises(SystemExit) as exit_info:
        encode_latents.parse_args([*ARGS, "--prec", "fp32"])  # never abbreviated
    assert exit_info.value.code == 2 and capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize("form, expected", [([], False), (["FLAG"], True), (["FLAG", "true"], True),
                                            (["FLAG", "false"], False)])
def test_boolean_flags_take_an_optional_true_or_false(form, expected):
    for flag in ("--flip", "--compile"):
        args = encode_latents.parse_args([*ARGS, *[word.replace("FLAG", flag) for word in form], "--workers", "3"])
        assert getattr(args, flag[2:]) is expected and args.workers == 3


def test_resize_center_crop_geometry():
    # 192 wide x 96 high, bands red/green/blue 64 px each. Scaled by 1/3 to 64 x 32 the bands span
    # columns 0-21, 21-43, 43-64; the centre crop takes columns 16-48: red 0-5, green 5-27, blue 27-32.
    image = np.zeros((96, 192, 3), np.uint8)
    image[:, :64, 0] = 255
    image[:, 64:128, 1] = 255
    image[:, 128:, 2] = 255
    out = sd.data.shards.resize_center_crop(image, 32)
    assert out.shape == (32, 32, 3)
    assert (out[:, 7:25] == (0, 255, 0)).all()
    assert (out[:, :4] == (255, 0, 0)).all() and (out[:, -4:] == (0, 0, 255)).all()
    # Upscaling a 16x24 image: short side 16 -> 32, long 24 -> 48, crop rows 0..32, cols 8..40.
    small = np.arange(16 * 24 * 3, dtype=np.uint8).reshape(16, 24, 3)
    assert sd.data.shards.resize_center_crop(small, 32).shape == (32, 32, 3)
    same = sd.data.shards.resize_center_crop(image[:64, :64], 64)
    assert np.array_equal(same, image[:64, :64])


def test_decode_image_reports_reasons():
    rng = np.random.default_rng(0)
    png = image_bytes(random_image(rng, 40, 30), "PNG")
    assert sd.data.shards.decode_image(png, "png").shape == (40, 30, 3)
    for data, ext, reason in ((png[:-20], "png", "truncated_image"), (b"\x89PNG" + os.urandom(64) + b"IEND\xaeB`\x82",
                                                                     "png", "undecodable")):
        with pytest.raises(sd.data.shards.ImageSkip) as info:
            sd.data.shards.decode_image(data, ext)
        assert info.value.reason == reason
    with pytest.raises(sd.data.shards.ImageSkip) as info:
        sd.data.shards.decode_image(png, "png", max_pixels=40 * 30 - 1)
    assert info.value.reason == "too_large"
    rgb = sd.data.shards.decode_image(image_bytes(np.full((8, 8, 3), (200, 10, 30), np.uint8), "PNG"), "png")
    assert tuple(rgb[0, 0]) == (200, 10, 30)  # RGB order, not OpenCV's BGR


def test_a_shard_with_nothing_to_encode_is_counted_and_named_and_the_run_finishes(tmp_path, caplog):
    shards, out = tmp_path / "shards", tmp_path / "latents"
    clean_shard(shards / "00000.tar", ["k0", "k1"], np.random.default_rng(2))
    (shards / "00001.tar").write_bytes(b"")
    (shards / "00002.tar").write_bytes(b"this is not a tar file\n" * 100)
    sd.data.shards.write_shard(shards / "00003.tar", [sd.data.shards.ShardSample("bad", os.urandom(300) + b"\xff\xd9", "jpg", "garbage")])
    caplog.set_level("INFO")
    assert encode(shards, out) == 0
    meta = json.loads((out / "latents.json").read_text())
    assert meta["failed_shards"] == {"empty_tar": ["00001.tar"], "no_usable_sample": ["00003.tar"],
                                     "unreadable_tar": ["00002.tar"]}
    assert (meta["count"], meta["shards"], meta["skipped"], meta["complete"]) == (2, 1, {"undecodable": 1}, True)
    assert "00001.tar" in caplog.text and "00002.tar" in caplog.text and "00003.tar" in caplog.text
    assert json.loads((out / "00003.report.json").read_text())["skipped"] == {"undecodable": ["bad"]}
    assert sorted(p.name for p in out.glob("*.keys.txt")) == ["00000.keys.txt"]  # no done marker for them
    assert sd.data.training_data.LatentStore(out).keys == ["k0", "k1"]
    assert encode(shards, out) == 0  # a re-run tries them again (a fixed tar would be encoded) and adds up the same
    assert json.loads((out / "latents.json").read_text()) == meta


def test_shards_of_which_nothing_is_encoded_fail_naming_each_reason(tmp_path, capsys):
    """Every shard failed (an empty one, one that is no tar, one whose only image is garbage) once exited 0, and
    the user learnt it from SD_Train.py three commands later; now 1 with one line naming the shards and what
    to do. A re-run says the same; the folder is recorded as complete with 0 latents."""
    shards, out = tmp_path / "shards", tmp_path / "latents"
    (shards / "00000.tar").parent.mkdir(parents=True)
    (shards / "00000.tar").write_bytes(b"")
    (shards / "00001.tar").write_bytes(b"this is not a tar file\n" * 100)
    sd.data.shards.write_shard(shards / "00002.tar", [sd.data.shards.ShardSample("bad", os.urandom(300) + b"\xff\xd9",
                                                                                "jpg", "garbage")])
    for _ in range(2):
        capsys.readouterr()
        assert encode(shards, out) == 1
        error = [line for line in capsys.readouterr().err.splitlines() if "encode_latents.py" in line]
        assert len(error) == 1 and error[0].startswith("encode_latents.py: error: no latent was encoded: "), error
        for said in ("1 shards empty_tar (00000.tar)", "1 shards unreadable_tar (00001.tar): the shards cannot be read",
                     "1 shards no_usable_sample (00002.tar)", "1 samples undecodable (bad)"):
            assert said in error[0], said
    assert json.loads((out / "latents.json").read_text())["count"] == 0


def test_resize_center_crop_work_is_bounded_by_the_output():
    import tracemalloc

    strip = np.full((1, 4000, 3), 200, np.uint8)  # scaled whole to 64 px high it would be 256000 x 64 (49 MB)
    tracemalloc.start()
    try:
        square = sd.data.shards.resize_center_crop(strip, 64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert square.shape == (64, 64, 3) and (square == 200).all()
    assert peak < 4 * 64 * 64 * 3  # a few output-sized buffers, not the scaled strip


def test_an_extremely_elongated_image_is_skipped_before_decoding(tmp_path):
    strip = image_bytes(np.zeros((1, 12000, 3), np.uint8), "PNG")  # ~120 bytes, 12000 pixels: under any pixel cap
    assert len(strip) < 200
    with pytest.raises(sd.data.shards.ImageSkip) as info:
        sd.data.shards.decode_image(strip, "png")
    assert info.value.reason == "extreme_aspect" and "12000x1" in str(info.value)
    assert sd.data.shards.decode_image(strip, "png", max_aspect=12000).shape == (1, 12000, 3)

    shards, out = tmp_path / "shards", tmp_path / "latents"
    clean_shard(shards / "00000.tar", ["ok"], np.random.default_rng(4))
    samples, _ = sd.data.shards.read_shard((shards / "00000.tar").read_bytes())
    tall = image_bytes(np.zeros((270, 30, 3), np.uint8), "PNG")  # 9:1, over the default 8
    samples += [sd.data.shards.ShardSample("strip", strip, "png", "a strip"),
                sd.data.shards.ShardSample("tall", tall, "png", "a tall one")]
    sd.data.shards.write_shard(shards / "00000.tar", samples)
    assert encode(shards, out) == 0
    report = json.loads((out / "00000.report.json").read_text())
    assert report["skipped"] == {"extreme_aspect": ["strip", "tall"]} and report["encoded"] == 1
    assert encode(shards, tmp_path / "wide_ok", "--max_aspect", "10") == 0
    assert (tmp_path / "wide_ok" / "00000.keys.txt").read_text().split() == ["ok", "tall"]


def test_a_second_encoder_on_a_folder_in_use_stops_at_once_and_ranks_each_lock_their_own(tmp_path, capsys):
    shards, out = tmp_path / "shards", tmp_path / "latents"
    clean_shard(shards / "00000.tar", ["x0", "x1"], np.random.default_rng(1))
    for name, flags in ((".lock", []), (".lock.rank0of2", ["--rank", 0, "--world_size", 2])):
        first = sd.files.FolderLock(out, name).acquire()  # an encoder at work (here: this process)
        try:
            capsys.readouterr()
            assert encode(shards, out, *flags) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"{out} is in use by process {os.getpid()}" in err
            assert sorted(p.name for p in out.iterdir()) == [name]  # nothing written
        finally:
            first.release()
    rank0 = sd.files.FolderLock(out, ".lock.rank0of2").acquire()
    try:  # another rank of the same run shares the folder (its shards are others)
        assert encode(shards, out, "--rank", 1, "--world_size", 2) == 0
    finally:
        rank0.release()
    assert not list(out.glob(".lock*"))


def test_a_full_disk_is_one_line_and_leaves_no_temporary_and_the_finished_shards(tmp_path, monkeypatch, capsys):
    import builtins
    import errno

    shards, out = tmp_path / "shards", tmp_path / "latents"
    rng = np.random.default_rng(6)
    clean_shard(shards / "00000.tar", ["p0", "p1"], rng)
    clean_shard(shards / "00001.tar", ["q0", "q1"], rng)

    class FullDisk:
        """A file on a full disk: every write fails, and so does the flush of what close finds buffered."""

        def __init__(self, path, mode):
            self.file = builtins.open(path, mode)

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self):
            self.file.close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        if "w" in mode and Path(path).name.startswith(".00001"):  # shard 00001's latents: the disk is full
            return FullDisk(path, mode)
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(sd.data.encode, "open", open_on_a_full_disk, raising=False)
    assert encode(shards, out) == 1
    last_line = capsys.readouterr().err.splitlines()[-1]  # the progress bar comes before it; no traceback after
    assert last_line.startswith(f"encode_latents.py: error: {out}: the disk is full (No space left on device); "
                                "free some space")
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary, no lock
    assert (out / "00000.keys.txt").read_text().split() == ["p0", "p1"]  # the finished shard is intact
    assert np.load(out / "00000.npy").shape == (2, 4, 8, 8) and not (out / "00001.keys.txt").exists()


@pytest.mark.parametrize("flags, message", [
    (["--bucket_list", "512x512,16384x8192"], "bucket 16384x8192 has 134217728 pixels, over --max_encode_pixels"),
    (["--resolution", "4096"], "--resolution 4096 has 16777216 pixels, over --max_encode_pixels 4194304"),
])
def test_a_size_over_the_pixel_cap_stops_before_any_work(tmp_path, capsys, flags, message):
    clean_shard(tmp_path / "shards" / "00000.tar", ["x0"], np.random.default_rng(1))
    with pytest.raises(SystemExit) as exit_info:
        encode_latents.main(["--shards", str(tmp_path / "shards" / "*.tar"), "--out", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err
    assert not (tmp_path / "out").exists()
    assert encode_latents.parse_args(["--shards", "x", "--out", "o", *flags, "--max_encode_pixels", str(2**27)]) \
        .max_encode_pixels == 2**27


def test_a_vae_the_offline_hub_cannot_give_is_one_line_and_writes_nothing(encoded, tmp_path, capsys, monkeypatch):
    root, _ = encoded
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert encode_latents.main(["--shards", str(root / "shards" / "*.tar"), "--out", str(tmp_path / "out"),
                                "--vae", "nobody/no-such-vae", "--resolution", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("encode_latents.py: error: vae nobody/no-such-vae: cannot be loaded (") and "\n" not in err
    assert "it is not in the local cache; give a local folder, or a hub id with the hub reachable" in err
    assert not list(tmp_path.glob("out/*.npy"))  # nothing encoded


def test_a_vae_only_single_file_encodes_as_the_vae_it_holds_and_its_digest_is_recorded(encoded, tmp_path):
    root, _ = encoded
    vae = sd.model.load_vae("tiny")
    state = sd.original_layout.to_original(vae, sd.original_layout.vae_key_map(vae), half=False)
    save_file({k.removeprefix("first_stage_model."): v for k, v in state.items()}, tmp_path / "vae.safetensors")
    assert encode_latents.main(["--shards", str(root / "shards" / "*.tar"), "--out", str(tmp_path / "latents"),
                                "--vae", str(tmp_path / "vae.safetensors"), "--resolution", "64", "--batch_size",
                                "2", "--max_pixels", str(MAX_PIXELS), "--flip"]) == 0
    ours, theirs = (json.loads((folder / "latents.json").read_text()) for folder in (tmp_path / "latents",
                                                                                     root / "latents"))
    assert ours["vae_encoder"] == theirs["vae_encoder"] == sd.model.encoder_digest(vae)
    for npy in sorted((root / "latents").glob("*.npy")):
        assert np.array_equal(np.load(npy), np.load(tmp_path / "latents" / npy.name)), npy.name
