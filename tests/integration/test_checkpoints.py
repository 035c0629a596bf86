"""Checkpoints that verify before they are trusted: manifest, fallback, rank agreement, failed writes.

The runs are in-process, one rank, tiny presets: 64 samples, batch 4, 16 steps an epoch.
"""

import errno
import json
import logging
import os
import random

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

import sd.distributed
import sd.formats
import sd.model
import sd.run_folder
import sd.train.checkpoint as ckpt
import SD_Train

BASE = dict(unet="tiny", vae="tiny", text_encoder="tiny", precision="fp32", device="cpu", grad_checkpointing=False,
            batch_size=4, grad_accum=1, lr=1e-3, warmup_steps=2, ema_decay=0.9, log_every=1, save_steps=2,
            keep_checkpoints=5, validate_every=0, validation_prompts=[], cfg_dropout=0.1, seed=0)
STEPS = 8


@pytest.fixture(scope="module")
def data(dataset_64):
    return dataset_64


def main(flags) -> int:
    """``SD_Train.main`` as if in a new process: the global RNGs start wherever (a new process seeds
    Python's and NumPy's from the OS), so nothing may depend on their state before the run."""
    entropy = int.from_bytes(os.urandom(8), "little")
    random.seed(entropy)
    np.random.seed(entropy % 2**32)
    torch.manual_seed(entropy)
    torch.rand(entropy % 7)
    return SD_Train.main(flags)


def config_file(path, data, run_dir, **fields):
    path.write_text(yaml.safe_dump({**BASE, "datasets": [data], "out_dir": str(run_dir), "max_steps": STEPS,
                                    **fields}))
    return ["--config", str(path)]


