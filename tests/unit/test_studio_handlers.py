"""sd.studio.handlers: what each page's buttons do, called as Gradio's API calls them (any values, any script):
every path checked where it enters, names that are one folder, the commands of the README's quick starts, and
the memory estimate shown as an estimate."""

import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from sd.studio.handlers import Studio
from sd.studio.runs import Roots

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = "outside the folders this studio was started with"


@pytest.fixture
def studio(tmp_path):
    """A studio over a user's folder (images, a run) with Gradio's upload folder beside it; jobs are recorded,
    not run (``started``)."""
    work, uploads = tmp_path / "work", tmp_path / "gradio_uploads"
    (work / "my_images").mkdir(parents=True)
    (work / "runs").mkdir()
    uploads.mkdir()
    (tmp_path / "elsewhere").mkdir()
    Image.new("RGB", (64, 64)).save(work / "my_images" / "cat.png")
    (work / "my_images" / "notes.md").write_text("not an image")
    Image.new("RGB", (64, 64)).save(tmp_path / "elsewhere" / "victim.png")
    studio = Studio(Roots([work]), ROOT, uploads=uploads)
    studio.started = []
    studio.start = lambda name, commands, **options: studio.started.append((name, commands)) or f"started {name}"
    return studio


def test_a_caption_is_written_only_for_an_image_01e_reads(studio):
    work = studio.workdir
    for name in ("../../elsewhere/victim.png", "../elsewhere/victim.png", str(work.parent / "elsewhere" / "victim.png"),
                 "notes.md", "missing.png", "cat.png/../../../elsewhere/victim.png"):
        said = studio.save_caption("my_images", name, "pwned")
        assert said.startswith("**not saved:**"), (name, said)
    assert not list(work.parent.glob("**/victim.txt")) and not (work / "my_images" / "notes.txt").exists()
    assert studio.save_caption("my_images", "cat.png", " a cat ") == "saved cat.txt"
    assert (work / "my_images" / "cat.txt").read_text() == "a cat\n"
    assert OUTSIDE in studio.save_caption("../elsewhere", "victim.png", "pwned")
    assert not (work.parent / "elsewhere" / "victim.txt").exists()


@pytest.mark.parametrize("name", ["team/r1", "../r1", ".hidden", "", "a b", "r1/"])
def test_a_run_or_dataset_name_is_one_folder(studio, name):
    said = studio.prepare_data("my_images", 64, name, "tiny", "tiny")
    assert said.startswith("# not started: dataset name") and "\n" not in said
    verdict, command = studio.do_launch("configs/quickstart/from_scratch.yaml", "", name, "", 1)
    assert verdict.startswith("**refused:** run name") and "\n" not in verdict and command == ""
    assert studio.started == []


def test_the_train_pages_refresh_shows_no_file_outside_the_runs(studio):
    grids = studio.workdir.parent / "elsewhere" / "samples"
    grids.mkdir()
    Image.new("RGB", (8, 8)).save(grids / "secret.png")
    state, _, _, shown, log, _, estimate = studio.refresh("../../elsewhere")
    assert (state, shown, log, estimate) == ("", [], "", "")


def test_the_data_page_runs_the_readmes_quick_start_2(studio):
    """01e at 64 px, a tiny VAE trained into runs/my_vae (once), the latents, the tiny tokenizer, the dataset."""
    assert studio.prepare_data("my_images", 64, "mine", "runs/my_vae", "tiny") == "started data"
    (name, commands), = studio.started
    scripts = [Path(command[1]).name for command in commands]
    assert scripts == ["01e_import_folder.py", "train_vae.py", "encode_latents.py", "04_preprocess_to_cache.py",
                       "05_build_hf_dataset.py"]
    vae = str(studio.workdir / "runs" / "my_vae")
    assert commands[1][2:] == ["--input", f"{studio.workdir}/data/mine/shards/*.tar", "--out", vae, "--resolution",
                               "64", "--preset", "tiny"]
    assert commands[2][commands[2].index("--vae") + 1] == vae and commands[3][-2:] == ["--tokenizer", "tiny"]
    (studio.workdir / "runs" / "my_vae").mkdir(parents=True)
    (studio.workdir / "runs" / "my_vae" / "config.json").write_text("{}")  # trained: used as it is
    studio.prepare_data("my_images", 64, "mine", "runs/my_vae", "tiny")
    assert "train_vae.py" not in str(studio.started[-1][1])
    studio.prepare_data("my_images", 64, "mine", "stabilityai/sd-vae-ft-mse", "tiny", False)
    assert studio.started[-1][1][1][studio.started[-1][1][1].index("--vae") + 1] == "stabilityai/sd-vae-ft-mse"


