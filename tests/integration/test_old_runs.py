"""Checkpoints written by an earlier trainer (``tests/fixtures/old_runs``, one run per mode, made by
``tests/fixtures/make_old_runs.py``) resume with today's: every entry loads into the state the file holds, the
run goes on under the same entry names, and the files exported from them are those exported then.

What is compared does not depend on the machine: the state a checkpoint loads is written back and
compared with its files bit for bit, and exports copy tensors without arithmetic. (A step trained here
would not equal one trained where the fixture was made: another CPU's kernels round differently.)"""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import sd.model
import sd.run_folder
import sd.train.recovery
import sd.train.config
import sd.train.config_loading
import SD_ImageGen
import SD_Train
from sd.distributed import Dist

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "old_runs"
MODES = ("full", "lora", "token", "controlnet", "lcm_lora")
EXPORTS = {"full": "--export_single_file", "lora": "--export_lora", "token": "--export_embedding",
           "controlnet": "--export_controlnet", "lcm_lora": "--export_lora"}
MICRO_UNET = dict(sd.model.UNET_PRESETS["tiny"], block_out_channels=(8, 16), norm_num_groups=4, cross_attention_dim=8,
                  attention_head_dim=2)  # the preset the fixture's runs were trained with (make_old_runs.py)
STEP = sd.run_folder.step_dir_name(2)
pytestmark = pytest.mark.slow


@pytest.fixture
def old_runs(tmp_path, monkeypatch) -> Path:
    """A copy of the fixture folder, as the working directory (its configs' paths are relative)."""
    folder = tmp_path / "old_runs"
    shutil.copytree(FIXTURE, folder)
    monkeypatch.chdir(folder)
    monkeypatch.setitem(sd.model.UNET_PRESETS, "micro", MICRO_UNET)
    return folder


def contents(path: Path):
    """A checkpoint file's contents: tensors by name for safetensors, the unpickled structure otherwise."""
    return load_file(path) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)


def assert_same(a, b, where: str) -> None:
    """Equal structures, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


STATE_FILES = ("COMPLETE", "manifest.json", "config.yaml")  # written about the state, not the state


@pytest.mark.parametrize("mode", MODES)
def test_an_old_checkpoint_loads_the_state_its_files_hold_and_the_run_goes_on(old_runs, mode, tmp_path):
    config = sd.train.config_loading.load_config(["--config", f"configs/{mode}.yaml"])
    run = SD_Train.build(config, Dist.single())
    assert run.state.step == 2
    run.rng.start(run.config.seed, 0)  # the loaded RNG states, as the loop applies them
    run.run_dir = tmp_path / "written_back"
    sd.train.recovery.save(run)
    old, new = old_runs / "runs" / mode / "checkpoints" / STEP, run.run_dir / "checkpoints" / STEP
    names = sorted(p.name for p in old.iterdir() if p.name not in STATE_FILES)
    added = ["frozen_parts.safetensors"]  # recorded since: the text encoder's and VAE's fingerprints
    assert sorted(p.name for p in new.iterdir() if p.name not in STATE_FILES) == sorted(names + added)
    for name in names:
        assert_same(contents(old / name), contents(new / name), f"{mode}/{name}")

    assert SD_Train.main(["--config", f"configs/{mode}.yaml"]) == 0  # to step 3 of 3, saved under the same names
    last = old_runs / "runs" / mode / "checkpoints" / sd.run_folder.step_dir_name(3)
    assert sorted(p.name for p in last.iterdir() if p.name not in STATE_FILES) == sorted(names + added)


@pytest.mark.parametrize("mode", MODES)
def test_an_old_checkpoint_exports_the_files_it_exported(old_runs, mode):
    out = Path("again") / f"{mode}.safetensors"
    assert SD_ImageGen.main(["--ckpt", f"runs/{mode}/checkpoints/{STEP}", "--tokenizer", "tiny", "--vae", "tiny",
                             EXPORTS[mode], str(out)]) == 0
    before, now = load_file(Path("exports") / f"{mode}.safetensors"), load_file(out)
    if mode == "full":  # the fixture keeps the single file's UNet (its VAE and text encoder are the inputs')
        now = {k: v for k, v in now.items() if k.startswith("model.diffusion_model.")}
    assert_same(before, now, mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_changed_precision_resumes_every_modes_checkpoint_both_ways(old_runs, mode, caplog):
    """The fixture's runs are fp32: resumed in bf16 (its frozen weights now stored in bf16), saved, and that
    checkpoint resumed in fp32 again. Neither is set aside as damaged; each resumes the step it holds.
    (Before, every mode with a frozen base failed the per-rank weight fingerprint, which covered the frozen
    weights in the run's precision, and its good checkpoint was renamed ``*.damaged``.)"""
    run_dir = old_runs / "runs" / mode
    for precision in ("bf16", "fp32"):
        config = sd.train.config_loading.load_config(["--config", f"configs/{mode}.yaml", "--precision", precision])
        with caplog.at_level("WARNING"):
            run = SD_Train.build(config, Dist.single())
        assert run.state.step == 2 and run.config.precision == precision, (mode, precision)
        assert not list((run_dir / "checkpoints").glob("*.damaged")), caplog.text
        sd.train.recovery.save(run)  # over the step-2 checkpoint: the next resume reads what this precision wrote
        assert (run_dir / "checkpoints" / STEP / "COMPLETE").exists()
