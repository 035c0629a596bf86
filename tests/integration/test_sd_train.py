"""SD_Train.py on the tiny presets: 2-rank gloo runs under torchrun, and in-process pieces."""

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

import sd.data.prefetch
import sd.data.training_data
import sd.distributed
import sd.model
import sd.run_folder
import sd.train.recovery
import sd.train.config
import sd.train.config_loading
import sd.train.ema
import sd.train.step
import sd.sampling
import sd.train.validation
import SD_Train
from sd.distributed import Dist

from data_factory import BASE, assert_bitwise_equal, make_captions, make_dataset, make_latents
from margins import at_most

ROOT = Path(__file__).resolve().parents[2]

# 64 training samples, 2 ranks x batch 2 x accumulation 2: 8 optimizer steps per epoch.
TOTAL = 12  # 2N
HALF = 6  # N: mid-epoch (epoch 0 has 8 steps)


def write_config(path: Path, **fields) -> Path:
    path.write_text(yaml.safe_dump({**BASE, **fields}))
    return path


def torchrun(config: Path, *flags, env=None, nproc=2, check=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "SD_Train.py"), "--config", str(config), *map(str, flags)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})},
                            timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(f"torchrun failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def torchrun_runs(*runs: list[str] | dict, env=None) -> subprocess.CompletedProcess:
    """The runs (each an SD_Train.py command line, or a dict tests/train_runs.py reads) one after another in
    one 2-rank torchrun launch (tests/train_runs.py): one start-up, most of a tiny run's time, for all of
    them. Returns the launch's result (the runs' logs in its stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "tests.train_runs", json.dumps(runs)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})},
                            timeout=900)
    if result.returncode != 0:
        raise AssertionError(f"torchrun failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return [r["loss"] for r in records]


def final_state(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    folder = run_dir / "checkpoints" / sd.run_folder.step_dir_name(step)
    assert (folder / "COMPLETE").exists()
    tensors = {f"unet.{k}": v for k, v in load_file(folder / "unet.safetensors").items()}
    tensors.update({f"ema.{k}": v for k, v in load_file(folder / "ema.safetensors").items()})
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    for index, state in optimizer["state"].items():
        for name, value in state.items():
            tensors[f"opt.{index}.{name}"] = value
    for rank_file in sorted(folder.glob("rng_rank*.pt")):  # every RNG of every rank, global ones included
        rng = torch.load(rank_file, weights_only=True)["rng"]
        tensors.update({f"{rank_file.stem}.{name}": rng[name] for name in ("torch", "noise")})
        tensors[f"{rank_file.stem}.numpy"] = rng["numpy"][1]
        tensors[f"{rank_file.stem}.python"] = torch.tensor(rng["python"][1])
    return tensors


@pytest.fixture(scope="module")
def data(dataset_64):
    return dataset_64


def dataset_with_a_nan_sample(root: Path) -> dict:
    """64 training samples, train index 5 all NaN."""
    entry = make_dataset(root, n_train=64, n_val=0)
    shard = Path(entry["latents"]) / "00000.npy"
    array = np.load(shard)
    array[5] = np.nan
    np.save(shard, array)
    return entry


# The run whose validation fails on one rank (test_a_failure_inside_one_ranks_validation_...): rank 1's share
# of the validation loss at step 2, rank 0's share of the grid at step 4.
VALIDATION_FAULTS = "fail_validation_loss:1,fail_grid:0"


@pytest.fixture(scope="module")
def from_scratch(tmp_path_factory, data):
    """The 2-rank runs that start from nothing, in one launch: the uninterrupted reference ``a`` (2N
    steps, with validation grids along the way), a run on a dataset with a NaN sample (8 steps), the
    interrupted run ``b``'s first part (the reference's command stopped by ``--stop_at_step 2``; its
    resumes run in launches of their own, as re-runs of the command), and last a run whose validation
    fails on one rank (4 steps, VALIDATION_FAULTS armed for it alone); with the launch's stderr."""
    root = tmp_path_factory.mktemp("from_scratch")
    a = write_config(root / "a.yaml", datasets=[data], max_steps=TOTAL, out_dir=str(root / "run_a"),
                     validate_every=5)
    nan = write_config(root / "n.yaml", datasets=[dataset_with_a_nan_sample(root / "nan_data")], max_steps=8,
                       out_dir=str(root / "run_nan"))
    b = write_config(root / "b.yaml", datasets=[data], max_steps=TOTAL, out_dir=str(root / "run_b"),
                     validate_every=5, save_steps=4)  # save_steps may change freely: here it never does
    failing = write_config(root / "c.yaml", datasets=[data], max_steps=4, validate_every=2, save_steps=4,
                           out_dir=str(root / "run_c"), batch_size=2, grad_accum=1, validation_samples=8)
    result = torchrun_runs(["--config", str(a)], ["--config", str(nan)], ["--config", str(b), "--stop_at_step", "2"],
                           {"argv": ["--config", str(failing)], "fault": VALIDATION_FAULTS})
    return {"a": (root / "run_a", a), "nan": root / "run_nan", "b": (root / "run_b", b),
            "failing": root / "run_c", "stderr": result.stderr}


@pytest.fixture(scope="module")
def run_a(from_scratch):
    """The uninterrupted reference: 2N steps on 2 ranks, with validation grids along the way."""
    return from_scratch["a"]


# ------------------------------------------------------------------------------ distributed runs


@pytest.mark.slow
def test_two_ranks_end_with_identical_weights_and_a_full_run_folder(run_a):
    run_dir, _ = run_a
    folder = run_dir / "checkpoints" / sd.run_folder.step_dir_name(TOTAL)
    rank0 = torch.load(folder / "rng_rank0.pt", weights_only=True)
    rank1 = torch.load(folder / "rng_rank1.pt", weights_only=True)
    assert torch.equal(rank0["fingerprint"], rank1["fingerprint"])
    assert len(rank0["fingerprint"]) == len(load_file(folder / "unet.safetensors"))
    # Different ranks draw different noise: their generators are not copies of each other.
    assert not torch.equal(rank0["rng"]["noise"], rank1["rng"]["noise"])
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["max_steps"] == TOTAL
    assert yaml.safe_load((folder / "config.yaml").read_text())["batch_size"] == 2
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == TOTAL and {"loss", "lr", "grad_norm", "loss_by_quartile", "images_per_s"} <= set(records[0])
    validated = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in validated] == [5, 10, TOTAL]  # every validate_every steps, and the last
    assert all(math.isfinite(r["val_loss"]) and math.isfinite(r["val_loss_ema"]) for r in validated)
    assert validated[0]["val_loss"] != validated[0]["val_loss_ema"]  # the EMA is not the live model
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == [f"step_{s:08d}.png" for s in (5, 10, TOTAL)]
    assert (run_dir / "loss.png").stat().st_size > 1000


@pytest.mark.slow
def test_lr_follows_warmup_and_cosine_over_the_true_step_count(run_a):
    run_dir, _ = run_a
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, TOTAL + 1))  # every step logged: none can pass unchecked
    peak, warmup, floor = 1e-3, 2, 1e-5
    for step, record in enumerate(records):  # record i is optimizer step i (0-based)
        if step < warmup:
            expected = peak * (0.01 + 0.99 * step / warmup)
        else:
            expected = floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (TOTAL - warmup)))
        assert record["lr"] == pytest.approx(expected, rel=1e-9), step


@pytest.mark.slow
def test_stop_at_step_sigkill_while_saving_and_sigterm_then_resume_is_bitwise_identical(from_scratch):
    """One run of 2 ranks interrupted three ways in turn, each resumed by the same command, ends bit for
    bit where the uninterrupted run does: ``--stop_at_step`` mid-epoch (``from_scratch``'s run b); SIGKILL
    while a checkpoint is written (the previous one resumes); SIGTERM to torchrun (a preemption) in the
    next epoch."""
    run_dir_a, _ = from_scratch["a"]
    run_dir, config = from_scratch["b"]
    checkpoints = run_dir / "checkpoints"
    state = torch.load(checkpoints / sd.run_folder.step_dir_name(2) / "train_state.pt", weights_only=True)
    assert (state["step"], state["epoch"], state["position"]) == (2, 0, 4)  # mid-epoch
    assert [p.name for p in checkpoints.iterdir()] == [sd.run_folder.step_dir_name(2)]
    at_two = final_state(run_dir, 2)

    result = torchrun(config, env={"SD_FAULT": "after_unet:8"}, check=False)  # killed while writing step 8
    assert result.returncode != 0
    partial = checkpoints / ".tmp_step_00000008"
    assert (partial / "unet.safetensors").exists() and not (partial / "COMPLETE").exists()
    assert not (checkpoints / "step_00000008").exists()
    previous = sd.run_folder.latest_checkpoint(checkpoints)
    assert previous.name == "step_00000004"
    for name in ("optimizer.pt", "train_state.pt", "rng_rank0.pt", "rng_rank1.pt"):
        torch.load(previous / name, weights_only=True)
    assert len(load_file(previous / "ema.safetensors")) > 0

    # The launcher gets SIGTERM after step 9; torchrun forwards it to both ranks.
    result = torchrun(config, env={"SD_FAULT": "sigterm_parent:9"}, check=False)
    assert result.returncode != 0 and "stopped by signal 15" in result.stderr
    assert not partial.exists()
    state = torch.load(sd.run_folder.latest_checkpoint(checkpoints) / "train_state.pt", weights_only=True)
    assert 9 <= state["step"] < TOTAL and state["epoch"] == 1 and state["position"] != 0  # saved mid-epoch

    torchrun(config)
    resumed = final_state(run_dir, TOTAL)
    assert_bitwise_equal(resumed, final_state(run_dir_a, TOTAL))
    assert losses(run_dir) == losses(run_dir_a)
    changed = [k for k in at_two if not torch.equal(at_two[k], resumed[k])]
    assert len(changed) > len(at_two) // 2  # the resumed runs really trained


