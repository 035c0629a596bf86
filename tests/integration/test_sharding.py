"""``sharding: zero1 | fsdp`` on 2 gloo ranks under torchrun: the same losses as DDP, a bitwise resume,
checkpoints an unsharded run (and the exporters) read, and skipped non-finite steps."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import sd.data.training_data
import sd.formats
import sd.run_folder
import sd.train.recovery
import SD_Train
from sd.distributed import Dist
from sd.train.config import TrainConfig

from data_factory import BASE, assert_bitwise_equal, make_dataset
from test_sd_train import final_state, losses, torchrun_runs, write_config

# 64 training samples, 2 ranks x batch 2 x accumulation 2: 8 optimizer steps per epoch.
TOTAL, HALF = 6, 3
SHARDED = ["zero1", "fsdp"]


def run(root: Path, data, sharding: str, out: str, *flags) -> list[str]:
    """The command line of a TOTAL-step run into ``root / out``, its down and up blocks in parameter groups of
    their own (at lr x 0.5 and x 2)."""
    config = write_config(root / f"{out}.yaml", datasets=[data], max_steps=TOTAL, out_dir=str(root / out),
                          validate_every=HALF, sharding=sharding, down_lr_scale=0.5, up_lr_scale=2.0)
    return ["--config", str(config), *map(str, flags)]


NAN_STEP = 5  # a step after HALF: the resumed half meets it


def dataset_with_a_nan_sample(root: Path) -> dict:
    """64 training and 8 validation samples, the first sample of rank 0's step NAN_STEP made NaN."""
    entry = make_dataset(root, n_train=64, n_val=8)
    order = sd.data.training_data.epoch_order([64], [1.0], seed=0, epoch=0)
    micro_batches = sd.data.training_data.rank_batches(order, 0, 2, 2)  # rank 0, batch 2
    sample = int(micro_batches[(NAN_STEP - 1) * 2][0])  # accumulation 2: its first micro-batch
    shard = Path(entry["latents"]) / f"{sample // 16:05d}.npy"  # the factory's shards of 16 (keys in order)
    array = np.load(shard)
    array[sample % 16] = np.nan
    np.save(shard, array)
    return entry


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per sharding: TOTAL steps straight, and HALF + resume + HALF (validation at HALF and TOTAL in
    both); for fsdp also its HALF checkpoint resumed with ``sharding: none`` (zero1's checkpoint is
    DDP's, bit for bit: test_sharded_losses_and_weights_equal_ddp_to_float_tolerance). A NaN sample
    makes step NAN_STEP non-finite in every run. Two launches: the runs from scratch, then the resumes
    (in fresh processes, as a re-run of the command would be)."""
    root = tmp_path_factory.mktemp("sharding")
    data = dataset_with_a_nan_sample(root / "data")
    found = {name: root / name for name in ("none", *SHARDED, *(f"{s}_split" for s in SHARDED), "fsdp_then_none",
                                            "fsdp_each")}
    torchrun_runs(run(root, data, "none", "none"), *(run(root, data, s, s) for s in SHARDED),
                  *(run(root, data, s, f"{s}_split", "--stop_at_step", HALF) for s in SHARDED),
                  run(root, data, "fsdp", "fsdp_each", "--fsdp_reduce_each_micro_batch"))
    shutil.copytree(found["fsdp_split"], found["fsdp_then_none"])
    torchrun_runs(*(run(root, data, s, f"{s}_split") for s in reversed(SHARDED)),
                  run(root, data, "none", "fsdp_then_none"))
    return found


def same_losses(a: list[float], b: list[float], rel: float = 0.0) -> bool:
    """Equal (or within ``rel``) step by step, the non-finite step's NaN included."""
    return np.allclose(a, b, rtol=rel, atol=0.0, equal_nan=True)


def val_losses(run_dir: Path) -> list[float]:
    """The validation losses of the live and the EMA weights, in step order."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[name] for r in records if "val_loss" in r for name in ("val_loss", "val_loss_ema")]


def assert_close(a: dict, b: dict, atol: float):
    assert a.keys() == b.keys()
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())
    assert worst <= atol, worst


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDED)
def test_sharded_losses_and_weights_equal_ddp_to_float_tolerance(runs, sharding):
    reference = losses(runs["none"])
    assert len(reference) == TOTAL and len(set(reference)) == TOTAL  # every step logged, and they differ
    assert same_losses(losses(runs[sharding]), reference, rel=1e-5)
    assert val_losses(runs[sharding]) == pytest.approx(val_losses(runs["none"]), rel=1e-5)
    assert len(val_losses(runs[sharding])) == 4  # validation of the live and EMA weights at HALF and TOTAL
    # Weights, EMA, AdamW moments and step counts: whole tensors under the same names as DDP's.
    ours, theirs = final_state(runs[sharding], TOTAL), final_state(runs["none"], TOTAL)
    assert_close(ours, theirs, atol=1e-5)
    if sharding == "zero1":  # the same arithmetic in the same order: DDP's state, bit for bit, resumed too
        assert_bitwise_equal(ours, theirs)
        assert_bitwise_equal(final_state(runs["zero1_split"], TOTAL), theirs)


@pytest.mark.slow
def test_fsdp_reducing_each_micro_batch_trains_as_ddp_to_float_tolerance(runs):
    """fsdp_reduce_each_micro_batch: the accumulated gradients are sums of reduce-scattered halves, the same
    arithmetic in another order."""
    assert same_losses(losses(runs["fsdp_each"]), losses(runs["none"]), rel=1e-5)
    assert_close(final_state(runs["fsdp_each"], TOTAL), final_state(runs["none"], TOTAL), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDED)
def test_a_sharded_run_resumes_bit_for_bit(runs, sharding):
    """HALF steps, a stop, and HALF more end with the weights, EMA, AdamW state, RNGs and losses of the
    run that went straight through."""
    straight, split = runs[sharding], runs[f"{sharding}_split"]
    assert [p.name for p in (split / "checkpoints").iterdir()] == [sd.run_folder.step_dir_name(HALF), sd.run_folder.step_dir_name(TOTAL)]
    at_end = final_state(split, TOTAL)
    assert_bitwise_equal(at_end, final_state(straight, TOTAL))
    assert same_losses(losses(split), losses(straight))
    assert val_losses(split) == val_losses(straight)
    at_half = final_state(split, HALF)
    changed = [k for k in at_half if not torch.equal(at_half[k], at_end[k])]
    assert len(changed) > len(at_half) // 2  # the resumed half trained


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDED)
def test_a_sharded_checkpoint_resumes_unsharded_and_exports_the_same_keys(runs, sharding, tmp_path):
    # Resumed with sharding none (DDP) at HALF: it goes on as the sharded run did, to float tolerance.
    if sharding == "fsdp":  # zero1's checkpoints are DDP's, bit for bit
        then_none = runs[f"{sharding}_then_none"]
        assert same_losses(losses(then_none), losses(runs[sharding]), rel=1e-5)
        assert losses(then_none)[:HALF] == losses(runs[sharding])[:HALF]  # the sharded half, as written then
        assert_close(final_state(then_none, TOTAL), final_state(runs[sharding], TOTAL), atol=1e-5)
    # Every file of the checkpoint has the layout an unsharded run writes.
    ours, theirs = (run / "checkpoints" / sd.run_folder.step_dir_name(TOTAL) for run in (runs[sharding], runs["none"]))
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for name in ("unet.safetensors", "ema.safetensors"):
        assert list(load_file(ours / name)) == list(load_file(theirs / name))
    mine, other = (torch.load(folder / "optimizer.pt", weights_only=True) for folder in (ours, theirs))
    assert mine["param_groups"] == other["param_groups"]
    assert list(mine["state"]) == list(other["state"]) == list(range(len(mine["state"])))
    # The exporters read it: a single file with the same keys and (nearly) the same tensors.
    exported = [sd.formats.single_file_state_dict(p.unet, p.vae, p.text_encoder)
                for p in (sd.formats.load_pipeline(str(folder)) for folder in (ours, theirs))]
    assert_close(exported[0], exported[1], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", *SHARDED])
def test_a_non_finite_sample_skips_its_step_on_both_ranks(runs, sharding):
    """The skipped update leaves weights, EMA and AdamW state alone on every rank (its step count too)."""
    records = [json.loads(line) for line in (runs[sharding] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["skipped"]] == [NAN_STEP]
    assert [r["step"] for r in records if not np.isfinite(r["loss"])] == [NAN_STEP]
    state = final_state(runs[sharding], TOTAL)
    assert all(torch.isfinite(v).all() for k, v in state.items() if k.startswith(("unet.", "ema.", "opt.")))
    counts = {v.item() for k, v in state.items() if k.endswith(".step")}
    assert counts == {TOTAL - 1}  # the skipped step is not counted by AdamW


def test_a_single_process_ignores_sharding(tmp_path, dataset_16):
    """One rank has nothing to split: the run is the unsharded one."""
    config = TrainConfig(**{**BASE, "datasets": [dataset_16], "out_dir": str(tmp_path / "run"), "sharding": "zero1"})
    config.validate()
    run = SD_Train.build(config, Dist.single())
    assert run.step.sharding == "none" and isinstance(run.step.optimizer, torch.optim.AdamW)
    assert list(sd.train.recovery.resumable(run)) == ["unet", "frozen_parts", "ema", "optimizer", "scaler",
                                                      "train_state", "rng"]
