"""sd.studio.training: the Train page's recipes, field lines and every path-valued config field confined to the
studio's roots, judged by the trainer's own config functions without changing the working directory."""

import os
from pathlib import Path

import pytest
import yaml

import sd.train.config as config
from sd.studio import training
from sd.studio.runs import OutsideRoots, Roots

ROOT = Path(__file__).resolve().parents[2]
FROM_SCRATCH = str(ROOT / "configs" / "quickstart" / "from_scratch.yaml")

# Text fields whose doc speaks of files or folders but which hold none themselves (a choice, a name, a prompt).
NOT_PATHS = {"prediction_type", "controlnet.control", "keep_best", "tensorboard", "subject.instance_prompt",
             "preference.method"}  # its doc names the latent folder DPO reads, not a path of its own
PATH_WORDS = ("file", "folder", "path", "hub id", "dir")


@pytest.fixture
def studio_folder(tmp_path):
    """A user's folder (the studio's root) with a run to start from, and a folder outside it."""
    work = tmp_path / "work"
    (work / "runs" / "base").mkdir(parents=True)
    (work / "data" / "mine" / "dataset").mkdir(parents=True)
    (work / "data" / "mine" / "latents").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    return work


def verdict(work: Path, *field_flags, preset=FROM_SCRATCH) -> str:
    return training.check_training(preset, None, work / "runs" / "r1", list(field_flags), work, Roots([work]))


def test_every_field_that_can_hold_a_path_is_confined():
    """A new config field whose doc speaks of a file or folder must be classified here (a path, a model that
    may also be a hub id, a list of files) or named as holding none."""
    classified = {*training.PATH_FIELDS, *training.MODEL_FIELDS, *training.FILE_LISTS, training.RUN_FIELD, "datasets"}
    for name, field in config.FIELDS.items():
        speaks_of_paths = any(word in field.metadata["help"].lower() for word in PATH_WORDS)
        if config.kind_of(field) in ("str", "list") and speaks_of_paths and name not in NOT_PATHS:
            assert name in classified, (f"{name} ({field.metadata['help']}): confine it in sd.studio.training if it "
                                        "can hold a path, else name it in NOT_PATHS here")
    assert classified <= set(config.FIELDS)


@pytest.mark.parametrize("refused_field, field_flags", [
    ("init_from", ["--init_from", "{outside}/run"]), ("init_from", ["--init_from", "../elsewhere"]),
    ("vae", ["--vae", "{outside}/vae"]), ("text_encoder", ["--text_encoder", "../../te"]),
    ("tokenizer", ["--tokenizer", "~/tok"]),
    ("controlnet.init_from", ["--controlnet_from", "{outside}/cn.safetensors"]),
    ("controlnet.init_from", ["--controlnet.init_from", "{outside}/cn.safetensors"]),
    ("eval.clip_model", ["--eval_clip_model", "/clip"]), ("subject.instance_dir", ["--instance_dir", "{outside}"]),
    ("subject.instance_dir", ["--subject.instance_dir", "{outside}"]),
    ("subject.class_dir", ["--class_dir", "../class"]),
    ("eval.prompts", ["--eval_every", "10", "--eval_prompts", "{outside}/p.txt", "--eval_reference", "ref"]),
    ("eval.reference", ["--eval.every", "10", "--eval.prompts", "p.txt", "--eval.reference", "{outside}/ref.npz"]),
    ("controlnet.validation_images[1]", ["--validation_controls", "[edges.png, '{outside}/e.png']"]),
    ("datasets[0].dataset", ["--datasets", "[{{dataset: '{outside}/d', latents: data/mine/latents}}]"]),
    ("datasets[0].latents", ["--datasets", '[{{"dataset": "data/mine/dataset", "latents": "../elsewhere"}}]']),
])
def test_a_path_valued_field_outside_the_roots_is_refused(studio_folder, refused_field, field_flags):
    outside = studio_folder.parent / "elsewhere"
    said = verdict(studio_folder, *[flag.format(outside=outside) for flag in field_flags])
    assert said.startswith(f"{refused_field}: ") and "outside the folders this studio was started with" in said, said


def test_a_path_in_a_recipes_section_is_confined_as_its_flag_is(studio_folder):
    """A recipe inside the root may write a section's path by its mapping, its dotted name or its flat one."""
    outside = studio_folder.parent / "elsewhere"
    for fields in ({"subject": {"instance_dir": str(outside), "instance_prompt": "x"}},
                   {"instance_dir": str(outside), "instance_prompt": "x"},
                   {"controlnet": {"validation_images": ["edges.png", str(outside / "e.png")]}}):
        recipe = studio_folder / "mine.yaml"
        recipe.write_text(yaml.safe_dump({"extends": FROM_SCRATCH, **fields}))
        said = training.check_training(str(recipe), None, studio_folder / "runs" / "r1", [], studio_folder,
                                       Roots([studio_folder]))
        assert "outside the folders this studio was started with" in said, (fields, said)