@pytest.mark.slow
def test_a_nan_sample_skips_its_steps_on_both_ranks(from_scratch):
    run_dir = from_scratch["nan"]  # train index 5 is NaN
    # Which optimizer steps hold the poisoned sample (train index 5), on either rank.
    order = sd.data.training_data.epoch_order([64], [1.0], seed=0, epoch=0)
    per_rank = [sd.data.training_data.rank_batches(order, r, 2, 2) for r in range(2)]
    expected = sorted({i // 2 + 1 for r in range(2) for i, b in enumerate(per_rank[r]) if 5 in b.tolist()})
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["skipped"]] == expected
    assert records[-1]["bad_steps"] == len(expected)
    # Skipped steps still count: the learning rate of every step is the schedule's for its step number.
    for record in records:
        assert record["lr"] == pytest.approx(sd.train.step.lr_at(record["step"] - 1, 1e-3, 2, 8, 0.01), rel=1e-12)
    folder = run_dir / "checkpoints" / sd.run_folder.step_dir_name(8)
    fingerprints = [torch.load(folder / f"rng_rank{r}.pt", weights_only=True)["fingerprint"] for r in range(2)]
    assert torch.equal(*fingerprints) and torch.isfinite(fingerprints[0]).all()
    assert all(torch.isfinite(t).all() for t in load_file(folder / "ema.safetensors").values())


# ------------------------------------------------------------------------------ in-process pieces


def make_run(tmp_path, data, **fields):
    config = sd.train.config.TrainConfig(**{**BASE, "datasets": [data], "out_dir": str(tmp_path / "run"), **fields})
    config.validate()
    return SD_Train.build(config, Dist.single())


def snapshot(step):
    return {
        "unet": {k: v.clone() for k, v in step.unet.state_dict().items()},
        "ema": [s.clone() for s in step.ema.shadow],
        "opt": {(i, k): torch.as_tensor(v).clone() for i, st in step.optimizer.state_dict()["state"].items()
                for k, v in st.items()},
        "groups": repr([{k: v for k, v in g.items() if k != "params"} for g in step.optimizer.param_groups]),
    }


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, lr", [("adamw", 1e-3), ("prodigy", 1.0), ("adamw_schedulefree", 1e-3)])
def test_non_finite_loss_updates_nothing(tmp_path, data, optimizer, lr):
    """Fused AdamW skips on the device; Prodigy and Schedule-Free read the flag on the host: either way the
    weights, the EMA and the optimizer (its state, and its groups' step counts and estimates) stay as they were."""
    run = make_run(tmp_path, data, grad_accum=1, batch_size=4, optimizer=optimizer, lr=lr)
    assert sd.train.step.skips_on_device(run.step.optimizer) == (optimizer == "adamw")
    good = [run.train_data.batch(np.arange(4))]
    assert not sd.train.step.train_step(run.step, good, 0)["bad"]
    before = snapshot(run.step)
    latents, ids = run.train_data.batch(np.arange(4, 8))
    latents[1, 0, 0, 0] = float("nan")
    result = sd.train.step.train_step(run.step, [(latents, ids)], 1)
    assert result["bad"] and not math.isfinite(result["loss"])
    after = snapshot(run.step)
    assert all(torch.equal(before["unet"][k], after["unet"][k]) for k in before["unet"])
    assert all(torch.equal(a, b) for a, b in zip(before["ema"], after["ema"]))
    assert before["opt"].keys() == after["opt"].keys()
    assert all(torch.equal(before["opt"][k], after["opt"][k]) for k in before["opt"])
    assert before["groups"] == after["groups"]
    assert not sd.train.step.train_step(run.step, good, 2)["bad"]
    assert snapshot(run.step)["groups"] != after["groups"] or optimizer == "adamw"  # Prodigy's d, Schedule-Free's k
    assert any(not torch.equal(before["unet"][k], v) for k, v in run.step.unet.state_dict().items())


def unet_output_dtypes(step) -> list[torch.dtype]:
    """The dtype of every UNet forward's output from now on (what autocast really ran in)."""
    seen = []
    step.unet.register_forward_hook(lambda module, args, output: seen.append(output.sample.dtype))
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_reduced_precision_steps_run_in_that_dtype_and_keep_fp32_master_weights(tmp_path, data, precision, dtype):
    run = make_run(tmp_path, data, precision=precision, grad_accum=1, batch_size=2)
    outputs = unet_output_dtypes(run.step)
    before = snapshot(run.step)
    results = [sd.train.step.train_step(run.step, [run.train_data.batch(np.arange(2 * i, 2 * i + 2))], i)
               for i in range(2)]
    assert outputs == [dtype] * 2  # every forward ran under autocast in the reduced dtype
    assert all(math.isfinite(r["loss"]) and not r["bad"] and not r["overflow"] for r in results)
    # Gradients are unscaled before clipping: the norm is the true one, not 65536 times it.
    assert all(0 < r["grad_norm"] < 100 for r in results), [r["grad_norm"] for r in results]
    after = run.step.unet.state_dict()
    assert sum(not torch.equal(before["unet"][k], v) for k, v in after.items()) > len(after) // 2
    assert {p.dtype for p in run.step.unet.parameters()} == {torch.float32}
    assert {s.dtype for s in run.step.ema.shadow} == {torch.float32}
    optimizer_state = run.step.optimizer.state_dict()["state"]
    assert {v.dtype for st in optimizer_state.values() for k, v in st.items() if k != "step"} == {torch.float32}
    scaler = run.step.scaler
    assert scaler.is_enabled() == (precision == "fp16")
    if precision == "fp16":
        scale = scaler.get_scale()
        assert math.isfinite(scale) and scale >= 1 and math.log2(scale).is_integer(), scale
    # The same steps in fp32 give close but not identical losses: the reduced dtype is real. (Step 0's
    # are equal: the from-scratch UNet's zeroed output layer predicts exact zeros in any dtype.)
    reference = make_run(tmp_path / "fp32", data, grad_accum=1, batch_size=2)
    fp32 = [sd.train.step.train_step(reference.step, [reference.train_data.batch(np.arange(2 * i, 2 * i + 2))], i)
            for i in range(2)]
    assert results[1]["loss"] != fp32[1]["loss"]
    assert results[1]["loss"] == pytest.approx(fp32[1]["loss"], rel=2e-2)


def started(run):
    """``run`` with its RNGs set as the training loop sets them before its first step (a resume's restored)."""
    run.rng.start(run.config.seed, 0)
    return run


def losses_of_steps(run, steps, first: int = 0) -> list[float]:
    """``steps`` optimizer steps of two micro-batches of 2, each step's samples fixed by its index."""
    out = []
    for i in range(first, first + steps):
        batches = [run.train_data.batch(np.arange(4 * i + 2 * j, 4 * i + 2 * j + 2)) for j in range(2)]
        out.append(sd.train.step.train_step(run.step, batches, i))
        run.state.step = i + 1
    return [r["loss"] for r in sd.train.step.read_results(out)]


@pytest.mark.slow
def test_bf16_weights_train_bf16_parameters_from_fp32_masters_and_resume_bit_for_bit(tmp_path, data):
    """bf16_weights: the UNet's parameters are bf16 (no autocast casts), AdamW and the EMA keep fp32 masters, the
    steps' losses stay within 2% of today's fp32 weights under autocast, the weight files hold the masters,
    and a resume goes on bit for bit; the up blocks in a parameter group of their own."""
    fields = dict(precision="bf16", grad_accum=2, batch_size=2, bf16_weights=True, save_steps=2, up_lr_scale=2.0)
    run = started(make_run(tmp_path / "a", data, **fields))
    assert len(run.step.optimizer.param_groups) == 4
    masters = [run.step.optimizer.master_weights.master_of(p) for p in run.step.unet.parameters()]  # in model order
    assert {p.dtype for p in run.step.unet.parameters()} == {torch.bfloat16}
    assert {p.dtype for group in run.step.optimizer.param_groups for p in group["params"]} == {torch.float32}
    straight = losses_of_steps(run, 4)
    reference = started(make_run(tmp_path / "fp32", data, **{**fields, "bf16_weights": False}))
    autocast = losses_of_steps(reference, 4)
    assert straight[1:] != autocast[1:]  # the weights really are bf16 ...
    assert straight == pytest.approx(autocast, rel=2e-2)  # ... and train as the fp32 ones do
    for p, master in zip(run.step.unet.parameters(), masters):  # each parameter is its master rounded
        assert torch.equal(p.detach(), master.detach().to(torch.bfloat16))
    assert any(not torch.equal(m.detach().to(torch.bfloat16).float(), m.detach()) for m in masters)  # fp32 bits
    ema_gap = max((s - m.detach()).abs().max().item() for s, m in zip(run.step.ema.shadow, masters))
    assert ema_gap < 1e-2  # the EMA averages the masters (warm-up: it follows them closely at first)

    split = started(make_run(tmp_path / "b", data, **fields))
    losses_of_steps(split, 2)
    sd.train.recovery.save(split)
    saved = load_file(str(tmp_path / "b" / "run" / "checkpoints" / "step_00000002" / "unet.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert all(torch.equal(saved[name], split.step.optimizer.master_weights.master_of(p).detach())
               for name, p in split.step.unet.named_parameters())
    resumed = started(make_run(tmp_path / "b", data, **fields))  # make_run resumes, as SD_Train.build does
    assert resumed.state.step == 2
    assert losses_of_steps(resumed, 2, first=2) == straight[2:]
    for a, b in zip((resumed.step.optimizer.master_weights.master_of(p) for p in resumed.step.unet.parameters()),
                    masters):
        assert torch.equal(a, b)
    assert_bitwise_equal({i: t for i, t in enumerate(resumed.step.ema.shadow)},
                         {i: t for i, t in enumerate(run.step.ema.shadow)})
    assert snapshot(resumed.step)["opt"].keys() == snapshot(run.step)["opt"].keys()
    assert all(torch.equal(a, b) for a, b in zip(snapshot(resumed.step)["opt"].values(),
                                                 snapshot(run.step)["opt"].values()))


@pytest.mark.parametrize("fields", [
    pytest.param(dict(loss_type="huber"), id="huber", marks=pytest.mark.slow),
    pytest.param(dict(loss_type="smooth_l1", huber_schedule="exponential"), id="smooth_l1", marks=pytest.mark.slow),
    pytest.param(dict(loss_type="l1", debiased_estimation=True), id="l1", marks=pytest.mark.slow)])
def test_each_loss_option_trains_and_its_loss_is_the_step_s(tmp_path, data, fields):
    """The option reaches the step (its formulas: tests/unit/test_losses.py): on the same draws as an l2 run's
    (same seed, same batches, the same weights at step 0), the first step's logged loss differs, and the
    losses stay finite."""
    common = dict(precision="fp32", grad_accum=2, batch_size=2)
    ours, l2 = (make_run(tmp_path / name, data, **common, **extra) for name, extra in (("ours", fields), ("l2", {})))
    losses = losses_of_steps(started(ours), 2)
    reference = losses_of_steps(started(l2), 2)  # from the same RNG states
    assert all(math.isfinite(x) for x in losses) and losses[0] != reference[0]


def test_each_unet_block_takes_its_first_update_at_its_own_learning_rate(tmp_path, data):
    """On the same weights and draws as a run at one learning rate, the first AdamW update of each block scales
    with its block's multiplier (the update is lr x m / sqrt(v), plus lr x weight decay): the down blocks' by
    0.1, the up blocks' by 3; the middle block (a group of its own at scale 1) and the rest of the UNet move
    exactly as before."""
    common = dict(precision="fp32", grad_accum=1, batch_size=4, lr=1e-3, warmup_steps=0)
    ours, one = (make_run(tmp_path / name, data, **common, **extra)
                 for name, extra in (("ours", dict(down_lr_scale=0.1, up_lr_scale=3.0)), ("one", {})))
    assert [g["name"] for g in ours.step.optimizer.param_groups] == ["unet", "unet_down", "unet_mid", "unet_up"]
    for run in (ours, one):  # the same weights, none of them zero (a zero output layer stops every gradient)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in run.step.unet.parameters():
                p.add_(torch.randn(p.shape, generator=generator), alpha=0.05)
    before = {k: v.detach().clone() for k, v in one.step.unet.named_parameters()}
    for run in (ours, one):
        started(run)  # each run's step from the same RNG states
        sd.train.step.read_results([sd.train.step.train_step(run.step, [run.train_data.batch(np.arange(4))], 0)])
    moved = {name: {k: (p.detach() - before[k]) for k, p in run.step.unet.named_parameters()}
             for name, run in (("ours", ours), ("one", one))}
    for block, scale in (("down_blocks", 0.1), ("up_blocks", 3.0)):
        keys = [k for k in before if k.startswith(block + ".")]
        ratio = (torch.cat([moved["ours"][k].flatten() for k in keys]).norm()
                 / torch.cat([moved["one"][k].flatten() for k in keys]).norm()).item()
        assert ratio == pytest.approx(scale, rel=1e-3), block
    same = [k for k in before if not k.startswith(("down_blocks.", "up_blocks."))]
    assert same and all(torch.equal(moved["ours"][k], moved["one"][k]) for k in same)
    assert all(moved["one"][k].abs().max() > 0 for k in same if k.startswith("mid_block."))


def ema_replay(initial, live_after_each_step, decay, every):
    """The EMA recursion by hand: shadow += (1 - d^every) * (live - shadow) on every every-th step."""
    shadow = [t.double() for t in initial]
    for step, live in enumerate(live_after_each_step):
        if (step + 1) % every == 0:
            d = sd.train.ema.ema_decay_at(step, decay) ** every
            shadow = [s + (1 - d) * (p.double() - s) for s, p in zip(shadow, live)]
    return shadow


@pytest.mark.slow
@pytest.mark.parametrize("every", [1, 2])
def test_cpu_ema_follows_the_hand_computed_recursion(tmp_path, data, every):
    # decay 0.2: the warm-up (1 + t) / (10 + t) is below it at steps 0-1 and above it from step 2.
    run = make_run(tmp_path, data, ema_device="cpu", ema_decay=0.2, ema_update_every=every, grad_accum=1,
                   batch_size=4)
    ema = run.step.ema
    assert ema.update_every == every
    initial = [p.detach().clone() for p in run.step.unet.parameters()]
    assert all(s.device.type == "cpu" and s.dtype == torch.float32 for s in ema.shadow)
    assert all(s.data_ptr() != p.data_ptr() for s, p in zip(ema.shadow, run.step.unet.parameters()))
    live, shadows = [], []
    for i in range(4):
        sd.train.step.train_step(run.step, [run.train_data.batch(np.arange(4 * i, 4 * i + 4))], i)
        live.append([p.detach().clone() for p in run.step.unet.parameters()])
        shadows.append([s.clone() for s in ema.shadow])
    if every == 2:  # step 0 (and 2) leave the shadow alone
        assert all(torch.equal(s, p) for s, p in zip(shadows[0], initial))
        assert all(torch.equal(a, b) for a, b in zip(shadows[2], shadows[1]))
    for n in range(1, 5):
        expected = ema_replay(initial, live[:n], 0.2, every)
        worst = max((s.double() - e).abs().max().item() for s, e in zip(shadows[n - 1], expected))
        assert worst < 1e-6, (n, worst)
    # The shadow is neither the live weights nor the start: it really averages.
    assert any(not torch.allclose(s, p, atol=1e-6) for s, p in zip(ema.shadow, live[-1]))
    assert any(not torch.allclose(s, p, atol=1e-6) for s, p in zip(ema.shadow, initial))


def train_steps(run, steps: int) -> list[list[torch.Tensor]]:
    """``steps`` optimizer steps as the loop takes them (step index = train state step); live weights after each."""
    live, size = [], run.config.batch_size
    for _ in range(steps):
        i = run.state.step
        sd.train.step.train_step(run.step, [run.train_data.batch(np.arange(size * i, size * i + size))], i)
        run.state.step += 1
        live.append([p.detach().clone() for p in run.step.unet.parameters()])
    return live


@pytest.mark.slow  # over 7 s on a 2-core CPU: out of make check
def test_an_inherited_ema_keeps_its_weight_across_phases_and_a_resume(tmp_path, data):
    small = dict(grad_accum=1, batch_size=2, ema_decay=0.9)
    previous = make_run(tmp_path / "p1", data, **small)
    assert previous.config.ema.warmup == "restart" and previous.step.ema.warmup  # a fresh EMA warms up
    train_steps(previous, 1)
    sd.train.recovery.save(previous)
    inherited = [s.clone() for s in previous.step.ema.shadow]
    assert any(not torch.equal(s, p) for s, p in zip(inherited, previous.step.unet.parameters()))

    run = make_run(tmp_path / "p2", data, **small, init_from=str(previous.run_dir))
    assert run.config.ema.warmup == "off" and not run.step.ema.warmup
    assert all(torch.equal(s, e) for s, e in zip(run.step.ema.shadow, inherited))
    live = train_steps(run, 3)
    # Constant decay d from the inherited EMA E0: E_k = d^k E0 + sum_i (1 - d) d^(k - i) w_i.
    k, d = 3, 0.9
    worst = 0.0
    for j, (e0, shadow) in enumerate(zip(inherited, run.step.ema.shadow)):
        expected = d**k * e0.double() + sum((1 - d) * d ** (k - i) * w[j].double() for i, w in enumerate(live, 1))
        worst = max(worst, (shadow.double() - expected).abs().max().item())
    assert worst < 1e-6
    # The restarted warm-up (decays 0.1, 0.18, 0.25) would have left E0 a weight of 0.0045, not 0.729.
    restarted = ema_replay(inherited, live, d, 1)
    assert max((r - s.double()).abs().max().item() for r, s in zip(restarted, run.step.ema.shadow)) > 1e-3

    sd.train.recovery.save(run)  # a resume keeps the recorded choice, whatever init_from says now
    resumed = make_run(tmp_path / "p2", data, **small)
    assert resumed.config.ema.warmup == "off" and not resumed.step.ema.warmup
    # What auto becomes for a new phase: off when init_from brought an EMA of ours, else restart.
    fresh = dataclasses.replace(resumed.config, ema_warmup="auto")
    assert sd.train.recovery.ema_warmup_of(fresh, None, inherited=True) == "off"
    assert sd.train.recovery.ema_warmup_of(fresh, None, inherited=False) == "restart"
    assert sd.train.recovery.ema_warmup_of(dataclasses.replace(fresh, ema_warmup="restart"), None, inherited=True) == "restart"


def recorded_batches(monkeypatch) -> list:
    """The latents of every micro-batch the loop hands to train_step, which here only records them."""
    seen = []

    def record(step, micro_batches, step_index, stop_requested=False):
        seen.append([latents.clone() for latents, _ in micro_batches])
        return {"loss": 1.0, "grad_norm": 1.0, "bad": False, "overflow": False, "stop": False,
                "loss_quartiles": [None] * 4, "measured": {}}

    monkeypatch.setattr(sd.train.step, "train_step", record)
    return seen


def test_flip_mirrors_about_half_the_samples_and_a_resume_flips_the_same_ones(tmp_path, monkeypatch):
    data = make_dataset(tmp_path / "data", n_train=16, n_val=0, flip=True)
    config = write_config(tmp_path / "f.yaml", datasets=[data], max_steps=6, batch_size=2, grad_accum=2, flip=True,
                          ema_decay=0.0, out_dir=str(tmp_path / "run"))
    seen = recorded_batches(monkeypatch)
    assert SD_Train.main(["--config", str(config), "--stop_at_step", "3"]) == 0  # mid-epoch (4 steps per epoch)
    assert SD_Train.main(["--config", str(config)]) == 0  # resumes at step 3
    assert len(seen) == 6 and all(len(micro) == 2 for micro in seen)
    # On one rank the micro-batches are the epoch order in slices; each sample comes from its latents
    # or their mirror image as the coin of its (seed, epoch, position) says, across the resume too.
    store = sd.data.training_data.LatentStore(data["latents"], flip=True)
    expected, flipped = [], 0
    for epoch in (0, 1):
        rows = [store.row_of[f"s{i:05d}"] for i in sd.data.training_data.epoch_order([16], [1.0], 0, epoch)]
        coins = sd.data.training_data.flip_coins(0, epoch, 16)
        expected.append(np.where(coins[:, None, None, None], store.flipped[0][rows], store.arrays[0][rows]))
        flipped += coins.sum()
    expected = np.concatenate(expected)[: 6 * 4]
    assert np.array_equal(torch.cat([torch.cat(micro) for micro in seen]).numpy(), expected)
    assert 10 <= flipped <= 22  # of 32


def test_max_bad_steps_saves_and_stops_naming_the_step(tmp_path, caplog):
    entry = make_dataset(tmp_path / "data", n_train=16, n_val=0)
    for shard in Path(entry["latents"]).glob("*.npy"):
        np.save(shard, np.full(np.load(shard).shape, np.nan, dtype=np.float16))
    config = write_config(tmp_path / "bad.yaml", datasets=[entry], max_steps=8, max_bad_steps=3,
                          out_dir=str(tmp_path / "run"), batch_size=4, grad_accum=1)
    code = SD_Train.main(["--config", str(config)])
    assert code == 3
    assert "step 3: 3 non-finite steps in a row" in caplog.text
    folder = tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(3)
    initial = sd.model.build_unet("tiny", seed=0).state_dict()
    saved = load_file(folder / "unet.safetensors")
    assert all(torch.equal(saved[k], initial[k]) for k in initial)


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGUSR1, signal.SIGTERM])
def test_a_stop_signal_while_the_run_is_built_stops_it_in_one_line_not_killed(tmp_path, data, capsys, monkeypatch,
                                                                              signum):
    """Before the loop (loading, class images) a scheduler's signal killed the process without a word; it now
    interrupts as Ctrl-C does, and the exit status is 128 + the signal."""
    import time

    real = sd.train.run.build

    def build(config, d):
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler runs here
        return real(config, d)

    monkeypatch.setattr(sd.train.run, "build", build)
    config = write_config(tmp_path / "c.yaml", datasets=[data], max_steps=2, out_dir=str(tmp_path / "run"))
    before = signal.getsignal(signum)
    assert SD_Train.main(["--config", str(config)]) == 128 + signum
    err = capsys.readouterr().err
    assert f"interrupted ({signal.Signals(signum).name}) outside a training step" in err and "Traceback" not in err
    assert signal.getsignal(signum) is before  # the handler before main is back


