"""sd.train.config: flags, bools, numbers given as text, and ``extends`` chains of YAML files."""

import json
import logging
import math
import re
from pathlib import Path

import pytest
import yaml

import sd.run_folder
import sd.settings
import sd.train.config
import sd.train.config_loading
import SD_Train

ROOT = Path(__file__).resolve().parents[2]
from sd.train.config import ConfigError, canonical
from sd.train.config_loading import load_config


@pytest.fixture
def datasets(tmp_path):
    """One dataset entry whose folders exist (validation checks only that)."""
    for name in ("captions", "latents"):
        (tmp_path / "data" / name).mkdir(parents=True)
    return [{"dataset": str(tmp_path / "data" / "captions"), "latents": str(tmp_path / "data" / "latents")}]


def write_yaml(path: Path, **fields) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(fields))
    return path


@pytest.fixture
def base_config(tmp_path, datasets):
    return write_yaml(tmp_path / "base.yaml", datasets=datasets, max_steps=2, out_dir=str(tmp_path / "run"),
                      grad_checkpointing=True, compile=False)


# ------------------------------------------------------------------------------ flags


@pytest.mark.parametrize("flags", [["--min_lr", "1e-6"], ["--min_lr=1e-6"]])
def test_an_abbreviated_flag_is_refused_with_the_full_name(tmp_path, base_config, capsys, flags):
    assert SD_Train.main(["--config", str(base_config), *flags]) == 2
    err = capsys.readouterr().err
    assert "unknown config field 'min_lr' in the command line; did you mean 'optim.min_lr_ratio'?" in err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="did you mean 'optim.min_lr_ratio'"):
        load_config(["--config", str(base_config), *flags])


@pytest.mark.parametrize("fields, flags, shown", [
    ({"lora": {"rnak": 4}}, [], "unknown config field 'lora.rnak' in .*; did you mean 'lora.rank'"),
    ({"optim": {"lr": 1e-4}}, [], "'optim.lr' in .*; lr is a top-level field: write 'lr', not in optim:"),
    ({"lora": 4}, [], r"lora in .*: a section, written as a mapping of its fields \(lora: \{rank: ...\}"),
    ({}, ["--lora", "4"], "'lora' in the command line; lora is a section: give its fields, --lora.rank VALUE"),
    ({}, ["--lora_rnak", "4"], "'lora_rnak' in the command line; did you mean 'lora.rank'"),
])
def test_a_misplaced_or_misspelt_section_field_is_named_with_the_one_meant(tmp_path, datasets, fields, flags, shown):
    path = write_yaml(tmp_path / "c.yaml", datasets=datasets, max_steps=2, **fields)
    with pytest.raises(ConfigError, match=shown):
        load_config(["--config", str(path), *flags], check_paths=False)


@pytest.mark.parametrize("flags, grad_checkpointing, compile", [
    (["--grad_checkpointing", "false"], False, False),
    (["--grad_checkpointing", "0"], False, False),
    (["--grad_checkpointing", "no", "--compile"], False, True),
    (["--compile", "--grad_checkpointing", "False"], False, True),
    (["--compile", "true"], True, True),
    (["--compile", "1"], True, True),
    (["--compile", "off"], True, False),
])
def test_bool_flags_take_an_optional_word(base_config, flags, grad_checkpointing, compile):
    config = load_config(["--config", str(base_config), *flags])
    assert (config.grad_checkpointing, config.compile) == (grad_checkpointing, compile)


def test_a_bare_bool_flag_turns_the_field_on(tmp_path, datasets):
    off = write_yaml(tmp_path / "off.yaml", datasets=datasets, max_steps=2, grad_checkpointing=False, compile=False)
    plain = load_config(["--config", str(off)])
    assert (plain.grad_checkpointing, plain.compile) == (False, False)
    for flags in (["--grad_checkpointing"], ["--compile", "--grad_checkpointing"],
                  ["--grad_checkpointing", "--compile"]):
        config = load_config(["--config", str(off), *flags])
        assert config.grad_checkpointing is True, flags
        assert config.compile is ("--compile" in flags), flags


def test_a_bool_flag_refuses_other_words(base_config):
    with pytest.raises(ConfigError, match="grad_checkpointing: expected bool, got 'maybe'"):
        load_config(["--config", str(base_config), "--grad_checkpointing", "maybe"])


@pytest.mark.parametrize("flag, text, value, kind", [
    ("--lr", "3e-4", 3e-4, float),
    ("--lr", "1", 1.0, float),
    ("--min_lr_ratio", "0.5", 0.5, float),
    ("--max_steps", "10", 10, int),
    ("--max_steps", "1e2", 100, int),
    ("--batch_size", "7", 7, int),
])
def test_numbers_on_the_command_line_take_the_fields_type(base_config, flag, text, value, kind):
    config = load_config(["--config", str(base_config), flag, text])
    got = getattr(config, flag[2:])
    assert got == value and type(got) is kind


@pytest.mark.parametrize("flag, text", [("--max_steps", "1.5"), ("--batch_size", "two"), ("--lr", "fast")])
def test_numbers_of_the_wrong_kind_are_refused(base_config, flag, text):
    kind = sd.train.config.kind_of(sd.train.config.FIELDS[canonical(flag[2:])])
    # A number-like text is shown as the number it read as (1.5), other text quoted ('two').
    with pytest.raises(ConfigError, match=rf"^{canonical(flag[2:])}: expected {kind}, got '?{re.escape(text)}'?$"):
        load_config(["--config", str(base_config), flag, text])


