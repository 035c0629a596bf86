"""SD_TrainConfig: flags, bools, numbers given as text, and ``extends`` chains of YAML files."""

import re
from pathlib import Path

import pytest
import yaml

import SD_Train
import SD_TrainConfig
from SD_TrainConfig import ConfigError, load_config


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
    assert "unknown config field 'min_lr' in the command line; did you mean 'min_lr_ratio'?" in err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="did you mean 'min_lr_ratio'"):
        load_config(["--config", str(base_config), *flags])


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
    kind = SD_TrainConfig.FIELDS[flag[2:]].type
    # A number-like text is shown as the number it read as (1.5), other text quoted ('two').
    with pytest.raises(ConfigError, match=rf"^{flag[2:]}: expected {kind}, got '?{re.escape(text)}'?$"):
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