def test_a_failure_inside_validation_is_a_warning_and_costs_no_step(tmp_path, data, caplog, monkeypatch):
    """Validation at step 2 raises: the run logs it, saves at step 2 as due, goes on to step 4 and ends well."""
    def broken(run, record, stop=None):
        raise RuntimeError("the sampler fell over")

    monkeypatch.setattr(sd.train.validation, "validate", broken)
    config = write_config(tmp_path / "c.yaml", datasets=[data], max_steps=4, validate_every=2, save_steps=2,
                          out_dir=str(tmp_path / "run"), batch_size=2, grad_accum=1)
    with caplog.at_level("WARNING"):
        assert SD_Train.main(["--config", str(config)]) == 0
    assert "step 2: validation failed (RuntimeError: the sampler fell over)" in caplog.text
    assert "step 4: validation failed" in caplog.text
    for step in (2, 4):
        assert (tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(step) / "COMPLETE").exists()


@pytest.mark.slow
def test_a_failure_inside_one_ranks_validation_reaches_every_rank_and_the_run_goes_on(from_scratch):
    """2 ranks, validation at steps 2 and 4: rank 1's share of the validation loss fails at step 2, rank 0's
    share of the grid at step 4 (``from_scratch``'s last run). Once the other rank waited in the collective
    until the watchdog's timeout (30 minutes); now both leave at that collective, each warns (the failing
    rank with its error, the other naming it), and the run trains on to step 4 and saves. (The launch's
    other runs validate at steps 5 and 10 or not at all and arm no fault: none of these lines is theirs.)"""
    err, run_dir = from_scratch["stderr"], from_scratch["failing"]
    assert "step 2: validation failed (Injected: injected fault fail_validation_loss:1)" in err, err[-3000:]
    assert "step 2: validation failed (Failed: rank 1: Injected: injected fault fail_validation_loss:1)" in err
    assert "step 4: validation failed (Injected: injected fault fail_grid:0)" in err
    assert "step 4: validation failed (Failed: rank 0: Injected: injected fault fail_grid:0)" in err
    assert err.count("validation failed") == 4  # each rank once at each step, and no other run's
    assert (run_dir / "checkpoints" / sd.run_folder.step_dir_name(4) / "COMPLETE").exists()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]