def test_yaml_exponent_without_a_dot_is_a_float(tmp_path, datasets):
    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump({"datasets": datasets, "max_steps": 2}) + "lr: 1e-6\n")
    assert yaml.safe_load(path.read_text())["lr"] == "1e-6"  # what PyYAML gives
    config = load_config(["--config", str(path)])
    assert config.lr == 1e-6 and type(config.lr) is float


# ------------------------------------------------------------------------------ extends


def test_extends_takes_the_base_and_the_own_fields_win(tmp_path, datasets, monkeypatch):
    write_yaml(tmp_path / "configs" / "base.yaml", datasets=datasets, max_steps=2, lr=1e-4, batch_size=3,
               warmup_steps=7, cfg_dropout=0.1)
    write_yaml(tmp_path / "configs" / "mid" / "middle.yaml", extends="../base.yaml", lr=2e-4, warmup_steps=5)
    phase = write_yaml(tmp_path / "configs" / "mid" / "phase.yaml", extends="middle.yaml", lr=3e-4)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # extends is relative to the file, not the working folder
    config = load_config(["--config", str(phase)])
    assert (config.lr, config.warmup_steps, config.batch_size, config.cfg_dropout) == (3e-4, 5, 3, 0.1)
    assert config.datasets == datasets
    flagged = load_config(["--config", str(phase), "--lr", "5e-4", "--batch_size", "4"])
    assert (flagged.lr, flagged.warmup_steps, flagged.batch_size) == (5e-4, 5, 4)


def test_extends_a_missing_file_names_it(tmp_path, datasets):
    phase = write_yaml(tmp_path / "phase.yaml", extends="nope/base.yaml", datasets=datasets, max_steps=2)
    with pytest.raises(ConfigError) as error:
        load_config(["--config", str(phase)])
    assert str(error.value) == f"config file {tmp_path / 'nope' / 'base.yaml'} does not exist"


@pytest.mark.parametrize("chain", [["a.yaml"], ["a.yaml", "b.yaml"], ["a.yaml", "b.yaml", "c.yaml"]])
def test_an_extends_loop_is_an_error_naming_the_file(tmp_path, datasets, chain):
    for name, target in zip(chain, chain[1:] + chain[:1]):
        write_yaml(tmp_path / name, extends=target, datasets=datasets, max_steps=2)
    with pytest.raises(ConfigError) as error:
        load_config(["--config", str(tmp_path / chain[0])])
    assert str(error.value) == f"{tmp_path / chain[0]}: 'extends' loops back to itself"


# ------------------------------------------------------------------------------ numeric ranges