@pytest.mark.parametrize("vae, tokenizer", [("/elsewhere/vae", "tiny"), ("tiny", "../tokenizer"),
                                            ("../../vae", "tiny")])
def test_the_data_pages_models_are_checked(studio, vae, tokenizer):
    for train_vae in (True, False):
        assert OUTSIDE in studio.prepare_data("my_images", 64, "mine", vae, tokenizer, train_vae)
    assert studio.started == []


@pytest.mark.parametrize("preset, hardware, fields, refused", [
    ("configs/quickstart/from_scratch.yaml", "", "out_dir: /elsewhere/run", "out_dir is the run name's"),
    ("configs/quickstart/from_scratch.yaml", "", "init_from: /elsewhere/run", OUTSIDE),
    ("configs/quickstart/from_scratch.yaml", "", "datasets: [{dataset: ../x, latents: y}]", OUTSIDE),
    ("configs/quickstart/from_scratch.yaml", "", "vae: ~/vae", OUTSIDE),
    ("configs/quickstart/from_scratch.yaml", "", "config: /elsewhere/x.yaml", "unknown config field 'config'"),
    ("/etc/passwd", "", "", OUTSIDE),
    ("../elsewhere/recipe.yaml", "", "", OUTSIDE),
    ("configs/quickstart/from_scratch.yaml", "/elsewhere/24gb.yaml", "", OUTSIDE),
])
def test_the_train_page_refuses_a_path_outside_the_roots(studio, preset, hardware, fields, refused):
    for said, command in (studio.do_launch(preset, hardware, "r1", fields, 1),
                          studio.do_estimate(preset, hardware, "r1", fields, 24, 1)):
        assert said.startswith("**refused:**") and refused in said and command == "", said
    assert studio.started == []


def test_the_train_page_launches_a_recipe_into_runs_name(studio):
    verdict, command = studio.do_launch("configs/quickstart/from_scratch.yaml", "configs/hardware/24gb.yaml", "mine",
                                        "vae: tiny\nmax_steps: 10", 1)
    assert verdict == "" and command == "started train_mine"
    (name, [words]), = studio.started
    assert words[2:] == ["--config", str(ROOT / "configs/quickstart/from_scratch.yaml"), "--config",
                         str(ROOT / "configs/hardware/24gb.yaml"), "--out_dir", str(studio.workdir / "runs" / "mine"),
                         "--vae", "tiny", "--max_steps", "10"]
    assert studio.run_name_for("configs/quickstart/lora.yaml", "mine") == "my_lora"
    assert studio.run_name_for("/etc/passwd", "mine") == "mine"


@pytest.mark.parametrize("field, value", [
    ("run", "/elsewhere/run"), ("run", "../run"), ("lora", "/elsewhere/l.safetensors:0.5"),
    ("lora", "../../l.safetensors"), ("embedding", "../e.safetensors:<tok>"), ("embedding", "/etc/e.pt"),
    ("controlnet", "/elsewhere/cn"), ("control", "/etc/hostname")])