@pytest.mark.slow
def test_epochs_size_the_schedule_from_real_optimizer_steps(tmp_path, data):
    # 1 rank, batch 4, accumulation 2: 64 samples -> 16 micro-batches -> 8 steps per epoch.
    config = write_config(tmp_path / "e.yaml", datasets=[data], epochs=2, out_dir=str(tmp_path / "run"),
                          batch_size=4, grad_accum=2, warmup_steps=3)
    assert SD_Train.main(["--config", str(config)]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 16 and records[-1]["epoch"] == 2
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    reference = torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=3),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=16 - 3, eta_min=1e-5),
    ], milestones=[3])
    for record in records:
        assert record["lr"] == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-6)
        reference.step()


@pytest.mark.slow
@pytest.mark.learned
def test_loss_falls_on_a_learnable_task(tmp_path, data):
    config = write_config(tmp_path / "toy.yaml", datasets=[data], max_steps=80, out_dir=str(tmp_path / "run"),
                          batch_size=16, grad_accum=1, lr=3e-3, warmup_steps=5, cfg_dropout=0.0, ema_decay=0.99)
    assert SD_Train.main(["--config", str(config)]) == 0
    values = losses(tmp_path / "run")
    first, last = np.mean(values[:10]), np.mean(values[-10:])
    at_most("loss of the last 10 steps / the first 10", last / first, 1 / 3, (first, last))