# Every numeric field: (what is allowed, values just inside, values outside besides inf and nan).
RANGES = {
    "epoch_size": (">= 0", [0, 1000], [-1]),
    "data_threads": (">= 1", [1], [0, -2]),
    "batch_size": (">= 0", [0, 1, 64], [-1, -8]),  # 0: auto
    "grad_accum": (">= 1", [1], [0]),
    "clip_skip": (">= 1", [1, 2], [0, -1]),  # above the text encoder's layers: refused when it is loaded
    "global_batch": (">= 0", [0, 96], [-1]),
    "max_steps": (">= 0", [0, 5], [-1]),
    "epochs": (">= 0", [0, 3], [-1]),
    "lr": ("> 0 and finite", [1e-12, 10.0], [0.0, -1e-5]),
    "warmup_steps": (">= 0", [0], [-1]),
    "text_encoder_lr": (">= 0 and finite", [0.0], [-1e-5]),  # > 0 needs lora_text_encoder: test_text_encoder_...
    "text_encoder_warmup_steps": (">= -1", [-1], [-2]),
    "min_lr_ratio": ("in [0, 1]", [0.0, 1.0], [-0.01, 1.01]),
    "posthoc_ema_every": (">= 0", [0, 1000], [-1]),
    "embedding_lr": (">= 0 and finite", [0.0], [-1e-5]),  # > 0 needs pivotal tuning: test_pivotal_settings_...
    "embedding_train_fraction": ("in (0, 1]", [1.0], [0.0, 1.5]),  # < 1 likewise
    "lora_factor": (">= -1", [-1], [-2]),  # > 0 needs lora_type lokr: test_optimizer_and_learning_rate_settings...
    "down_lr_scale": ("> 0 and finite", [1e-3, 1.0, 10.0], [0.0, -1.0]),
    "mid_lr_scale": ("> 0 and finite", [1e-3, 1.0, 10.0], [0.0, -1.0]),
    "up_lr_scale": ("> 0 and finite", [1e-3, 1.0, 10.0], [0.0, -1.0]),
    "weight_decay": (">= 0 and finite", [0.0, 5.0], [-1e-3]),
    "adam_beta1": ("in [0, 1)", [0.0, 0.999], [1.0, 5.0, -0.1]),
    "adam_beta2": ("in [0, 1)", [0.0, 0.9999], [1.0, -0.5]),
    "adam_eps": ("> 0 and finite", [1e-30, 1.0], [0.0, -1e-8]),
    "grad_clip": (">= 0 and finite", [0.0, 100.0], [-1.0]),
    "min_snr_gamma": (">= 0 and finite", [0.0, 20.0], [-5.0]),
    "flow_logit_mean": ("in [-10, 10]", [0.0], [-11.0, 10.5]),  # != 0 needs flow: test_flow_settings_are_checked...
    "flow_logit_std": ("in (0, 10]", [1.0], [0.0, 11.0]),
    "flow_shift": ("in [0.1, 10]", [1.0], [0.05, 12.0]),
    "huber_c": ("in (0, 1)", [0.001, 0.999], [0.0, 1.0, -0.1]),
    "huber_scale": ("> 0 and finite", [0.5, 4.0], [0.0, -1.0]),
    "cfg_dropout": ("in [0, 1)", [0.0, 0.99], [1.0, -0.1]),
    "shuffle_tags": ("in [0, 1]", [0.0, 0.5, 1.0], [1.01, -0.1]),
    "keep_tokens": (">= 0", [0, 3], [-1]),
    "tag_dropout": ("in [0, 1]", [0.0, 1.0], [1.5, -0.1]),
    "ema_decay": ("in [0, 1)", [0.0, 0.99999], [1.0, 1.5, -0.1]),
    "ema_update_every": (">= 0", [0, 1], [-1]),  # 0: auto
    "max_bad_steps": (">= 1", [1], [0]),
    "save_steps": (">= 1", [1], [0]),
    "keep_checkpoints": (">= 2", [2], [1, 0]),
    "keep_every_steps": (">= 0", [0], [-1]),
    "stop_at_step": (">= 0", [0, 1], [-1]),
    "log_every": (">= 1", [1], [0]),
    "validate_every": (">= 0", [0], [-1]),
    "validation_samples": (">= 1", [1], [0]),
    "validation_data_captions": (">= 0", [0, 4], [-1]),
    "validation_steps": (">= 1", [1], [0]),
    "validation_cfg": (">= 0 and finite", [0.0, 1.0, 30.0], [-1.0]),
    "seed": ("in [0, 4294967295]", [0, 2**32 - 1], [-1, 2**32]),
    "lora_rank": (">= 0", [0], [-1]),
    "lora_alpha": (">= 0 and finite", [0.0, 16.0], [-1.0]),
    "lora_conv_rank": (">= 0", [0], [-1]),  # > 0 needs lora_rank: tests/integration/test_lora_files.py
    "lora_conv_alpha": (">= 0 and finite", [0.0], [-1.0]),
    "lora_dropout": ("in [0, 1)", [0.0, 0.5], [1.0, -0.1]),
    "num_class_images": (">= 0", [0, 200], [-1]),
    "embedding_vectors": (">= 1", [1, 75], [0]),
    "lcm_solver_steps": ("in [1, 1000]", [1, 50, 1000], [0, 1001]),
    "lcm_guidance_min": ("in [1, 30]", [1.0, 3.0], [0.5, 31.0]),
    "lcm_guidance_max": ("in [1, 30]", [1.0, 30.0], [0.0, 30.5]),
    "lcm_huber_c": ("> 0 and finite", [0.001], [0.0, -1.0]),
    "lcm_timestep_scaling": ("> 0 and finite", [10.0], [0.0]),
    "lcm_target_decay": ("in [0, 1)", [0.0, 0.95], [1.0, -0.1]),
    "preference.beta": ("> 0 and finite", [0.1, 2500.0], [0.0, -1.0]),
    "dmd.steps": ("in [1, 4]", [1, 4], [0, 5]),
    "dmd.guidance": ("in [1, 30]", [1.0, 1.75, 30.0], [0.5, 31.0]),
    "dmd.fake_updates": ("in [1, 100]", [1, 10, 100], [0, 101]),
    "dmd.fake_lr": (">= 0 and finite", [0.0, 1e-5], [-1e-5]),
    "dmd.gan_weight": (">= 0 and finite", [0.0, 1e-3], [-1.0]),
    "dmd.critic_weight": ("> 0 and finite", [1e-2], [0.0, -1.0]),
    "dmd.min_step": ("in [0, 999]", [0, 20], [-1, 1000]),
    "dmd.max_step": ("in [0, 999]", [980, 999], [-1, 1000]),
    "prior_loss_weight": (">= 0 and finite", [0.0, 1.0], [-1.0]),
    "control_dropout": ("in [0, 1]", [0.0], [1.5, -0.1]),  # > 0 needs control: test_controlnet_fields_need_control
    "noise_offset": (">= 0 and finite", [0.0, 0.1], [-0.1]),
    "image_size": (">= 8", [8, 512], [0, -8]),
    "validation_width": (">= 0", [0], [-8]),  # a size other than 0 needs its partner: tests/integration/test_buckets.py
    "validation_height": (">= 0", [0], [-8]),
    "eval_every": (">= 0", [0], [-1]),  # > 0 needs eval_prompts and eval_reference: tests/integration/test_sd_eval.py
    "eval_n": (">= 1", [1, 30000], [0, -1]),
    "eval_batch_size": (">= 1", [1], [0]),
}


def test_every_numeric_field_has_a_range_here():
    numeric = {name for name, f in sd.train.config.FIELDS.items() if sd.train.config.kind_of(f) in ("int", "float")}
    assert numeric == {canonical(name) for name in RANGES}


def out_of_range_cases():
    for name, (allowed, _, bad) in RANGES.items():
        kind = sd.train.config.kind_of(sd.train.config.FIELDS[canonical(name)])
        for value in bad + ([math.inf, -math.inf, math.nan] if kind == "float" else []):
            yield pytest.param(name, value, allowed, id=f"{name}={value}")


@pytest.mark.parametrize("name, value, allowed", out_of_range_cases())
def test_a_value_out_of_range_is_refused_naming_field_value_and_range(base_config, tmp_path, name, value, allowed):
    base = yaml.safe_load(base_config.read_text())
    path = write_yaml(tmp_path / "bad.yaml", **{**base, name: value})  # inf and nan are written .inf and .nan
    with pytest.raises(ConfigError) as error:
        load_config(["--config", str(path)])
    message = str(error.value)
    assert message.startswith(f"{canonical(name)} must be {allowed}, got {value!r} (")
    assert "\n" not in message
    with pytest.raises(ConfigError) as flagged:  # the same on the command line (= keeps -1e-05 a value)
        load_config(["--config", str(base_config), f"--{name}={value}"])
    assert str(flagged.value) == message


