"""train_vae.py on a CPU: a tiny VAE learns, saves a diffusers folder atomically, and its CLI is strict."""

import importlib
import io
import json
import logging
import os
import re
import signal
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
import sd.vae
import train_vae

from margins import at_least

# 48 images of 32 px; the "tiny" preset (factor 8: 4x4x4 latents), 60 fp32 steps of 8: a few seconds.
STEPS = 60
PSNR_GAIN_DB = 4.0  # measured: 5.7 dB -> 12.5 dB held-out PSNR over these 60 steps (+6.8)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    assert importlib.import_module("pipeline.00_make_demo_data").main(["--out", str(folder), "--count", "48", "--size", "32",
                                                 "--shard_size", "24"]) == 0
    return folder


def vae_argv(shards: Path, out: Path, *extra: str) -> list[str]:
    return ["--shards", str(shards / "*.tar"), "--out", str(out), "--preset", "tiny", "--resolution", "32",
            "--max_steps", str(STEPS), "--batch_size", "8", "--warmup_steps", "5", "--holdout", "8",
            "--precision", "fp32", "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def trained(shards, tmp_path_factory):
    """One run of main(): its output folder, the log it printed, and the weights it held when saving."""
    out = tmp_path_factory.mktemp("run") / "vae"
    held = {}
    real_save = sd.vae.save

    def spy(vae, folder, stats):
        held.update({name: tensor.clone() for name, tensor in vae.state_dict().items()})
        real_save(vae, folder, stats)

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    train_vae.log.addHandler(handler)
    level = train_vae.log.level
    train_vae.log.setLevel(logging.INFO)  # pytest's root handler makes main()'s basicConfig a no-op
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sd.vae, "save", spy)
            assert train_vae.main(vae_argv(shards, out)) == 0
    finally:
        train_vae.log.removeHandler(handler)
        train_vae.log.setLevel(level)
    return out, stream.getvalue(), held


@pytest.mark.learned
def test_reconstruction_improves_and_stats_match_the_log(trained):
    out, printed, _ = trained
    stats = json.loads((out / "vae_stats.json").read_text())
    assert stats["steps"] == STEPS and stats["images"] == 40
    at_least("held-out PSNR gain (dB)", stats["psnr_db"] - stats["psnr_db_start"], PSNR_GAIN_DB, stats)
    match = re.search(r"held-out PSNR ([\d.]+) dB \(([\d.]+) dB before training\), scaling factor ([\d.]+)", printed)
    assert match, printed
    assert float(match[1]) == stats["psnr_db"] and float(match[2]) == stats["psnr_db_start"]
    assert float(match[3]) == pytest.approx(stats["scaling_factor"], abs=5e-5)
    assert stats["scaling_factor"] == pytest.approx(1 / stats["latent_std"])


@pytest.mark.parametrize("count, held", [(12, 3), (3, 0)])
def test_a_few_images_hold_out_a_quarter_or_say_that_none_is_held_out(tmp_path, count, held, caplog):
    folder = tmp_path / "shards"
    assert importlib.import_module("pipeline.00_make_demo_data").main(["--out", str(folder), "--count", str(count),
                                                                     "--size", "32"]) == 0
    argv = vae_argv(folder, tmp_path / "vae", "--max_steps", "1", "--warmup_steps", "0", "--holdout", "64")
    with caplog.at_level(logging.INFO, logger="train_vae"):
        assert train_vae.main(argv) == 0
    stats = json.loads((tmp_path / "vae" / "vae_stats.json").read_text())
    assert (stats["held_out"], stats["images"]) == (held, count - held)
    if held:
        assert "held-out PSNR" in caplog.text
    else:
        assert "none held out" in caplog.text and "training-set PSNR" in caplog.text