def test_cfg_dropout_replaces_the_embedding_at_the_configured_rate():
    hidden = torch.randn(20000, 77, 8)
    empty = torch.randn(1, 77, 8)
    out, drop = sd.train.step.apply_cfg_dropout(hidden, empty, 0.15, torch.Generator().manual_seed(0))
    sigma = math.sqrt(0.15 * 0.85 / 20000)
    assert abs(drop.float().mean().item() - 0.15) < 5 * sigma
    assert torch.equal(out[drop], empty.expand(int(drop.sum()), 77, 8))
    assert torch.equal(out[~drop], hidden[~drop])
    _, none = sd.train.step.apply_cfg_dropout(hidden, empty, 0.0, torch.Generator().manual_seed(0))
    assert not none.any()


@pytest.mark.slow
def test_init_from_takes_weights_and_ema_with_a_fresh_optimizer(run_a, tmp_path, data):
    run_dir_a, _ = run_a
    run = make_run(tmp_path, data, init_from=str(run_dir_a))
    source = run_dir_a / "checkpoints" / sd.run_folder.step_dir_name(TOTAL)
    unet, ema = load_file(source / "unet.safetensors"), load_file(source / "ema.safetensors")
    assert all(torch.equal(v, unet[k]) for k, v in run.step.unet.state_dict().items())
    assert all(torch.equal(v, ema[k]) for k, v in run.step.ema.state_dict().items())
    assert run.state.step == 0 and not run.step.optimizer.state_dict()["state"]


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize("fields, flags, message", [
    ({"lrr": 1e-4}, [], "unknown config field 'lrr'.*did you mean 'lr'"),
    ({}, ["--learning_rate", "1e-4"], "unknown config field 'learning_rate'"),
    ({"cfg_dropout": 1.5}, [], r"cfg_dropout must be in \[0, 1\)"),
    ({"batch_size": "big"}, [], "batch_size: expected int"),
    ({"keep_checkpoints": 1}, [], "keep_checkpoints must be >= 2"),
    ({"datasets": [{"dataset": "/nonexistent/captions", "latents": "/nonexistent/latents"}]}, [],
     "datasets\\[0\\].dataset: folder /nonexistent/captions does not exist"),
    ({}, ["--flip"], "data.flip: latent folder .*/latents has no flipped latents for 5 of 5 files.*encode_latents.py --flip"),
    ({"ema_warmup": "continue"}, [], "ema.warmup: auto, restart or off"),
    ({"validation_sampler": "lcm", "validation_steps": 51}, [], "lcm takes at most 50 steps"),
    ({"validation_steps": 1001}, [], "ddim takes at most 1000 steps"),
])
def test_bad_configs_stop_before_any_work(tmp_path, data, capsys, fields, flags, message):
    config = write_config(tmp_path / "c.yaml", **{"datasets": [data], "max_steps": 2,
                                                  "out_dir": str(tmp_path / "run"), **fields})
    assert SD_Train.main(["--config", str(config), *flags]) == 2
    import re

    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("part", ["text_encoder", "vae"])