@pytest.mark.parametrize("name, value", [pytest.param(n, v, id=f"{n}={v}") for n, (_, good, _) in RANGES.items()
                                         for v in good])
def test_the_ends_of_each_range_are_accepted(base_config, name, value):
    config = load_config(["--config", str(base_config), f"--{name}", str(value)])
    assert sd.train.config.value_of(config, canonical(name)) == value


@pytest.mark.parametrize("name, text", [("max_steps", ".inf"), ("batch_size", ".nan"), ("seed", "1e400")])
def test_an_integer_field_refuses_inf_and_nan_as_not_an_integer(base_config, tmp_path, name, text):
    path = tmp_path / "c.yaml"
    path.write_text(base_config.read_text() + f"{name}: {text}\n")
    with pytest.raises(ConfigError, match=rf"^{name}: expected int, got (inf|nan)$"):
        load_config(["--config", str(path)])


@pytest.mark.parametrize("text", [".inf", ".Inf", "inf", "1e400", ".nan", "nan", "-.inf"])
def test_yaml_spellings_of_inf_and_nan_are_refused_for_lr(base_config, tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(base_config.read_text() + f"lr: {text}\n")
    with pytest.raises(ConfigError, match=r"^lr must be > 0 and finite, got -?(inf|nan) \(peak learning rate\)$"):
        load_config(["--config", str(path)])


@pytest.mark.parametrize("flags, shown", [(["--lr", "inf"], "lr must be > 0 and finite, got inf"),
                                          (["--lr", "nan"], "lr must be > 0 and finite, got nan"),
                                          (["--adam_beta1", "5"], "optim.adam_beta1 must be in [0, 1), got 5.0"),
                                          (["--optim.weight_decay=-inf"],
                                           "optim.weight_decay must be >= 0 and finite, got -inf")])
def test_the_trainer_stops_with_a_config_error_before_any_work(base_config, tmp_path, capsys, flags, shown):
    assert SD_Train.main(["--config", str(base_config), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"SD_Train.py: config error: {shown} (") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("weight, shown", [(math.inf, "inf"), (math.nan, "nan"), (0, "0"), (-1.0, "-1.0"),
                                           (True, "True"), ("heavy", "'heavy'"), ("1e400", "'1e400'")])
def test_a_dataset_weight_must_be_finite_and_positive(tmp_path, datasets, weight, shown):
    path = write_yaml(tmp_path / "w.yaml", datasets=[{**datasets[0], "weight": weight}], max_steps=2)
    with pytest.raises(ConfigError) as error:
        load_config(["--config", str(path)])
    assert str(error.value).startswith(f"datasets[0].weight must be > 0 and finite, got {shown} (")


def test_a_dataset_weight_written_1e_3_is_a_number(tmp_path, datasets):
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"datasets": [datasets[0]], "max_steps": 2}).replace(
        "datasets:\n-", "datasets:\n- weight: 1e-3\n "))
    assert load_config(["--config", str(path)]).datasets[0]["weight"] == "1e-3"  # build_data reads it as 0.001


@pytest.mark.parametrize("fields, message", [
    ({"lr": "fast"}, "lr: expected float, got 'fast'"),
    ({"batch_size": 2.0}, "batch_size: expected int, got 2.0"),
    ({"compile": "yes"}, "compile: expected bool, got 'yes'"),
    ({"compile_mode": "fast"}, "compile_mode: one of default, max-autotune-no-cudagraphs, reduce-overhead, "
                               "max-autotune"),
    ({"max_steps": True}, "max_steps: expected int, got True"),
    ({"attention": "xformers"}, "attention: one of auto, cudnn, flash, efficient, math"),
    ({"bf16_weights": True, "precision": "fp32", "sharding": "zero1"}, "optim.bf16_weights: runs with precision: bf16 "
     "(got fp32), sharding: none (got zero1); set those, or optim.bf16_weights: false"),
    ({"vae": ""}, "vae must not be empty"),
])
def test_a_config_built_in_code_is_checked_like_a_yaml(datasets, fields, message):
    config = sd.train.config.TrainConfig(**{"datasets": datasets, "max_steps": 2, **fields})
    with pytest.raises(ConfigError) as error:
        config.validate()
    assert str(error.value) == message


# ------------------------------------------------------------------------------ init_from a run of ours


def saved_run(tmp_path, **fields) -> Path:
    """A run folder as SD_Train.py leaves it: its config.yaml (the weights are not read here)."""
    run = tmp_path / "mine"
    config = sd.train.config.TrainConfig(datasets=[], out_dir=str(run), **fields)
    run.mkdir()
    (run / "config.yaml").write_text(sd.train.config.config_yaml(config))
    return run


def test_init_from_a_run_takes_its_model_unless_the_config_names_it(tmp_path, base_config):
    run = saved_run(tmp_path, unet="tiny", vae="tiny", text_encoder="tiny", tokenizer="tiny")
    config = load_config(["--config", str(base_config), "--init_from", str(run)])
    assert (config.unet, config.vae, config.text_encoder, config.tokenizer) == ("tiny", "tiny", "tiny", "tiny")
    # A checkpoint folder of the run has its own config.yaml: the same holds.
    checkpoint = run / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.yaml").write_text((run / "config.yaml").read_text())
    assert load_config(["--config", str(base_config), "--init_from", str(checkpoint)]).unet == "tiny"
    # Named and equal: fine. A hub id or a folder without config.yaml inherits nothing.
    assert load_config(["--config", str(base_config), "--init_from", str(run), "--unet", "tiny"]).unet == "tiny"
    assert load_config(["--config", str(base_config), "--init_from", str(tmp_path / "data")]).unet == "sd1"