def test_the_sample_page_refuses_a_path_outside_the_roots(studio, field, value):
    values = {"run": "runs/mine", "lora": "", "embedding": "", "controlnet": "", "control": None, **{field: value}}
    if field == "control":
        values["controlnet"] = "runs/cn"
    if field == "controlnet":
        values["control"] = "my_images/cat.png"
    said = studio.do_sample(values["run"], values["lora"], values["embedding"], "a red circle", "", "auto", 0, 0, 0, 0,
                            1, False, values["controlnet"], values["control"])
    assert said.startswith("# not started:") and OUTSIDE in said, said
    assert studio.started == []


def test_the_sample_page_runs_the_readmes_command_with_checked_files(studio):
    work = studio.workdir
    upload = studio.uploads / "abc" / "edges.png"
    upload.parent.mkdir()
    Image.new("RGB", (8, 8)).save(upload)
    said = studio.do_sample("runs/mine", "loras/style.safetensors:0.7", "emb/cat.safetensors:<cat>", "a red circle", "",
                            "auto", 0, 0, 0, 0, 4, False, "runs/cn", str(upload))
    assert said == "started sample"
    words = studio.started[-1][1][0][2:]
    kept = next((work / ".studio" / "uploads").glob("*.png"))
    assert words == ["--ckpt", str(work / "runs" / "mine"), "--prompt", "a red circle", "--sampler", "auto", "--seed",
                     "0", "--n", "4", "--out", str(work / "samples" / "mine"),
                     "--lora", f"{work}/loras/style.safetensors:0.7",
                     "--embedding", f"{work}/emb/cat.safetensors:<cat>",
                     "--controlnet", str(work / "runs" / "cn"), "--control", str(kept)]  # steps, CFG: the sampler's
    assert kept.read_bytes() == upload.read_bytes()
    studio.do_sample("stable-diffusion-v1-5/stable-diffusion-v1-5", "", "", "a cat", "", "ddim", 25, 7.5, 0, 0, 1,
                     False, "", None)  # a hub id
    words = studio.started[-1][1][0][2:]
    assert words[:2] == ["--ckpt", "stable-diffusion-v1-5/stable-diffusion-v1-5"] and words[-4:] == ["--steps", "25",
                                                                                                     "--cfg", "7.5"]
    said = studio.do_sample("runs/mine", "", "", "x", "", "auto", 0, 0, 0, 0, 1, False, "runs/cn", None)
    assert "needs its conditioning image" in said
    (work / "models").mkdir()
    (work / "models" / "anime.safetensors").write_bytes(b"")
    studio.do_sample("models/anime.safetensors", "", "", "1girl", "", "auto", 0, 0, 0, 0, 1, False, "", None, "2")
    words = studio.started[-1][1][0][2:]
    assert words[:2] == ["--ckpt", str(work / "models" / "anime.safetensors")] and words[-2:] == ["--clip_skip", "2"]


def test_the_export_pages_tools_run_sd_tools_on_checked_paths(studio):
    work = studio.workdir
    (work / "models").mkdir(exist_ok=True)
    for name in ("tuned", "base"):
        (work / "models" / f"{name}.safetensors").write_bytes(b"")
    assert studio.do_tool("extract", "models/tuned.safetensors", "models/base.safetensors", 16) == "started export"
    words = studio.started[-1][1][0][2:]
    assert words == ["extract", "--tuned", str(work / "models" / "tuned.safetensors"), "--base",
                     str(work / "models" / "base.safetensors"), "--out",
                     str(work / "exports" / "tuned_lora_r16.safetensors"), "--rank", "16"]
    assert studio.do_tool("resize", "loras/style.safetensors", "", 4) == "started export"
    assert studio.started[-1][1][0][2:][-3:] == [str(work / "exports" / "style_r4.safetensors"), "--rank", "4"]
    count = len(studio.started)
    for said in (studio.do_tool("extract", "/etc/passwd", "models/base.safetensors", 8),
                 studio.do_tool("resize", "../../x.safetensors", "", 8), studio.do_tool("resize", "l.safetensors", "", 0)):
        assert said.startswith("# not started:"), said
    assert len(studio.started) == count