def test_a_model_part_the_offline_hub_cannot_give_is_one_line_naming_it_and_init_from(tmp_path, data, capsys,
                                                                                       monkeypatch, part):
    """Offline, a hub id missing from the local cache stops the run in one line naming the part and the way out;
    an ``init_from`` that is no folder here (a quick start run before the one it builds on) is named with it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fields = {"text_encoder": "tiny", "vae": "tiny", part: "nobody/no-such-model"}
    config = write_config(tmp_path / "c.yaml", datasets=[data], max_steps=2, out_dir=str(tmp_path / "run"),
                          init_from="runs/not_trained_yet", **fields)
    assert SD_Train.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"error (rank 0): {part} nobody/no-such-model: cannot be loaded (" in err, err
    assert "it is not in the local cache; give a local folder, or a hub id with the hub reachable" in err
    assert "(init_from runs/not_trained_yet is no file or folder here, so it was read as a hub id)" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_latents_missing_for_captions_stop_with_counts_and_keys(tmp_path, capsys):
    make_latents(tmp_path / "lat", ["a0", "a1"], np.zeros((2, 4, 8, 8)))
    make_captions(tmp_path / "caps", [("a0", "x"), ("a1", "y"), ("b7", "z")], [])
    config = write_config(tmp_path / "c.yaml", datasets=[{"dataset": str(tmp_path / "caps"),
                                                          "latents": str(tmp_path / "lat")}],
                          max_steps=2, out_dir=str(tmp_path / "run"))
    assert SD_Train.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "1 of 3 captions" in err and "'b7'" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_resume_refuses_a_changed_batch_size(run_a, tmp_path, data, capsys):
    import shutil

    run_dir_a, config = run_a
    shutil.copytree(run_dir_a, tmp_path / "run")
    copy = write_config(tmp_path / "r.yaml", datasets=[data], max_steps=TOTAL, out_dir=str(tmp_path / "run"),
                        batch_size=4)
    # One process: the world size differs too, and both are named.
    assert SD_Train.main(["--config", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "was written with other settings: batch_size: 2 -> 4 (it fixes the data order)" in err
    assert "world size: 2 -> 1 rank(s)" in err


@pytest.mark.slow
def test_global_batch_sets_the_accumulation_and_an_impossible_one_stops_before_any_work(tmp_path, data, capsys,
                                                                                       caplog):
    import logging

    config = write_config(tmp_path / "g.yaml", datasets=[data], max_steps=1, out_dir=str(tmp_path / "run"),
                          batch_size=4, grad_accum=1, global_batch=8)
    with caplog.at_level(logging.INFO):
        assert SD_Train.main(["--config", str(config)]) == 0
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert (saved["batch_size"], saved["grad_accum"], saved["global_batch"]) == (4, 2, 8)
    assert "8 images per optimizer step (batch_size 4 x 1 GPU(s) x grad_accum 2, set by global_batch 8)" in caplog.text
    state = sd.run_folder.load_torch(tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(1) / "train_state.pt")
    assert state["samples_seen"] == 8
    bad = write_config(tmp_path / "b.yaml", datasets=[data], max_steps=1, out_dir=str(tmp_path / "bad"),
                       batch_size=4, global_batch=6)
    assert SD_Train.main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "global_batch 6 is not a whole number of steps of batch_size 4 on 1 GPU(s)" in err
    assert "use batch_size 3 (grad_accum 2) or global_batch 8 with lr" in err
    assert not (tmp_path / "bad" / "checkpoints").exists()


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_resume_with_another_world_size_is_refused_and_writes_nothing(run_a, tmp_path, capsys):
    import shutil

    run_dir_a, config_a = run_a
    shutil.copytree(run_dir_a, tmp_path / "run")
    fields = yaml.safe_load(config_a.read_text())
    config = tmp_path / "one_rank.yaml"
    config.write_text(yaml.safe_dump({**fields, "out_dir": str(tmp_path / "run")}))
    before = folder_bytes(tmp_path / "run")
    assert SD_Train.main(["--config", str(config)]) == 2  # one process: world size 1
    latest = tmp_path / "run" / "checkpoints" / sd.run_folder.step_dir_name(TOTAL)
    assert f"{latest} was written with other settings: world size: 2 -> 1 rank(s)" in capsys.readouterr().err
    after = folder_bytes(tmp_path / "run")
    assert after.keys() == before.keys()  # no new checkpoint, sample or log
    assert [name for name in before if after[name] != before[name]] == []  # metrics.jsonl included


def test_latents_of_another_scaling_factor_are_refused_before_any_work(tmp_path, data, capsys):
    import shutil

    latents = tmp_path / "latents_sdxl_vae"
    shutil.copytree(data["latents"], latents)
    meta = json.loads((latents / "latents.json").read_text())
    (latents / "latents.json").write_text(json.dumps({**meta, "scaling_factor": 0.13025}))
    config = write_config(tmp_path / "s.yaml", datasets=[{"dataset": data["dataset"], "latents": str(latents)}],
                          max_steps=2, out_dir=str(tmp_path / "run"))
    assert sd.model.load_vae("tiny").config.scaling_factor == 0.18215
    assert SD_Train.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{latents.resolve() / 'latents.json'} records 0.13025" in err
    assert "vae: tiny has scaling factor 0.18215" in err
    assert not (tmp_path / "run").exists()


# (lr, warm-up, CFG dropout, {dataset: weight}) of the reference curriculum, docs/training.md.
PHASES = {
    "p1_laion_broad": (1e-5, 500, 0.05, {"laion_p1": 1.0}),
    "p2_laion_aesthetic": (1e-5, 500, 0.05, {"laion_p2": 1.0}),
    "p3_synthetic": (1e-5, 500, 0.05, {"diffusiondb": 0.71, "journeydb": 0.29}),
    "p4_faces": (2e-6, 200, 0.15, {"faces": 1.0}),
    "p5_coco_full_body": (1.5e-6, 150, 0.15, {"coco_person": 1.0}),
    "p6_mixed": (1e-6, 100, 0.15, {"laion_p2": 0.6, "faces": 0.2, "coco_person": 0.2}),
    "p7_consolidation": (1e-6, 150, 0.15, {"laion_p2": 0.37, "diffusiondb": 0.22, "journeydb": 0.22,
                                           "faces": 0.09, "coco_person": 0.10}),
}


@pytest.mark.parametrize("name", sorted(PHASES))
def test_phase_recipes_match_the_reference_curriculum(name, tmp_path, monkeypatch):
    lr, warmup, dropout, mix = PHASES[name]
    path = ROOT / "configs" / "phases" / f"{name}.yaml"
    monkeypatch.chdir(tmp_path)  # the recipes' relative data folders, made empty here
    for dataset in mix:
        (tmp_path / "data" / dataset / "dataset").mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / dataset / "latents").mkdir(parents=True, exist_ok=True)
    config = sd.train.config_loading.load_config(["--config", str(path), "--init_from", ""])
    assert (config.lr, config.warmup_steps, config.cfg_dropout) == (lr, warmup, dropout)
    weights = {Path(d["dataset"]).parent.name: d["weight"] for d in config.datasets}
    assert weights == pytest.approx(mix) and sum(weights.values()) == pytest.approx(1.0)
    assert (config.batch_size, config.grad_accum, config.min_snr_gamma, config.ema_decay) == (24, 2, 5.0, 0.9999)
    assert config.unet == "sd1" and config.grad_checkpointing and config.precision == "bf16"
    assert config.out_dir == f"runs/{name}"
    raw = yaml.safe_load(path.read_text())
    order = sorted(PHASES)
    assert raw.get("init_from") == (f"runs/{order[order.index(name) - 1]}" if name != "p1_laion_broad" else None)


@pytest.mark.slow
def test_wandb_offline_logs_one_run_across_a_resume(tmp_path, data, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = write_config(tmp_path / "w.yaml", datasets=[data], max_steps=4, out_dir=str(tmp_path / "run"),
                          batch_size=4, grad_accum=1, wandb_mode="offline")
    assert SD_Train.main(["--config", str(config), "--stop_at_step", "2"]) == 0
    run_id = (tmp_path / "run" / "wandb_id.txt").read_text().strip()
    assert SD_Train.main(["--config", str(config)]) == 0
    assert (tmp_path / "run" / "wandb_id.txt").read_text().strip() == run_id
    files = list((tmp_path / "run" / "wandb").rglob("*.wandb"))
    assert files and all(run_id in f.name for f in files) and all(f.stat().st_size > 0 for f in files)
    assert len(losses(tmp_path / "run")) == 4


@pytest.mark.slow
def test_tensorboard_gets_each_logged_step_once_across_a_resume_from_an_older_checkpoint(tmp_path, data):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    config = write_config(tmp_path / "t.yaml", datasets=[data], max_steps=4, out_dir=str(run), batch_size=4,
                          grad_accum=1, save_steps=2, validate_every=2, validation_prompts=["a red circle"],
                          validation_steps=2)  # tensorboard: auto, wandb off
    assert SD_Train.main(["--config", str(config), "--stop_at_step", "3"]) == 0
    shutil.rmtree(run / "checkpoints" / sd.run_folder.step_dir_name(3))  # as if killed after logging step 3
    assert SD_Train.main(["--config", str(config)]) == 0  # resumes at 2: steps 3 and 4 are logged again
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("loss")]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    expected = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert [step for step, _ in logged] == [1, 2, 3, 4]  # the first run's step 3 is purged
    assert logged == [(step, pytest.approx(loss, rel=1e-6)) for step, loss in expected]
    assert {"lr", "grad_norm", "loss_by_quartile/0"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Images("samples")] == [2, 4]
    off = write_config(tmp_path / "off.yaml", datasets=[data], max_steps=1, out_dir=str(tmp_path / "off"),
                       batch_size=4, grad_accum=1, tensorboard="false")
    assert SD_Train.main(["--config", str(off)]) == 0 and not (tmp_path / "off" / "tensorboard").exists()


# ------------------------------------------------------------------------------ one writer, stop points


HOLD_LOCK = "import sys, time, sd.files; sd.files.FolderLock(sys.argv[1]).acquire(); print('locked', flush=True); " \
            "time.sleep(120)"


def test_a_held_lock_stops_the_second_trainer_at_once_and_one_nobody_holds_is_taken_over(tmp_path, data, capsys):
    import socket

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = write_config(tmp_path / "l.yaml", datasets=[data], max_steps=2, out_dir=str(run_dir), batch_size=4,
                          grad_accum=1)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        assert SD_Train.main(["--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert f"{run_dir} is in use by process {holder.pid} on host {socket.gethostname()}" in err
        assert [p.name for p in run_dir.iterdir()] == [".lock"]  # nothing written
    finally:
        holder.kill()
        holder.wait()
    # Killed, its lock went with it. The file stays behind, here naming this process's pid as when a
    # restarted container's trainer gets the pid of the one that wrote it: the next trainer takes it over
    # and removes it at the end.
    (run_dir / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    assert SD_Train.main(["--config", str(config)]) == 0
    assert (run_dir / "checkpoints" / sd.run_folder.step_dir_name(2) / "COMPLETE").exists()
    assert not (run_dir / ".lock").exists()


@pytest.mark.slow
def test_two_trainers_on_one_folder_the_second_exits_at_once(tmp_path, data, capsys):
    import time

    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "t.yaml", datasets=[data], max_steps=400, out_dir=str(run_dir), batch_size=2,
                          grad_accum=1, save_steps=1000, log_every=1)
    first = subprocess.Popen([sys.executable, str(ROOT / "SD_Train.py"), "--config", str(config)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (run_dir / ".lock").exists() or not (run_dir / ".lock").read_text():  # locked, then named
        assert first.poll() is None and time.monotonic() < deadline, "the first trainer never took the lock"
        time.sleep(0.05)
    assert SD_Train.main(["--config", str(config)]) == 2
    assert f"is in use by process {first.pid}" in capsys.readouterr().err
    assert first.poll() is None  # the first one trains on, untouched by the second
    # Stopped the way a scheduler stops it (SIGTERM: finish the step, save, exit 128 + 15), it saves and
    # lets go of the lock. communicate, not wait: its progress bar goes to the pipe, and a pipe nobody
    # reads fills (64 KiB) and blocks the trainer.
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip():
        assert first.poll() is None and time.monotonic() < deadline, "the first trainer never logged a step"
        time.sleep(0.05)  # its loop runs: SIGTERM now reaches the trainer's handler
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=600)
    assert first.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    # the stop's line starts a line of its own (the progress bar is cleared for it, not written after)
    assert re.search(r"(^|[\r\n])\d\d:\d\d:\d\d INFO stopped by signal 15 after step", stderr), stderr[-2000:]
    saved = sd.run_folder.latest_checkpoint(run_dir / "checkpoints")
    assert saved is not None and 0 < int(saved.name.split("_")[1]) < 400
    assert not (run_dir / ".lock").exists()


@pytest.mark.slow
def test_a_changed_setting_on_resume_is_refused_or_warned_and_never_calls_a_good_checkpoint_damaged(
        tmp_path, data, capsys, caplog):
    import logging
    import types

    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "e.yaml", datasets=[data], max_steps=4, out_dir=str(run_dir), batch_size=4,
                          grad_accum=1, ema_decay=0.0)
    assert SD_Train.main(["--config", str(config), "--stop_at_step", "2"]) == 0
    first = run_dir / "checkpoints" / sd.run_folder.step_dir_name(2)
    before = folder_bytes(first)
    # A setting that changes the math: refused with both values, the checkpoint left as it is.
    assert SD_Train.main(["--config", str(config), "--min_snr_gamma", "1"]) == 2
    assert f"{first} was written with other settings: min_snr_gamma: 5.0 -> 1.0" in capsys.readouterr().err
    # Another world size or another number of samples: refused the same way, before any file is verified.
    saved_run = make_run(tmp_path / "probe", data, batch_size=4, grad_accum=1, ema_decay=0.0)
    for world_size, samples in ((2, len(saved_run.train_data)), (1, 48)):
        probe = types.SimpleNamespace(config=saved_run.config, train_data=range(samples),
                                      d=types.SimpleNamespace(world_size=world_size, rank=0, is_main=True))
        with pytest.raises(sd.train.config.ConfigError) as refused:
            sd.train.recovery.check_settings(probe, first)
        expected = "world size: 1 -> 2 rank(s)" if world_size == 2 else f"training samples: {len(saved_run.train_data)} -> 48"
        assert expected in str(refused.value)
    # fp16 new since the checkpoint: its loss scale starts afresh (the checkpoint's scaler holds none).
    saved_run.config = dataclasses.replace(saved_run.config, precision="fp16")
    assert "scaler" not in sd.train.recovery.parts_to_load(saved_run, {"precision": "fp32", "ema_decay": 0.0})
    assert "scaler" in sd.train.recovery.parts_to_load(saved_run, {"precision": "fp16", "ema_decay": 0.0})
    # EMA turned on: accepted with a warning; the EMA starts from the resumed weights.
    with caplog.at_level(logging.WARNING):
        assert SD_Train.main(["--config", str(config), "--ema_decay", "0.5", "--stop_at_step", "3"]) == 0
    assert "ema_decay: 0.0 -> 0.5: the EMA goes on with the new decay; turned on, it starts from the resumed" in caplog.text
    assert "damaged" not in caplog.text and folder_bytes(first) == before
    resumed = load_file(first / "unet.safetensors")
    step3 = run_dir / "checkpoints" / sd.run_folder.step_dir_name(3)
    ema, unet = load_file(step3 / "ema.safetensors"), load_file(step3 / "unet.safetensors")
    decay = sd.train.ema.ema_decay_at(2, 0.5)  # one update (warm-up restarted: 0.25) from the step-2 weights
    for name, start in resumed.items():
        assert torch.allclose(ema[name], decay * start + (1 - decay) * unet[name], atol=1e-6), name


def test_a_stop_during_validation_ends_it_between_denoising_steps_on_live_weights(tmp_path, data, monkeypatch):
    run = make_run(tmp_path, data, validate_every=1, validation_steps=4,
                   validation_prompts=["a red circle", "a blue square", "a green triangle"])
    live = {k: v.clone() for k, v in run.step.unet.state_dict().items()}
    calls = []
    run.step.unet.register_forward_pre_hook(lambda *_: calls.append(1))
    record = {}
    # Asked before any work: no UNet call, nothing recorded.
    assert sd.train.validation.check(run, record, lambda: True) == (None, True)
    assert calls == [] and record == {}
    # Another rank's stop reaches this one through the validation loss's all-reduce: both leave there.
    reduce = sd.distributed.all_reduce_sum
    with monkeypatch.context() as patch:
        patch.setattr(sd.distributed, "all_reduce_sum",
                      lambda values, d: reduce(values, d) + torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=values.dtype))
        assert sd.train.validation.check(run, record, lambda: False) == (None, True)
    assert len(calls) == 4 and record == {}  # its four batches of 2 with the live weights; none with the EMA
    # The grid's first prompt: asked before each denoising step, the stop comes after two of its four
    # (of the grid's twelve), and nothing more runs.
    run.val_data, calls[:] = None, []
    assert sd.train.validation.check(run, record, lambda: len(calls) >= 2) == (None, True)
    assert len(calls) == 2 and not (run.run_dir / "samples").exists()
    assert run.step.unet.training  # back in training mode, with the live weights, not the EMA's
    assert_bitwise_equal(run.step.unet.state_dict(), live)


@pytest.mark.slow
def test_sigusr1_and_sighup_save_at_the_step_they_stop_and_the_run_resumes(tmp_path, data):
    """SLURM's warning signals (``--signal=USR1@120``) and a hang-up stop the run as SIGTERM does: a
    checkpoint at the step it stopped after, exit 128 + signal. With validation after every step (the
    most of each step's time), the signal lands in a validation, which is cut short: the step saved
    has no grid."""
    import time

    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "u.yaml", datasets=[data], max_steps=400, out_dir=str(run_dir), batch_size=2,
                          grad_accum=1, save_steps=1000, validate_every=1, validation_steps=20)

    def logged_steps() -> list[int]:
        text = (run_dir / "metrics.jsonl").read_text() if (run_dir / "metrics.jsonl").exists() else ""
        return [json.loads(line)["step"] for line in text.splitlines(keepends=True) if line.endswith("\n")]

    before = 0
    for signum in (signal.SIGUSR1, signal.SIGHUP):
        trainer = subprocess.Popen([sys.executable, str(ROOT / "SD_Train.py"), "--config", str(config)], cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while max(logged_steps(), default=0) <= before:  # its loop runs: the handler is in place
            assert trainer.poll() is None and time.monotonic() < deadline, "the trainer never logged a step"
            time.sleep(0.05)
        trainer.send_signal(signum)
        _, stderr = trainer.communicate(timeout=600)  # communicate: its progress bar fills the pipe
        assert trainer.returncode == 128 + signum, stderr[-2000:]
        stopped = logged_steps()[-1]
        assert f"stopped by signal {int(signum)} after step {stopped};" in stderr
        assert sd.run_folder.latest_checkpoint(run_dir / "checkpoints").name == sd.run_folder.step_dir_name(stopped)
        assert not (run_dir / "samples" / f"step_{stopped:08d}.png").exists()
        assert (run_dir / "samples" / f"step_{stopped - 1:08d}.png").exists() or stopped - 1 == before
        if before:
            assert f"resumed at step {before}" in stderr
        assert stopped > before
        before = stopped


@pytest.mark.slow  # over 5 s: the full suite's (make check stays near 3 minutes)
def test_stop_at_step_at_or_below_the_resumed_step_trains_nothing(tmp_path, data):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "s.yaml", datasets=[data], max_steps=6, out_dir=str(run_dir), batch_size=4,
                          grad_accum=1)
    assert SD_Train.main(["--config", str(config), "--stop_at_step", "4"]) == 0
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    for stop in ("4", "2"):
        assert SD_Train.main(["--config", str(config), "--stop_at_step", stop]) == 0
        assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [sd.run_folder.step_dir_name(4)]
        assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    assert SD_Train.main(["--config", str(config)]) == 0  # without it, the run goes on to max_steps
    assert sd.run_folder.latest_checkpoint(run_dir / "checkpoints").name == sd.run_folder.step_dir_name(6)


# ------------------------------------------------------------------------------ host synchronisation, prefetch


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor calls that wait for the device on a GPU: reading values to the host."""

    READS = {torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
             torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


def test_optimizer_steps_leave_their_statistics_on_the_device_until_one_read_of_them_all(tmp_path, data):
    run = make_run(tmp_path, data, grad_accum=2, batch_size=2)
    micro = [run.train_data.batch(np.arange(2)), run.train_data.batch(np.arange(2, 4))]
    sd.train.step.train_step(run.step, micro, 0)["bad"]  # the optimizer's state is created on the first step
    bad = [(latents.clone(), ids) for latents, ids in micro]
    bad[1][0][0, 0, 0, 0] = float("nan")
    with HostReads() as reads:
        results = [sd.train.step.train_step(run.step, batch, i) for i, batch in enumerate([micro, bad, micro], 1)]
    assert reads.count == 0  # the skip decision was applied on the device
    with HostReads() as reads:
        sd.train.step.read_results(results)
        assert [r["bad"] for r in results] == [False, True, False]
    assert reads.count == 1


def test_the_loop_reads_the_statistics_at_log_steps_and_records_skipped_steps_between(tmp_path, data, monkeypatch):
    windows, train_step = [], sd.train.step.train_step

    def step_with_a_nan_at_step_4(step, micro, index, **kwargs):
        if index == 4:  # the 5th step: a NaN latent
            micro = [(latents.clone().fill_(float("nan")), ids) for latents, ids in micro]
        return train_step(step, micro, index, **kwargs)

    read = sd.train.step.read_results
    monkeypatch.setattr(sd.train.step, "train_step", step_with_a_nan_at_step_4)
    monkeypatch.setattr(sd.train.step, "read_results", lambda results: windows.append(len(results)) or read(results))
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", datasets=[data], max_steps=8, log_every=3, out_dir=str(run_dir))
    assert SD_Train.main(["--config", str(config)]) == 0
    assert windows == [3, 3, 2]  # steps 1-3, 4-6 and 7-8 (the last step)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped"], r["bad_steps"]) for r in records] == [(3, False, 0), (5, True, 1), (6, False, 1)]
    assert records[0]["images_per_s"] > 0 and "images_per_s" not in records[1]


def test_prefetched_batches_equal_the_ones_built_in_place_and_a_stale_one_is_dropped(tmp_path, data):
    run = make_run(tmp_path, data)
    prefetch = sd.data.prefetch.Prefetcher(run.train_data, pin=False)
    try:
        rows = [np.array([3, 1]), np.array([7, 5])]
        prefetch.ahead((0, 2), rows)
        got = prefetch.take((0, 2), [np.array([0, 0])])  # the key matches: the prefetched rows are used
        prefetch.ahead((0, 4), rows)
        fresh = prefetch.take((1, 0), [np.array([0, 0])])  # another key: built from the rows given now
    finally:
        prefetch.close()
    for (latents, ids), expected in zip(got, [run.train_data.batch(r) for r in rows]):
        assert torch.equal(latents, expected[0]) and torch.equal(ids, expected[1])
    assert torch.equal(fresh[0][0], run.train_data.batch(np.array([0, 0]))[0])


def test_validation_loss_scores_every_dataset_of_a_mixed_phase(tmp_path, data):
    other = make_dataset(tmp_path / "b", n_train=16, n_val=8, seed=1, prefix="b")
    run = make_run(tmp_path, data, datasets=[data, {**other, "weight": 3.0}])
    asked = []
    batch = run.val_data.batch
    run.val_data.batch = lambda rows: asked.extend(rows.tolist()) or batch(rows)
    loss = sd.train.step.validation_loss(run.step, run.val_data, 8, 4)
    which = np.searchsorted(run.val_data.offsets, asked, side="right") - 1
    assert np.bincount(which, minlength=2).tolist() == [2, 6] and math.isfinite(loss)  # 8 by weight 1:3


def test_resume_drops_a_torn_last_metrics_line_and_stops_at_a_corrupt_one(tmp_path, data, capsys, caplog):
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "m.yaml", datasets=[data], max_steps=4, out_dir=str(run_dir), batch_size=4,
                          grad_accum=1)
    assert SD_Train.main(["--config", str(config), "--stop_at_step", "2"]) == 0
    metrics = run_dir / "metrics.jsonl"
    good = metrics.read_text()
    # A line in the middle that is no record: one line naming the file and the line, nothing trained.
    lines = good.splitlines()
    metrics.write_text(f"{lines[0]}\n{lines[1][:25]}\n{lines[1]}\n")
    corrupt = metrics.read_bytes()
    capsys.readouterr()
    assert SD_Train.main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"SD_Train.py: error (rank 0): {metrics}: line 2 is not JSON (") and err.count("\n") == 1
    assert metrics.read_bytes() == corrupt
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [sd.run_folder.step_dir_name(2)]
    # The last line torn by a crash while writing step 3's record: dropped, and the run resumes.
    metrics.write_text(good + lines[1][:25].replace('"step": 2', '"step": 3'))
    assert SD_Train.main(["--config", str(config)]) == 0
    assert f"{metrics}: dropped its torn last line" in caplog.text
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3, 4]
    assert sd.run_folder.latest_checkpoint(run_dir / "checkpoints").name == sd.run_folder.step_dir_name(4)


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone: DDP's own code, no second process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ddp_accumulation_sums_into_the_buckets_with_no_second_gradient_copy(tmp_path, data, one_rank_group):
    """Every micro-batch's gradients land in DDP's buckets, the no_sync ones included: each parameter's
    ``.grad`` is the same bucket view at every accumulation of every step."""
    run = make_run(tmp_path, data, grad_accum=2, batch_size=2)
    sd.train.step.wrap_ddp(run.step)
    params = [p for p in run.step.unet.parameters() if p.requires_grad]
    bound = [p.grad.data_ptr() for p in params]  # bound to the buckets when DDP wrapped the UNet
    seen = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: seen.append((id(p), p.grad.data_ptr())))
    micro = [run.train_data.batch(np.arange(2)), run.train_data.batch(np.arange(2, 4))]
    for i in range(2):
        assert not sd.train.step.train_step(run.step, micro, i)["bad"]
    where = {id(p): ptr for p, ptr in zip(params, bound)}
    assert len(seen) == 2 * 2 * len(params)
    assert all(ptr == where[key] for key, ptr in seen)
    assert len({p.grad.untyped_storage().data_ptr() for p in params}) < len(params) / 10  # a few buckets