def test_paths_inside_the_roots_hub_ids_and_tiny_are_taken(studio_folder):
    assert verdict(studio_folder, "--init_from", "runs/base", "--vae", "tiny", "--text_encoder", "tiny") == ""
    assert verdict(studio_folder, "--vae", "stabilityai/sd-vae-ft-mse", "--tokenizer", "openai/clip-vit-large-patch14",
                   "--datasets", "[{dataset: data/mine/dataset, latents: data/mine/latents}]") == ""
    (studio_folder / "owner").symlink_to(studio_folder.parent / "elsewhere")  # owner/name: here a path, out
    assert "outside" in verdict(studio_folder, "--vae", "owner/name")


def test_the_run_name_decides_out_dir(studio_folder):
    with pytest.raises(ValueError, match="line 2: out_dir is the run name's"):
        training.parse_fields("lr: 1e-4\nout_dir: /elsewhere/run")
    assert "out_dir is the run name's" in verdict(studio_folder, "--out_dir", "/elsewhere/run")
    assert "outside" in training.check_training(FROM_SCRATCH, None, studio_folder.parent / "x", [], studio_folder,
                                                Roots([studio_folder]))


def test_a_value_is_never_read_as_a_flag_of_its_own():
    """``compile: --config=/x`` would give the trainer a second --config (a bool flag takes no value)."""
    with pytest.raises(ValueError, match="would read as a flag"):
        training.parse_fields("compile: --config=/elsewhere/x.yaml")
    assert training.parse_fields("lr: -1\nflow_logit_mean: -0.5") == ["--lr", "-1", "--flow_logit_mean", "-0.5"]
    assert training.parse_fields("flow.logit_mean: -0.5") == ["--flow.logit_mean", "-0.5"]
    with pytest.raises(ValueError, match="is not 'field: value'"):
        training.parse_fields("flow..shift: 2")
    assert "unknown config field 'config'" in verdict(Path("/nonexistent"), "--config", "x.yaml")


def test_the_verdict_reads_relative_paths_in_the_root_without_changing_the_working_directory(studio_folder,
                                                                                              monkeypatch):
    (studio_folder / "runs" / "base" / "config.yaml").write_text("tokenizer: openai/clip-vit-large-patch14\n")

    def no_chdir(path):
        raise AssertionError(f"the studio changed the working directory to {path}")

    monkeypatch.setattr(os, "chdir", no_chdir)
    said = verdict(studio_folder, "--init_from", "runs/base", "--tokenizer", "tiny")
    assert "init_from" in said and "was trained with 'openai/clip-vit-large-patch14'" in said  # the root's run read
    assert verdict(studio_folder, "--init_from", "runs/base") == ""


def test_a_recipe_is_the_repositorys_or_a_file_inside_a_root(studio_folder):
    roots = Roots([studio_folder])
    name = "configs/quickstart/lora.yaml"
    assert training.recipe(name, ROOT, roots) == ROOT / name == training.recipe(str(ROOT / name), ROOT, roots)
    mine = studio_folder / "mine.yaml"
    mine.write_text(yaml.safe_dump({"extends": str(ROOT / name), "lr": 1e-4}))
    with pytest.raises(OutsideRoots):  # its extends leaves the roots (a recipe of the repository read as a file)
        training.recipe(str(mine), ROOT, roots)
    (studio_folder / "base.yaml").write_text("lr: 1e-3\n")
    mine.write_text("extends: base.yaml\nlr: 1e-4\n")
    assert training.recipe("mine.yaml", ROOT, roots) == mine.resolve()
    outside = studio_folder.parent / "elsewhere" / "evil.yaml"
    outside.write_text("lr: 1e-4\n")
    for value in (str(outside), "../elsewhere/evil.yaml", str(ROOT / "configs" / "phases" / "p1_laion_broad.yaml"),
                  "/etc/passwd", "configs/quickstart"):
        with pytest.raises(OutsideRoots):
            training.recipe(value, ROOT, roots)


def test_the_gpus_present_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,3")
    assert training.gpus_present() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert training.gpus_present() == 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: the CPU
    assert training.gpus_present() == 1


def test_field_lines_become_the_trainers_flags_and_the_trainer_judges_them(tmp_path):
    assert training.parse_fields("lr: 1e-4  # peak\n\nmax_steps: 10\n") == ["--lr", "1e-4", "--max_steps", "10"]
    with pytest.raises(ValueError, match="line 1"):
        training.parse_fields("not a field line")
    preset = FROM_SCRATCH
    assert training.check_training(preset, None, tmp_path / "runs" / "x", ["--lr", "1e-4"], tmp_path) == ""
    refused = training.check_training(preset, None, tmp_path / "runs" / "x", ["--lr", "-1"], tmp_path)
    assert "lr" in refused
    assert "no_such_field" in training.check_training(preset, None, tmp_path / "runs" / "x", ["--no_such_field", "1"], tmp_path)