def test_the_export_page_checks_its_run(studio):
    for run in ("/elsewhere/run", "../../run"):
        assert OUTSIDE in studio.do_export(run, "LoRA (kohya layout)")
    assert studio.do_export("runs/my_lora", "LoRA (kohya layout)") == "started export"
    assert studio.started[-1][1][0][2:] == ["--ckpt", str(studio.workdir / "runs" / "my_lora"), "--export_lora",
                                            str(studio.workdir / "exports" / "my_lora" / "lora.safetensors")]
    assert len(studio.started) == 1


def finish(studio, job, seconds=60.0):
    """The job's record once it has ended (the queue looked at until then)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        studio.queue.follow_once()
        job = studio.queue.get(job.id)
        if job.state in ("finished", "failed", "stopped", "lost", "cancelled"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job.id} still {job.state}")


ESTIMATE_OUTPUT = """estimating one training step on fake tensors (tiny UNet, 64 px): no GPU or data needed ...
  micro-batch    4: peak     1.32 GB  (2 s)
Predicted device memory of one training step: tiny UNet, 64 px, micro-batch 32 x grad_accum 1, fp32
  weights                             0.003 GB
  peak on the card                    3.993 GB
Largest micro-batch within 24.00 GB: 241 (peak 23.98 GB)
{"batch_size": 32, "peak_gb": 3.993, "max_batch": 241, "fits": true}
"""


def test_the_memory_estimate_is_shown_as_an_estimate_with_its_summary(tmp_path):
    """Its state is the estimate's (estimating, estimate done), never the run's, and its summary is shown."""
    studio = Studio(Roots([tmp_path]), ROOT)
    script = f"import sys, time\nprint({ESTIMATE_OUTPUT!r}[:60], flush=True)\ntime.sleep(float(sys.argv[1]))\n" \
             f"print({ESTIMATE_OUTPUT!r}[60:], end='')\n"
    studio.start("estimate_mine", [[sys.executable, "-c", script, "30"]])
    state, *_, log, _, estimate = studio.refresh("mine")
    assert state == "" and log == ""  # the run has not started: nothing about it
    assert estimate.splitlines()[0] == "estimating ..."
    finish(studio, studio.queue.stop(studio.queue.latest("estimate_mine").id))
    studio.start("estimate_mine", [[sys.executable, "-c", script, "0"]])
    assert finish(studio, studio.queue.latest("estimate_mine")).exit_code == 0
    state, *_, estimate = studio.refresh("mine")
    assert state == ""
    assert estimate.splitlines() == ["estimate done"] + ESTIMATE_OUTPUT.splitlines()[2:-1]
    studio.start("estimate_mine", [[sys.executable, "-c", "import sys; sys.exit('unknown config field x')"]])
    finish(studio, studio.queue.latest("estimate_mine"))
    assert studio.refresh("mine")[-1].splitlines() == ["estimate failed (exit 1)", "unknown config field x"]


def test_a_run_asks_for_no_more_gpus_than_its_set_holds(tmp_path):
    studio = Studio(Roots([tmp_path]), ROOT, gpu_sets=["0,1", "2"])
    studio.started = []
    studio.start = lambda name, commands, **options: studio.started.append((name, options)) or f"started {name}"
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    recipe = "configs/quickstart/from_scratch.yaml"
    verdict, _ = studio.do_launch(recipe, "", "r1", "", 2, False, 1)
    assert verdict == "**refused:** 2 GPUs on GPU set 1 (2): it has 1; ask for fewer or pick a larger set"
    assert studio.do_launch(recipe, "", "r1", "", 1, False, 5)[0].startswith("**refused:** GPU set 5")
    assert studio.started == []
    assert studio.do_launch(recipe, "", "r1", "", 2, True, 0)[0] == ""
    assert studio.started == [("train_r1", {"run": tmp_path / "runs" / "r1", "keep_going": True, "gpu_set": 0})]