class ToyData:
    """The parts of MixedData that grid_prompts reads: one split of 16 samples."""

    def __init__(self, split):
        self.splits, self.offsets = [split], np.array([0, 16])

    def __len__(self) -> int:
        return 16


def test_the_grid_adds_captions_of_the_training_data_drawn_once_for_the_run(tmp_path):
    """validation_data_captions: distinct captions of the training samples after validation_prompts, the
    same at every validation (a stream of their own, from the seed); none for a mode whose prompts take
    images (ControlNet)."""
    from types import SimpleNamespace

    from PIL import Image

    from data_factory import WORDS, train_tiny_run

    captions = [f"a {WORDS[i % len(WORDS)]}" for i in range(16)]
    config = sd.train.config.TrainConfig(**{**BASE, "validation_prompts": ["a red circle"], "validation_data_captions": 3})
    split = SimpleNamespace(captions=None, input_ids=np.array([[i] for i in range(16)]))
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: captions[int(ids[0])])
    run = SimpleNamespace(config=config, train_data=ToyData(split), mode=SimpleNamespace(prompt_inputs=False),
                          sampler=SimpleNamespace(tokenizer=tokenizer))
    prompts = sd.train.validation.grid_prompts(run)
    assert prompts[0] == "a red circle" and sorted(prompts[1:]) == sorted(f"a {w}" for w in WORDS[1:])
    assert sd.train.validation.grid_prompts(run) == prompts  # the same draw at every validation
    control = SimpleNamespace(**{**vars(run), "mode": SimpleNamespace(prompt_inputs=True)})
    assert sd.train.validation.grid_prompts(control) == ["a red circle"]
    none = SimpleNamespace(**{**vars(run), "config": dataclasses.replace(config, validation_data_captions=0)})
    assert sd.train.validation.grid_prompts(none) == ["a red circle"]
    # A run's grid: its prompt and three captions of its data (its toy set has four), 2 x 2 cells of 128 px.
    run_dir = train_tiny_run(tmp_path, 16, max_steps=2, validate_every=2, save_steps=2, validation_steps=2,
                             validation_prompts=["a red circle"], validation_data_captions=3)
    grid = np.asarray(Image.open(run_dir / "samples" / "step_00000002.png").convert("RGB"))
    layout = sd.sampling.GridLayout.of(prompts, 1, 64, 64)
    assert layout.per_row == 2 and grid.shape == (layout.size[1], layout.size[0], 3)
    cells = [sd.sampling.grid_cell(grid, row, 0, 64, 64, prompts) for row in range(4)]
    assert all(cell.std() > 0 for cell in cells)  # four pictures (a 2-step model barely heeds its prompt yet)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def two_nodes(cwds: tuple[Path, Path], *runs: list[str] | dict, env=None) -> list[subprocess.CompletedProcess]:
    """Two torchrun launchers of one rank each, as two nodes would start them, meeting by c10d rendezvous
    on the loopback address; each in its own working folder. The ranks run ``runs`` one after another
    (tests/train_runs.py)."""
    port = free_port()
    launchers = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                                   "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=nodes",
                                   "-m", "tests.train_runs", json.dumps(runs)],
                                  cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {}),
                                       "OMP_NUM_THREADS": "1"})  # as torchrun sets for 2 ranks on one node
                 for cwd in cwds]
    results = []
    for launcher in launchers:
        out, err = launcher.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(launcher.args, launcher.returncode, out, err))
    return results