def test_init_from_a_run_of_another_model_is_one_line_naming_both(tmp_path, base_config, capsys):
    run = saved_run(tmp_path, unet="tiny", text_encoder="tiny")
    assert SD_Train.main(["--config", str(base_config), "--init_from", str(run), "--unet", "demo"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "unet: this config names 'demo', but init_from" in err and "trained with 'tiny'" in err
    assert "leave unet out" in err


def test_docs_config_md_is_the_reference_generated_from_the_fields():
    from sd.train.config import FIELDS
    from sd.train.config_docs import groups, reference_markdown

    names = [name for _, _, group in groups() for name in group]
    assert sorted(names) == sorted(FIELDS) and len(names) == len(set(names))  # every field, in one group
    text = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    assert text == reference_markdown(), "docs/config.md is out of date: run make docs"
    for name in FIELDS:
        assert text.count(f"| `{name}` |") == 1


def test_global_batch_keeps_the_curriculums_96_images_per_step_on_any_number_of_gpus():
    from sd.train.config import ConfigError
    from sd.train.config_loading import load_config, resolve_global_batch

    phase1 = load_config(["--config", "configs/phases/p1_laion_broad.yaml"], check_paths=False)
    assert (phase1.global_batch, phase1.batch_size) == (96, 24)
    assert resolve_global_batch(phase1, 2).grad_accum == 2 and resolve_global_batch(phase1, 4).grad_accum == 1
    assert resolve_global_batch(phase1, 1).grad_accum == 4
    with pytest.raises(ConfigError) as error:  # 24 x 8 = 192 per micro-step: 96 cannot be made, and it says so
        resolve_global_batch(phase1, 8)
    assert str(error.value) == (
        "global_batch 96 is not a whole number of steps of batch_size 24 on 8 GPU(s) (192 images each): use "
        "batch_size 12 (grad_accum 1) or global_batch 192 with lr 2e-05 (the linear scaling rule; the recipe's lr "
        "is for 96)")
    twelve = resolve_global_batch(load_config(["--config", "configs/phases/p1_laion_broad.yaml", "--batch_size",
                                               "12"], check_paths=False), 8)
    assert twelve.batch_size * twelve.grad_accum * 8 == 96
    unset = load_config(["--config", "configs/finetune/lora.yaml"], check_paths=False)
    assert unset.global_batch == 0 and resolve_global_batch(unset, 8) == unset  # grad_accum as given


# What a resume does with each changed field, by either of its names: the literal lists here are the contract (a new
# field declares its rule where it is declared, and moving one between lists changes this test).
RESUME_WARNED = {"ema_decay", "ema_update_every", "precision", "keep_best"}
RESUME_FREE = {
    "data_threads", "mmap_latents", "allow_missing_latents", "init_from", "cache_text_embeddings", "ema_device",
    "ema_warmup", "grad_checkpointing", "channels_last", "compile", "compile_mode", "attention", "bf16_weights", "max_bad_steps", "fsdp_reduce_each_micro_batch", "out_dir", "save_steps",
    "save_every_epoch", "keep_checkpoints", "keep_every_steps", "stop_at_step", "log_every", "validate_every",
    "validation_prompts", "validation_data_captions", "validation_samples", "validation_steps", "validation_cfg", "validation_sampler", "validation_width",
    "validation_height", "eval_every", "eval_prompts", "eval_n", "eval_reference", "eval_features",
    "eval_clip_model", "eval_batch_size", "wandb_project", "wandb_mode", "tensorboard", "device", "sharding",
    "controlnet_from", "validation_controls"}
RESUME_DREAMBOOTH_ONLY = {"vae", "instance_prompt", "class_dir", "class_prompt", "num_class_images", "image_size",
                          "prior_loss_weight"}


def another_value(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, list):
        return value + ["x"]
    return value + "_other"


def test_every_field_has_a_resume_rule():
    assert all(isinstance(f.metadata["resume"], sd.settings.OnResume) for f in sd.train.config.FIELDS.values())


def saved_with(config, name: str, value) -> dict:
    """``config`` as its config.yaml holds it, with the field ``name`` (dotted) set to ``value``."""
    saved = yaml.safe_load(sd.train.config.config_yaml(config))
    section, _, field = name.rpartition(".")
    (saved[section] if section else saved)[field] = value
    return saved


@pytest.mark.parametrize("name", sorted(sd.train.config.FIELDS))
@pytest.mark.parametrize("dreambooth", [False, True])
def test_a_changed_field_on_resume_is_refused_warned_or_free_by_its_rule(name, dreambooth):
    config = sd.train.config.TrainConfig(instance_dir="instances" if dreambooth else "")
    old = another_value(sd.train.config.value_of(config, name))
    refused, warned = sd.train.config.resume_changes(saved_with(config, name, old), config)
    either = {name, sd.train.config.FLAT_NAMES.get(name)}
    if either & RESUME_FREE or (either & RESUME_DREAMBOOTH_ONLY and not dreambooth):
        assert (refused, warned) == ([], [])
    elif either & RESUME_WARNED:
        assert refused == [] and len(warned) == 1 and warned[0].startswith(f"{name}: {old!r} -> ")
    else:
        assert warned == [] and len(refused) == 1
        assert refused[0].startswith(f"{name}: {old!r} -> {sd.train.config.value_of(config, name)!r} (it fixes ")


def test_a_field_newer_than_the_checkpoint_compares_with_its_default():
    config = sd.train.config.TrainConfig()
    saved = dict(yaml.safe_load(sd.train.config.config_yaml(config)))
    del saved["loss"]["noise_offset"]
    assert sd.train.config.resume_changes(saved, config) == ([], [])
    refused, _ = sd.train.config.resume_changes(saved, sd.train.config.TrainConfig(noise_offset=0.1))
    assert refused == ["loss.noise_offset: 0.0 -> 0.1 (it fixes the training math)"]
    flat = {"noise_offset": 0.0, **{k: v for k, v in saved.items() if not isinstance(v, dict)}}  # a run of before
    refused, _ = sd.train.config.resume_changes(sd.run_folder.in_sections(flat), sd.train.config.TrainConfig(
        noise_offset=0.1))
    assert refused == ["loss.noise_offset: 0.0 -> 0.1 (it fixes the training math)"]


def test_a_yaml_alias_bomb_is_refused_at_once_and_ordinary_aliases_still_work(tmp_path):
    levels = ['a: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    levels += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    body = "\n".join("  - " + line.split(": ", 1)[1] for line in levels)  # 9^9 values under one field
    bomb.write_text(f"unet: tiny\nvalidation_prompts:\n{body}\nout_dir: *l8\n")
    assert bomb.stat().st_size < 600
    with pytest.raises(ConfigError, match=rf"{re.escape(str(bomb))}: its aliases \(\*name\) expand to more than "
                                          r"100000 values; write the values out"):
        load_config(["--config", str(bomb)], check_paths=False)
    flag = "[&b0 [x, x, x, x, x, x, x, x, x, x]" + "".join(
        f", &b{i} [{', '.join([f'*b{i - 1}'] * 10)}]" for i in range(1, 6)) + "]"  # 10^6 values on a command line
    with pytest.raises(ConfigError, match="lora.targets: its aliases"):
        load_config(["--unet", "tiny", "--lora_targets", flag], check_paths=False)
    fine = tmp_path / "fine.yaml"
    fine.write_text("unet: tiny\nvalidation_prompts: [&p 'a red circle', *p]\n")
    assert load_config(["--config", str(fine)], check_paths=False).validation_prompts == ["a red circle"] * 2


def test_ema_update_every_auto_spaces_a_whole_unets_host_ema_of_a_gpu_run():
    import dataclasses

    import torch

    import sd.train.step

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    auto = load_config(["--unet", "tiny", "--ema_update_every", "auto", "--ema_device", "cpu"], check_paths=False)
    assert auto.ema_update_every == 0 and load_config(["--unet", "tiny"], check_paths=False).ema_update_every == 0
    assert sd.train.step.ema_update_every(auto, cuda, part=False) == 10
    assert sd.train.step.ema_update_every(auto, cuda, part=True) == 1  # an adapter's copy is small
    assert sd.train.step.ema_update_every(auto, cpu, part=False) == 1  # nothing to copy off a device
    on_device = dataclasses.replace(auto, ema_device="same")
    assert sd.train.step.ema_update_every(on_device, cuda, part=False) == 1
    assert sd.train.step.ema_update_every(dataclasses.replace(auto, ema_update_every=3), cuda, part=False) == 3


@pytest.mark.parametrize("flags, shown", [
    (["--sharding", "zero3"], "sharding: none, zero1 or fsdp, got 'zero3'"),
    (["--sharding", "zero1", "--lora_rank", "4", "--init_from", "runs/x"],
     "sharding: zero1 splits a full fine-tune's state; a LoRA adapter is a few MB that every GPU holds whole: set "
     "sharding: none, or lora.rank: 0"),
    (["--sharding", "fsdp", "--optimizer", "adamw8bit"], "sharding: fsdp splits torch's AdamW state; set optim.name: "
     "adamw (adamw8bit's state is already a quarter of the size; prodigy and adamw_schedulefree run unsharded), or "
     "sharding: none"),
    (["--sharding", "zero1", "--optimizer", "prodigy", "--lr", "1"], "sharding: zero1 splits torch's AdamW state; "
     "set optim.name: adamw"),
    (["--sharding", "fsdp", "--optimizer", "adamw_schedulefree"], "sharding: fsdp splits torch's AdamW state; set "
     "optim.name: adamw"),
    (["--sharding", "fsdp", "--precision", "fp16"], "sharding: fsdp runs precision bf16 or fp32"),
    (["--sharding", "fsdp", "--channels_last"], "sharding: fsdp needs contiguous weights"),
    (["--sharding", "fsdp", "--eval_every", "10"], "sharding: fsdp does not run the in-training evaluation"),
])
def test_sharding_refuses_what_it_cannot_run_naming_the_way_out(base_config, flags, shown):
    with pytest.raises(ConfigError) as error:
        load_config(["--config", str(base_config), *flags], check_paths=False)
    assert str(error.value).startswith(shown)


LORA_TEXT = ["--lora_rank", "4", "--lora_text_encoder", "--init_from", "runs/x"]


@pytest.mark.parametrize("flags, shown", [
    (["--text_encoder_lr", "1e-4"], "optim.text_encoder_lr / optim.text_encoder_warmup_steps set the learning rate of the text "
     "encoder's LoRA adapter: set lora.text_encoder: true"),
    (["--text_encoder_warmup_steps", "0"], "optim.text_encoder_lr / optim.text_encoder_warmup_steps set the learning rate"),
    (["--optimizer", "prodigy"], "optim.name: prodigy estimates the step size itself and lr multiplies it: set lr: 1.0 "
     "(got 1e-05;"),
    (["--optimizer", "prodigy", "--lr", "20"], "optim.name: prodigy estimates the step size itself"),
    (["--optimizer", "prodigy", "--lr", "1", *LORA_TEXT, "--text_encoder_lr", "0.5"],
     "optim.name: prodigy steps every parameter group with one learning rate"),
    (["--optimizer", "prodigy", "--lr", "1", *LORA_TEXT, "--warmup_steps", "5", "--text_encoder_warmup_steps", "0"],
     "optim.name: prodigy steps every parameter group with one learning rate"),
    (["--optimizer", "adamw_schedulefree", "--adam_beta1", "0"], "optim.name: adamw_schedulefree interpolates with "
     "optim.adam_beta1"),
    (["--posthoc_ema_every", "10", "--sharding", "fsdp"], "ema.posthoc_every: the post-hoc EMAs hold whole weights"),
    (["--posthoc_ema_every", "10", "--embedding_token", "<x>", "--embedding_init", "dog", "--init_from", "runs/x"],
     "ema.posthoc_every: averages what trains in the UNet, which a learned token's run leaves frozen"),
    (["--lora_type", "dora"], "lora.type: one of lora, loha, lokr, got 'dora'"),
    (["--lora_type", "loha"], "lora.type: loha sets the adapter of a run with lora.rank > 0"),
    (["--dora"], "lora.dora: true sets the adapter of a run with lora.rank > 0: set lora.rank, or lora.dora: false"),
    (["--lora_factor", "4", *LORA_TEXT], "lora.factor sets a lokr adapter's factors (got lora.type: lora)"),
    (["--lora_type", "loha", "--lora_dropout", "0.1", *LORA_TEXT], "lora.dropout drops a LoRA's input; a loha"),
    (["--keep_best", "loss"], "keep_best: '', 'fid', 'clip_score', got 'loss'"),
    (["--keep_best", "fid"], "keep_best: fid ranks the checkpoints by the in-training evaluation: set eval.every"),
    (["--keep_best", "clip_score", "--eval_every", "5", "--eval_prompts", "p.txt", "--eval_reference", "ref",
      "--eval_clip_model", ""], "keep_best: clip_score needs the CLIP score: set eval.clip_model"),
    (["--optimizer", "prodigy", "--lr", "1", "--up_lr_scale", "2"], "optim.name: prodigy steps every parameter group "
     "with one learning rate: set optim.up_lr_scale to 1"),
    (["--down_lr_scale", "0.5", "--mid_lr_scale", "2", "--embedding_token", "<x>", "--init_from", "runs/x"],
     "optim.down_lr_scale, optim.mid_lr_scale scale the learning rate of the UNet's blocks, which a learned token run leaves "
     "frozen: set optim.down_lr_scale and optim.mid_lr_scale to 1"),
    (["--optimizer", "sgd"], "optim.name: one of adamw, adamw8bit, prodigy, adamw_schedulefree"),
])
def test_optimizer_and_learning_rate_settings_that_cannot_work_are_refused(base_config, flags, shown):
    with pytest.raises(ConfigError) as error:
        load_config(["--config", str(base_config), *flags], check_paths=False)
    assert str(error.value).startswith(shown)


@pytest.mark.parametrize("flags", [
    [*LORA_TEXT, "--text_encoder_lr", "1e-4", "--text_encoder_warmup_steps", "0"],
    ["--optimizer", "prodigy", "--lr", "1", *LORA_TEXT, "--text_encoder_lr", "1", "--text_encoder_warmup_steps", "500"],
    ["--optimizer", "prodigy", "--lr", "0.5"],
    ["--optimizer", "adamw_schedulefree", "--lr", "1e-3"],
    ["--optimizer", "adamw_schedulefree", "--lr", "1e-3", "--down_lr_scale", "0.1", "--up_lr_scale", "3"],
    [*LORA_TEXT, "--mid_lr_scale", "0.5"],
])
def test_the_optimizers_and_a_text_encoder_schedule_that_can_work_load(base_config, flags):
    assert load_config(["--config", str(base_config), *flags], check_paths=False).optimizer in (
        "adamw", "prodigy", "adamw_schedulefree")


@pytest.mark.parametrize("sharding", ["none", "zero1", "fsdp"])
def test_every_sharding_of_a_full_fine_tune_is_accepted(base_config, sharding):
    assert load_config(["--config", str(base_config), "--sharding", sharding]).sharding == sharding


def test_each_components_view_of_the_config_reads_fields_the_config_has_and_copies_them():
    """A view whose field the config does not have (renamed there) would keep its default silently."""
    import dataclasses

    import sd.data.dreambooth
    import sd.data.training_data
    import sd.evaluation
    import sd.lora.adapters
    import sd.train.objectives
    from sd.train.config import FIELDS, TrainConfig

    config = TrainConfig(datasets=[{"dataset": "d", "latents": "l"}], lora_rank=8, lora_alpha=4.0, class_dir="c",
                         instance_dir="i", eval_n=7, validation_steps=12, shuffle_tags=0.5, keep_tokens=2, seed=9,
                         flip=True, precision="fp32")
    views = (sd.data.dreambooth.DreamBoothSettings, sd.data.training_data.DataSettings, sd.evaluation.EvalSettings,
             sd.lora.adapters.LoraSettings, sd.train.objectives.LossSettings)
    for view in views:
        names = {f.name for f in dataclasses.fields(view)} - {"caption_ops", "prior_preservation",
                                                               "rejected"}  # rejected: preference.method is dpo
        assert names <= set(FIELDS) | set(sd.run_folder.LEGACY_KEYS), (view.__name__, names - set(FIELDS))
        made = view.from_config(config)
        for name in names:
            expected = config.sampler if name == "validation_sampler" else getattr(config, name)  # auto resolved
            assert getattr(made, name) == (tuple(expected) if name == "datasets" else expected), (view.__name__, name)
    data = sd.data.training_data.DataSettings.from_config(config)
    assert (data.caption_ops.shuffle_tags, data.caption_ops.keep_tokens) == (0.5, 2)
    assert sd.train.objectives.LossSettings.from_config(config).prior_preservation


def test_the_controlnet_recipes_placeholder_control_image_is_checked_only_when_a_grid_is_drawn(tmp_path):
    """configs/finetune/controlnet.yaml names the user's own validation image, which a run without a sample grid
    never reads."""
    from sd.train.config_loading import load_config

    (tmp_path / "captions").mkdir()
    (tmp_path / "latents").mkdir()
    flags = ["--config", "configs/finetune/controlnet.yaml", "--init_from", str(tmp_path), "--datasets",
             json.dumps([{"dataset": str(tmp_path / "captions"), "latents": str(tmp_path / "latents")}])]
    assert load_config([*flags, "--validate_every", "0"]).validate_every == 0
    with pytest.raises(ConfigError, match="controlnet.validation_images: data/my_data/validation_edges.png is no file"):
        load_config(flags)


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml")))
def test_every_shipped_config_loads_and_passes_its_checks(path):
    """A recipe that stops with a config error (a setting one of its modes refuses) fails here, not at a
    user's step 8."""
    config = sd.train.config_loading.load_config(["--config", str(ROOT / path)], check_paths=False)
    assert config.max_steps > 0 or config.epochs > 0
    assert config.flat_keys == ()  # written in sections, as docs/config.md names the fields


# ------------------------------------------------------------------------------ sections and flat names

FLAT_RECIPE = {"lora_rank": 8, "lora_alpha": 4, "lora_targets": ["attention"], "optimizer": "adamw",
               "min_lr_ratio": 0.5, "validation_samples": 16, "validation_cfg": 5.0, "posthoc_ema_every": 10,
               "noise_offset": 0.05, "shuffle_tags": 0.5, "keep_tokens": 1, "flow_matching": False,
               "max_steps": 3, "lr": 1.0e-4}


def test_a_flat_config_of_before_and_its_sections_give_the_same_config(tmp_path, datasets, caplog, monkeypatch):
    """Each flat name of before reads into its section: a YAML written flat, the same in sections, and the flat
    YAML with a dotted flag over a flat one (the flag wins) give equal configs; only the flat one lists what it
    read flat, and SD_Train.py says so in one log line naming both spellings."""
    flat = write_yaml(tmp_path / "flat.yaml", datasets=datasets, out_dir=str(tmp_path / "run"), **FLAT_RECIPE)
    sections: dict = {"datasets": datasets, "out_dir": str(tmp_path / "run")}
    for name, value in FLAT_RECIPE.items():
        where, _, field = canonical(name).rpartition(".")
        (sections.setdefault(where, {}) if where else sections)[field] = value
    assert set(sections) >= {"lora", "optim", "validation", "ema", "loss", "captions", "flow"}
    sectioned = write_yaml(tmp_path / "sections.yaml", **sections)
    a, b = (load_config(["--config", str(path)], check_paths=False) for path in (flat, sectioned))
    assert a == b and a.lora.rank == 8 and a.optim.min_lr_ratio == 0.5 and a.ema.posthoc_every == 10
    assert set(a.flat_keys) == set(FLAT_RECIPE) - set(sd.train.config.TOP) and b.flat_keys == ()
    assert a.lora_rank == a.lora.rank  # the flat name still reads, for code of before
    c = load_config(["--config", str(flat), "--lora.rank", "16", "--noise_offset", "0.1"], check_paths=False)
    assert c.lora.rank == 16 and c.loss.noise_offset == 0.1 and "noise_offset" in c.flat_keys
    assert c == load_config(["--config", str(sectioned), "--lora.rank", "16", "--loss.noise_offset", "0.1"],
                            check_paths=False)
    # SD_Train.py names what it read flat, before the run.
    full = write_yaml(tmp_path / "full.yaml", datasets=datasets, out_dir=str(tmp_path / "run"), max_steps=3,
                      noise_offset=0.05, min_lr_ratio=0.5)
    monkeypatch.setattr(SD_Train, "train", lambda config, d: 0)
    with caplog.at_level(logging.INFO):
        assert SD_Train.main(["--config", str(full), "--device", "cpu"]) == 0
    assert re.search(r"config: read (noise_offset, min_lr_ratio|min_lr_ratio, noise_offset) into their sections "
                     r"\((loss.noise_offset, optim.min_lr_ratio|optim.min_lr_ratio, loss.noise_offset)\)",
                     caplog.text), caplog.text


def test_a_flat_name_and_its_section_field_in_one_file_is_refused(tmp_path, datasets):
    """Two spellings of one field in one file: which one wins would be a guess."""
    path = write_yaml(tmp_path / "both.yaml", datasets=datasets, max_steps=2, lora_rank=4, lora={"rank": 8})
    with pytest.raises(ConfigError, match=r"lora_rank.*lora\.rank|lora\.rank.*lora_rank"):
        load_config(["--config", str(path)])


@pytest.mark.parametrize("how", ["config", "extends"])
def test_a_config_file_too_large_to_be_one_is_refused_unread(tmp_path, how):
    """A 20 MiB file (sparse: nothing written) given as a config or as its base is refused by its size, in one
    line naming it; at most the cap plus a byte is read, so /dev/zero is refused the same way."""
    huge = tmp_path / "huge.yaml"
    with open(huge, "wb") as handle:
        handle.truncate(20 * 2**20)
    path = huge if how == "config" else write_yaml(tmp_path / "c.yaml", extends=str(huge))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(huge))}: over 16 MiB, too large for a config YAML$"):
        load_config(["--config", str(path)], check_paths=False)
    with pytest.raises(ConfigError, match=r"^/dev/zero: over 16 MiB"):
        load_config(["--config", "/dev/zero"], check_paths=False)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path))}: cannot be read \("):
        load_config(["--config", str(tmp_path)], check_paths=False)