def saved_tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds, RNG states included, by a flat name."""
    tensors = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".safetensors":
            tensors.update({f"{path.stem}.{k}": v for k, v in load_file(path).items()})
        elif path.suffix == ".pt":
            flatten(torch.load(path, weights_only=True), path.stem, tensors)
    return tensors


def flatten(value, name, out):
    if isinstance(value, torch.Tensor):
        out[name] = value
    elif isinstance(value, dict):
        for key, item in value.items():
            flatten(item, f"{name}.{key}", out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            flatten(item, f"{name}.{i}", out)
    else:
        out[name] = torch.tensor([hash(repr(value))])  # plain values compare through their repr


def assert_bitwise_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{len(different)} of {len(a)} tensors differ, e.g. {different[:4]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """The uninterrupted run: 8 steps, a checkpoint every 2."""
    root = tmp_path_factory.mktemp("reference")
    assert main(config_file(root / "c.yaml", data, root / "run")) == 0
    return saved_tensors(root / "run" / "checkpoints" / sd.run_folder.step_dir_name(STEPS))


def test_a_checkpoint_has_a_manifest_of_every_file(reference, tmp_path, data):
    run_dir = tmp_path / "run"
    assert SD_Train.main(config_file(tmp_path / "c.yaml", data, run_dir, max_steps=2)) == 0
    folder = run_dir / "checkpoints" / sd.run_folder.step_dir_name(2)
    manifest = json.loads((folder / sd.run_folder.MANIFEST).read_text())
    names = sorted(p.name for p in folder.iterdir() if p.name not in (sd.run_folder.MANIFEST, sd.run_folder.COMPLETE))
    assert sorted(manifest["files"]) == names and "unet.safetensors" in names and "config.yaml" in names
    for name, entry in manifest["files"].items():
        assert entry["size"] == (folder / name).stat().st_size
        assert entry[sd.run_folder.HASH] == sd.run_folder.file_hash(folder / name)
    assert sd.run_folder.verify(folder, names) is True


def damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # 4 KiB overwritten inside the tensor data: the size and the header stay valid
        middle = len(data) // 2
        data[middle : middle + 4096] = b"\x7f" * 4096
        path.write_bytes(data)


@pytest.mark.parametrize("how", ["truncated", "overwritten"])
def test_a_damaged_newest_checkpoint_is_named_set_aside_and_the_previous_one_resumes_exactly(
        reference, tmp_path, data, how, caplog):
    run_dir = tmp_path / "run"
    flags = config_file(tmp_path / "c.yaml", data, run_dir)
    assert main([*flags, "--stop_at_step", "6"]) == 0
    newest = run_dir / "checkpoints" / sd.run_folder.step_dir_name(6)
    damage(newest / "unet.safetensors", how)
    with caplog.at_level(logging.WARNING, logger="sd_train"):
        assert main(flags) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "damaged" in r.getMessage()]
    assert len(warnings) == 1 and str(newest / "unet.safetensors") in warnings[0], warnings
    assert (run_dir / "checkpoints" / (newest.name + sd.run_folder.DAMAGED_SUFFIX) / "unet.safetensors").exists()
    # resumed at step 4, trained 4..8 again (step 6 re-saved): the same weights, optimizer and RNGs
    assert_bitwise_equal(saved_tensors(run_dir / "checkpoints" / sd.run_folder.step_dir_name(STEPS)), reference)
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, lr, scales", [("prodigy", 1.0, {}),
                                                   ("adamw_schedulefree", 1e-3, dict(mid_lr_scale=0.5))])
def test_a_stopped_full_fine_tune_resumes_bitwise_with_each_optimizer(tmp_path, data, optimizer, lr, scales):
    """4 steps straight against 2 + 2 resumed (a checkpoint at step 2, as the straight run saves too): every
    saved value equal (the UNet, the EMA, the optimizer's state and groups, every RNG); Schedule-Free with the
    blocks in parameter groups of their own."""
    fields = dict(max_steps=4, optimizer=optimizer, lr=lr, save_steps=2, **scales)
    assert main(config_file(tmp_path / "a.yaml", data, tmp_path / "a", **fields)) == 0
    flags = config_file(tmp_path / "b.yaml", data, tmp_path / "b", **fields)
    assert main([*flags, "--stop_at_step", "3"]) == 0
    assert main(flags) == 0
    straight = saved_tensors(tmp_path / "a" / "checkpoints" / sd.run_folder.step_dir_name(4))
    assert_bitwise_equal(straight, saved_tensors(tmp_path / "b" / "checkpoints" / sd.run_folder.step_dir_name(4)))
    assert len([k for k in straight if k.startswith("optimizer.state.")]) >= 2 * len(
        [k for k in straight if k.startswith("unet.")])
    optimizer_file = tmp_path / "b" / "checkpoints" / sd.run_folder.step_dir_name(4) / "optimizer.pt"
    groups = [g["name"] for g in torch.load(optimizer_file, weights_only=True)["param_groups"]]
    assert groups == (["unet", "unet_down", "unet_mid", "unet_up"] if scales else ["unet"])


def test_weights_that_do_not_match_their_fingerprint_are_damaged(tmp_path, data):
    """A valid weights file with a manifest to match, but not the weights this rank saved."""
    run_dir = tmp_path / "run"
    assert SD_Train.main(config_file(tmp_path / "c.yaml", data, run_dir, max_steps=4)) == 0
    old, new = (run_dir / "checkpoints" / sd.run_folder.step_dir_name(s) for s in (2, 4))
    (new / "unet.safetensors").write_bytes((old / "unet.safetensors").read_bytes())
    manifest = json.loads((new / sd.run_folder.MANIFEST).read_text())
    manifest["files"].update(sd.run_folder.describe_files([new / "unet.safetensors"]))
    (new / sd.run_folder.MANIFEST).write_text(json.dumps(manifest))
    config = SD_Train.load_config(config_file(tmp_path / "c.yaml", data, run_dir, max_steps=4))
    run = SD_Train.build(config, sd.distributed.Dist.single())
    assert run.state.step == 2
    assert (run_dir / "checkpoints" / "step_00000004.damaged").is_dir()


def test_every_checkpoint_damaged_stops_instead_of_starting_over(tmp_path, data, capsys):
    run_dir = tmp_path / "run"
    flags = config_file(tmp_path / "c.yaml", data, run_dir, max_steps=4)
    assert SD_Train.main(flags) == 0
    for step in (2, 4):
        damage(run_dir / "checkpoints" / sd.run_folder.step_dir_name(step) / "optimizer.pt", "truncated")
    assert SD_Train.main(flags) == 2
    err = capsys.readouterr().err
    assert "no usable checkpoint" in err and "step_00000002" in err and "step_00000004" in err
    assert SD_Train.main(flags) == 2  # the run folder is not mistaken for a new run on the next attempt
    assert sd.run_folder.complete_checkpoints(run_dir / "checkpoints") == []


def write_checkpoint(folder, size=64):
    folder.mkdir(parents=True)
    (folder / "unet.safetensors").write_bytes(os.urandom(size))
    (folder / sd.run_folder.MANIFEST).write_text(json.dumps(
        {"hash": sd.run_folder.HASH, "files": sd.run_folder.describe_files([folder / "unet.safetensors"])}))
    (folder / sd.run_folder.COMPLETE).write_text("ok")


def test_rotation_never_removes_the_newest_intact_checkpoint(tmp_path):
    for step in (2, 4, 6):
        write_checkpoint(tmp_path / sd.run_folder.step_dir_name(step))
    damage(tmp_path / sd.run_folder.step_dir_name(6) / "unet.safetensors", "truncated")
    ckpt.prune(tmp_path, keep_last=1)
    # step 6 is short of its manifest's size: it neither counts nor is deleted; step 4 is the newest intact one
    assert [s for s, _ in sd.run_folder.complete_checkpoints(tmp_path)] == [4, 6]


def test_ranks_whose_weights_differ_stop_the_run_naming_them(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    mine = sd.run_folder.weights_fingerprint(model.parameters())
    other = mine.clone()
    other[2] += 1e-12  # rank 2's second layer's weight
    monkeypatch.setattr(sd.distributed, "all_gather_objects", lambda value, d: [mine, mine, other, mine])
    with pytest.raises(sd.run_folder.CheckpointError, match=r"rank\(s\) 2 differ from rank 0's \(first in 1.weight\)"):
        ckpt.check_ranks_agree(model, sd.distributed.Dist.single(), 10)
    monkeypatch.setattr(sd.distributed, "all_gather_objects", lambda value, d: [mine] * 4)
    ckpt.check_ranks_agree(model, sd.distributed.Dist.single(), 10)


def test_a_full_disk_during_a_save_names_the_error_and_file_and_leaves_no_staging(tmp_path, data, monkeypatch,
                                                                                   capsys):
    run_dir = tmp_path / "run"
    flags = config_file(tmp_path / "c.yaml", data, run_dir, max_steps=4)
    real_save = ckpt.save_torch

    def full_disk(obj, path):
        if path.name == "optimizer.pt" and "00000004" in str(path.parent):
            with open(path, "wb") as f:
                f.write(b"partial")
                try:  # the way torch.save reports it: a RuntimeError whose context is the OSError
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                except OSError:
                    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
        real_save(obj, path)

    monkeypatch.setattr(ckpt, "save_torch", full_disk)
    assert SD_Train.main(flags) == 2
    err = capsys.readouterr().err
    assert "[ENOSPC] No space left on device" in err and str(ckpt.staging_dir(run_dir / "checkpoints", 4)) in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [sd.run_folder.step_dir_name(2)]
    assert sd.run_folder.verify(run_dir / "checkpoints" / sd.run_folder.step_dir_name(2),
                       sorted(json.loads((run_dir / "checkpoints" / "step_00000002" / sd.run_folder.MANIFEST).read_text())["files"]))


def test_a_library_write_error_names_its_errno():
    assert ckpt.write_error_text(Exception("Error while serializing: I/O error: No space left on device (os error 28)")) \
        == "[ENOSPC] No space left on device"


@pytest.mark.parametrize("every_epoch, steps", [(False, [6, 10]), (True, [4, 6, 8, 10])])
def test_saves_follow_save_steps_and_the_end_and_epoch_ends_only_when_asked(tmp_path, dataset_16, every_epoch, steps):
    # 16 samples at batch 4: an epoch ends every 4 steps.
    flags = config_file(tmp_path / "c.yaml", dataset_16, tmp_path / "run", max_steps=10, save_steps=6,
                        keep_checkpoints=10, save_every_epoch=every_epoch)
    assert main(flags) == 0
    saved = sorted(int(p.name.split("_")[1]) for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved == steps


@pytest.mark.slow
def test_post_hoc_ema_snapshots_resume_bit_for_bit_and_rebuild_any_length(tmp_path, data, caplog):
    """posthoc_ema_every 2 over 5 steps (snapshots at 2, 4 and the last, 5), straight and stopped at 3 then
    resumed (a snapshot of step 4 left from a lost run is removed and written again): the kept EMAs in the
    checkpoints and every snapshot equal bit for bit; SD_ImageGen.py --ema_length 0.05 writes the
    kept EMA of that length at step 5 (fp16 snapshots), 0.08 another, and the plain export the classic EMA;
    with the last snapshot cut short, it names that file and rebuilds at the snapshot before."""
    import SD_ImageGen
    import sd.posthoc_ema

    fields = dict(max_steps=5, posthoc_ema_every=2, save_steps=2)
    straight, split = tmp_path / "a", tmp_path / "b"
    assert main(config_file(tmp_path / "a.yaml", data, straight, **fields)) == 0
    flags = config_file(tmp_path / "b.yaml", data, split, **fields)
    assert main([*flags, "--stop_at_step", "3"]) == 0
    (split / "posthoc_ema" / "step_00000004.safetensors").write_bytes(b"a snapshot of a lost future")
    assert main(flags) == 0
    last = sd.run_folder.step_dir_name(5)
    assert_bitwise_equal(saved_tensors(straight / "checkpoints" / last), saved_tensors(split / "checkpoints" / last))
    shots = [[p.name for _, p in sd.posthoc_ema.snapshots(run)] for run in (straight, split)]
    assert shots[0] == shots[1] == [f"step_{s:08d}.safetensors" for s in (2, 4, 5)]
    for name in shots[0]:
        assert_bitwise_equal(load_file(straight / "posthoc_ema" / name), load_file(split / "posthoc_ema" / name))
    kept = load_file(straight / "checkpoints" / last / "posthoc_ema.safetensors")
    assert len(kept) == 2 * len(load_file(straight / "checkpoints" / last / "unet.safetensors"))

    def unet_of(*flags) -> dict[str, torch.Tensor]:
        out = tmp_path / f"export_{len(list(tmp_path.glob('export_*')))}.safetensors"
        assert SD_ImageGen.main(["--ckpt", str(straight), *flags, "--export_single_file", str(out)]) == 0
        return {k: v for k, v in load_file(out).items() if k.startswith("model.diffusion_model.")}

    plain, short, between = unet_of(), unet_of("--ema_length", "0.05"), unet_of("--ema_length", "0.08")
    ours = sd.formats.unet_key_map(sd.model.build_unet("tiny", from_scratch=False))
    kept_short = {ours[k.split("/", 1)[1]]: v for k, v in kept.items() if k.startswith("sigma_rel_0.05/")}
    for name, tensor in kept_short.items():
        torch.testing.assert_close(short[name], tensor, atol=2e-3, rtol=1e-3)  # rebuilt from fp16 snapshots
    assert max((between[k] - short[k]).abs().max() for k in short) > 1e-4
    assert max((plain[k] - short[k]).abs().max() for k in short) > 1e-4
    damaged = straight / "posthoc_ema" / shots[0][-1]  # the last snapshot cut short: named, the one before used
    damaged.write_bytes(damaged.read_bytes()[:-64])
    with caplog.at_level("WARNING"):
        earlier = unet_of("--ema_length", "0.05")
    assert str(damaged) in caplog.text
    rebuilt, step = sd.posthoc_ema.reconstruct(straight, 0.05, 4)
    for ours_name, tensor in rebuilt.items():
        torch.testing.assert_close(earlier[ours[ours_name]], tensor.to(earlier[ours[ours_name]].dtype))