@pytest.mark.slow
def test_two_nodes_stopped_and_resumed_end_bitwise_as_one_node_and_a_node_local_out_dir_is_refused(
        run_a, data, tmp_path):
    """Two "nodes" of one rank each (local rank 0 on both): with out_dir local to each node (a relative path
    in each node's own folder), every rank stops before any step with a config error naming the folder; then,
    in the same launch, the reference's command stopped at step 2, and resumed in a launch of its own, ends
    with its weights, optimizer and every rank's RNGs bit for bit."""
    reference, _ = run_a
    nodes = (tmp_path / "node0", tmp_path / "node1")
    for node in nodes:
        node.mkdir()
    shared = write_config(tmp_path / "shared.yaml", datasets=[data], max_steps=TOTAL, out_dir=str(tmp_path / "run"),
                          validate_every=5)
    local = write_config(tmp_path / "local.yaml", datasets=[data], max_steps=TOTAL, out_dir="run")
    results = two_nodes(nodes, {"argv": ["--config", str(local)], "exit": 2},
                        ["--config", str(shared), "--stop_at_step", "2"], env={"SD_SHARED_FOLDER_WAIT_S": "3"})
    assert all(r.returncode == 0 for r in results), [r.stderr[-3000:] for r in results]
    ranks = set()
    for result in results:  # each launcher's stderr holds its own rank's error
        error = re.search(r"SD_Train.py: error \(rank (\d)\): out_dir \S+ is not one folder for all ranks: rank 1 on",
                          result.stderr)
        assert error and "shared filesystem" in result.stderr, result.stderr[-3000:]
        ranks.add(error.group(1))
    assert ranks == {"0", "1"}
    assert not any((node / "run" / "checkpoints").exists() for node in nodes)
    results = two_nodes(nodes, ["--config", str(shared)])
    assert all(r.returncode == 0 for r in results), [r.stderr[-3000:] for r in results]
    assert_bitwise_equal(final_state(tmp_path / "run", TOTAL), final_state(reference, TOTAL))
    assert losses(tmp_path / "run") == losses(reference)
    assert not list((tmp_path / "run").glob(".shared-*"))