def test_a_stopped_run_resumes_to_the_weights_of_an_uninterrupted_one_bit_for_bit(shards, tmp_path, capsys):
    from safetensors.torch import load_file

    def argv(out, *extra):
        return vae_argv(shards, out, "--max_steps", "6", "--save_steps", "2", *extra)

    assert train_vae.main(argv(tmp_path / "a")) == 0
    assert not sd.vae.resume_path(tmp_path / "a").parent.exists()  # removed once the VAE is saved
    assert train_vae.main(argv(tmp_path / "b", "--stop_at_step", "3")) == 0
    assert "stopped after step 3" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and sd.vae.resume_path(tmp_path / "b").exists()
    # Another setting than the saved state's is refused, naming it, and the state is kept.
    assert train_vae.main(argv(tmp_path / "b", "--batch_size", "4")) == 2
    assert "was saved with batch_size 8, not 4;" in capsys.readouterr().err  # the old value and the new
    assert train_vae.main(argv(tmp_path / "b")) == 0
    weights = "diffusion_pytorch_model.safetensors"
    a, b = load_file(tmp_path / "a" / weights), load_file(tmp_path / "b" / weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    stats_a, stats_b = (json.loads((tmp_path / r / "vae_stats.json").read_text()) for r in "ab")
    assert stats_a["psnr_db"] == stats_b["psnr_db"] and stats_a["psnr_db_start"] == stats_b["psnr_db_start"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_a_signal_saves_the_state_after_the_step_under_way_and_the_run_resumes_bit_for_bit(shards, tmp_path, capsys,
                                                                                          monkeypatch, signum):
    """Ctrl-C (or SIGTERM, the studio's stop) in step 3 of 6 with save_steps 100: once nothing was saved and the
    message promised a resume from "the last state saved"; now step 3 finishes, its state is saved, the exit
    status is 128 + the signal, and the resumed run ends with the uninterrupted run's weights bit for bit."""
    from safetensors.torch import load_file

    def argv(out):
        return vae_argv(shards, out, "--max_steps", "6", "--save_steps", "100")

    assert train_vae.main(argv(tmp_path / "a")) == 0
    real, calls = sd.vae.vae_loss, []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(sd.vae, "vae_loss", signalled)
        capsys.readouterr()
        assert train_vae.main(argv(tmp_path / "b")) == 128 + signum
    what = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert f"stopped by {what} after step 3 of 6; state saved to" in capsys.readouterr().err
    assert torch.load(sd.vae.resume_path(tmp_path / "b"), weights_only=True)["step"] == 3
    assert train_vae.main(argv(tmp_path / "b")) == 0
    weights = "diffusion_pytorch_model.safetensors"
    a, b = load_file(tmp_path / "a" / weights), load_file(tmp_path / "b" / weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_saving_prints_no_diffusers_float32_warning(shards, tmp_path, capfd):
    assert train_vae.main(vae_argv(shards, tmp_path / "vae", "--max_steps", "1", "--warmup_steps", "0")) == 0
    assert "should be kept in float32" not in capfd.readouterr().err


def test_ctrl_c_before_training_says_that_nothing_was_saved(shards, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sd.vae, "load_images", interrupted)
    assert train_vae.main(vae_argv(shards, tmp_path / "vae")) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "train_vae.py: interrupted (Ctrl-C) outside a training step; no training state was saved yet"


def test_a_damaged_saved_state_is_named_set_aside_and_training_starts_over(shards, tmp_path, caplog):
    state = sd.vae.resume_path(tmp_path / "vae")
    state.parent.mkdir()
    state.write_bytes(b"PK\x03\x04 not a torch file")
    with caplog.at_level(logging.WARNING, logger="train_vae"):
        assert train_vae.main(vae_argv(shards, tmp_path / "vae", "--max_steps", "2", "--warmup_steps", "0")) == 0
    assert f"{state} is damaged" in caplog.text and "training starts over" in caplog.text
    assert json.loads((tmp_path / "vae" / "vae_stats.json").read_text())["steps"] == 2
    assert not state.parent.exists()  # the run finished: the folder, the damaged file in it, is gone


def test_saved_folder_loads_in_diffusers_bit_for_bit(trained):
    from diffusers import AutoencoderKL

    out, _, held = trained
    vae = AutoencoderKL.from_pretrained(out)
    loaded = vae.state_dict()
    assert loaded.keys() == held.keys()
    assert all(torch.equal(loaded[name], held[name]) for name in held)
    assert vae.config.scaling_factor == pytest.approx(json.loads((out / "vae_stats.json").read_text())["scaling_factor"])
    # Nothing of the staging folder or the swapped-out old folder is left beside the result.
    assert sorted(p.name for p in out.parent.iterdir()) == ["vae"]


def test_a_failed_save_keeps_the_previous_folder_whole(trained, tmp_path):
    import shutil

    out, _, _ = trained
    target = tmp_path / "vae"
    shutil.copytree(out, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    class Broken:
        def save_pretrained(self, folder, **_):  # dies half way: one file written, then an error
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "config.json").write_text("{}")
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        sd.vae.save(Broken(), target, {"psnr_db": 0.0})
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vae"]  # no .vae.tmp left behind


def test_steps_is_a_hidden_alias_of_max_steps(shards, tmp_path, capsys):
    base = ["--shards", str(shards), "--out", str(tmp_path / "vae")]
    assert train_vae.parse_args(base + ["--steps", "7"]).max_steps == 7
    assert train_vae.parse_args(base + ["--max_steps", "9"]).max_steps == 9
    assert train_vae.parse_args(base).max_steps == 900
    with pytest.raises(SystemExit) as exit_info:
        train_vae.parse_args(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert re.search(r"^  --max_steps MAX_STEPS", help_text, re.M) and not re.search(r"^\s+--steps", help_text, re.M)


def test_an_abbreviated_flag_is_refused(shards, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_vae.main(["--shards", str(shards), "--out", str(tmp_path / "vae"), "--max_step", "5"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --max_step" in err
    assert not (tmp_path / "vae").exists()


@pytest.mark.parametrize("kind", ["missing", "empty", "not_shards"])
def test_a_bad_input_folder_is_one_line_naming_it(kind, tmp_path, capsys):
    folder = tmp_path / "input"
    if kind != "missing":
        folder.mkdir()
    if kind == "not_shards":
        (folder / "00000.tar").write_bytes(b"this is not a tar file")
    assert train_vae.main(["--shards", str(folder / "*.tar"), "--out", str(tmp_path / "vae"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train_vae.py: error: ") and str(folder) in err, err
    assert not (tmp_path / "vae").exists()


def test_init_from_a_vae_only_single_file_trains_on_from_its_weights(trained, shards, tmp_path):
    """A community VAE file (vae-ft-mse-840000-ema-pruned.safetensors: encoder.* / decoder.*) as train_vae.py's
    --init_from: its weights are the start, every one of them trains."""
    from safetensors.torch import save_file
    import sd.model
    import sd.original_layout

    out, _, held = trained
    vae = sd.model.load_vae(str(out))
    state = sd.original_layout.to_original(vae, sd.original_layout.vae_key_map(vae), half=False)
    save_file({k.removeprefix("first_stage_model."): v for k, v in state.items()}, tmp_path / "vae.safetensors")
    args = train_vae.parse_args(vae_argv(shards, tmp_path / "tuned", "--init_from", str(tmp_path / "vae.safetensors")))
    start = sd.vae.build_vae(args)
    assert all(torch.equal(start.state_dict()[name], held[name]) for name in held)
    assert all(p.requires_grad and not p.is_meta for p in start.parameters())
    assert train_vae.main(vae_argv(shards, tmp_path / "tuned", "--init_from", str(tmp_path / "vae.safetensors"),
                                   "--max_steps", "2")) == 0
    tuned = sd.model.load_vae(str(tmp_path / "tuned")).state_dict()
    assert any(not torch.equal(tuned[name], held[name]) for name in held)  # it trained on
