"""The studio's pages (Gradio): Data, Train, Sample and Export, each running the command line it shows.

Every action builds the same command a user would type (``sd.studio.data``, ``training_command`` below),
shows it, and runs it as a ``Job`` (an argument list, never a shell); the pages then read the job's log, the
run's ``metrics.jsonl`` and its sample grids incrementally on a timer. Paths typed into a page are checked
against the folders the studio was started with (``Roots``).
"""

from pathlib import Path

import sd.studio.data as data
from sd.studio.jobs import JsonlTail, Jobs, LogTail, python_command, shown
from sd.studio.runs import OutsideRoots, Roots, list_runs, run_info

PAGE = 24  # thumbnails a page on the Data page
PRESET_FOLDERS = ("configs/quickstart", "configs/finetune", "configs/hardware")
EXPORTS = {  # format -> (SD_ImageGen.py flag, file name, where other tools expect it)
    "LoRA (kohya layout)": ("--export_lora", "lora.safetensors",
                            "ComfyUI models/loras/, AUTOMATIC1111 models/Lora/, sd-scripts, diffusers load_lora_weights"),
    "single file (.safetensors)": ("--export_single_file", "model.safetensors",
                                   "ComfyUI models/checkpoints/, AUTOMATIC1111 models/Stable-diffusion/"),
    "diffusers folder": ("--export_diffusers", "diffusers", "StableDiffusionPipeline.from_pretrained(folder)"),
    "embedding (AUTOMATIC1111)": ("--export_embedding", "embedding.safetensors",
                                  "AUTOMATIC1111 embeddings/, ComfyUI models/embeddings/"),
    "ControlNet": ("--export_controlnet", "controlnet.safetensors",
                   "ComfyUI models/controlnet/, AUTOMATIC1111 extensions/sd-webui-controlnet/models/"),
}


def presets(repository: Path, kind: str = "") -> list[tuple[str, str]]:
    """``(shown name, full path)`` of the repository's recipes (``kind``: only those whose folder names it)."""
    return [(str(p.relative_to(repository)), str(p)) for folder in PRESET_FOLDERS if kind in folder
            for p in sorted((repository / folder).glob("*.yaml"))]


def gpus_present() -> int:
    """The GPUs ``nvidia-smi -L`` lists (CUDA_VISIBLE_DEVICES counted when set), at least 1 (the CPU)."""
    import os
    import subprocess

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return max(1, len([d for d in visible.split(",") if d.strip()]))
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 1
    return max(1, sum(line.startswith("GPU ") for line in listed.splitlines()))


def parse_fields(text: str) -> list[str]:
    """``field: value`` lines -> ``--field value`` flags (the trainer checks names, types and ranges)."""
    flags = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, colon, value = line.partition(":")
        if not colon or not name.strip().isidentifier():
            raise ValueError(f"line {number}: {line!r} is not 'field: value'")
        flags += [f"--{name.strip()}", value.strip()]
    return flags


def training_command(preset: str, hardware: str | None, run_dir: Path, fields: list[str], gpus: int) -> list[str]:
    configs = ["--config", preset] + (["--config", hardware] if hardware else [])
    tail = [*configs, "--out_dir", str(run_dir), *fields]
    if gpus > 1:
        import sys

        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={gpus}",
                python_command("SD_Train.py")[1], *tail]
    return python_command("SD_Train.py", *tail)


def check_training(preset: str, hardware: str | None, run_dir: Path, fields: list[str], workdir: Path) -> str:
    """The trainer's own verdict on the settings ("" when they are good), without loading a model."""
    import os

    import sd.train.config

    argv = ["--config", preset] + (["--config", hardware] if hardware else []) + ["--out_dir", str(run_dir), *fields]
    import contextlib
    import io

    here, said = os.getcwd(), io.StringIO()
    try:
        os.chdir(workdir)
        with contextlib.redirect_stderr(said):
            sd.train.config.load_config(argv, check_paths=False)
    except (sd.train.config.ConfigError, ValueError, OSError) as error:
        return str(error)
    except SystemExit as exit:  # the command line's own refusal (an unknown field): its one line
        lines = said.getvalue().strip().splitlines()
        return lines[-1] if lines else f"the settings are refused (exit {exit.code})"
    finally:
        os.chdir(here)
    return ""


def field_reference() -> list[list[str]]:
    import sd.train.config as config

    rows = []
    for _, names in config.sections():
        for name in names:
            meta = config.FIELDS[name].metadata
            allowed = meta["allowed"].describe(config.FIELDS[name].type) if meta.get("allowed") else ""
            rows.append([name, config.describe_default(name).strip("`"), allowed, meta["help"]])
    return rows


def build(roots: Roots, repository: Path):
    """The studio's ``gr.Blocks``: jobs run in the first root (relative paths in recipes, ``data/``, ``runs/``,
    are the user's there, as on the command line) and log to ROOT/.studio/logs; ``roots`` bound every path."""
    import gradio as gr
    import pandas as pd

    workdir = roots.folders[0]
    jobs = Jobs(workdir / ".studio" / "logs", cwd=workdir)
    tails: dict[str, LogTail] = {}
    metrics: dict[str, JsonlTail] = {}
    runs_root = roots.folders[0] / "runs"

    def start(name: str, commands: list[list[str]]) -> str:
        """Run ``commands`` one after another as the job ``name`` (a small shell-free chain in Python)."""
        if len(commands) == 1:
            command = commands[0]
        else:
            import json
            import sys

            program = ("import subprocess, sys, json\n"
                       "for c in json.loads(sys.argv[1]):\n"
                       "    print('$', ' '.join(c[1:]), flush=True)\n"
                       "    code = subprocess.call(c)\n"
                       "    if code: sys.exit(code)\n")
            command = [sys.executable, "-c", program, json.dumps(commands)]
        try:
            jobs.start(name, command)
        except RuntimeError as error:  # the same job is running: said where the command would be
            return f"# not started: {error}"
        tails[name] = LogTail(jobs.get(name).log)
        return "\n".join(shown(c) for c in commands)

    def status(name: str) -> tuple[str, str]:
        job = jobs.get(name)
        if job is None:
            return "", ""
        return job.state, tails[name].read()

    def checked(path: str) -> Path:
        return roots.check(path)

    scans: dict[tuple, data.FolderScan] = {}  # the last scan of each folder and size: paging reads no file

    def scanned(where: Path, side: int, fresh: bool) -> data.FolderScan:
        key = (str(where), side)
        if fresh or key not in scans:
            scans.clear()
            scans[key] = data.scan_folder(where, side)
        return scans[key]

    polls = []  # (function, inputs, outputs) the timer refreshes

    with gr.Blocks(title="SD studio", analytics_enabled=False) as studio:
        gr.Markdown("# Stable Diffusion 1.x studio\nEach page runs the command line it shows; copy it into a "
                    "script or a cluster job to run it without the studio.")
        with gr.Tab("Data", elem_id="tab-data"):
            with gr.Row():
                folder = gr.Textbox(label="image folder", value="my_images", elem_id="data-folder")
                resolution = gr.Number(label="resolution", value=512, precision=0, elem_id="data-resolution")
                name = gr.Textbox(label="dataset name", value="mine", elem_id="data-name")
                read = gr.Button("Read folder", elem_id="data-read")
            summary = gr.Markdown(elem_id="data-summary")
            with gr.Row():
                page = gr.Number(label="page", value=1, precision=0, minimum=1, elem_id="data-page")
            gallery = gr.Gallery(label="images and captions", columns=6, height=420, elem_id="data-gallery")
            with gr.Row():
                selected = gr.Textbox(label="image", interactive=False, elem_id="data-selected")
                caption = gr.Textbox(label="caption", elem_id="data-caption")
                save = gr.Button("Save caption", elem_id="data-save")
            skipped = gr.Dataframe(headers=["file", "why it would be skipped"], label="skipped files",
                                   elem_id="data-skipped")
            buckets = gr.Dataframe(headers=["bucket", "images"], label="aspect-ratio buckets", elem_id="data-buckets")
            with gr.Row():
                vae = gr.Textbox(label="VAE", value="stabilityai/sd-vae-ft-mse", elem_id="data-vae")
                tokenizer = gr.Textbox(label="tokenizer", value="openai/clip-vit-large-patch14", elem_id="data-tokenizer")
                prepare = gr.Button("Import, encode and build the dataset", variant="primary", elem_id="data-prepare")
            data_command = gr.Code(label="command", language="shell", elem_id="data-command")
            data_state = gr.Textbox(label="state", interactive=False, elem_id="data-state")
            data_log = gr.Textbox(label="log", lines=8, max_lines=8, autoscroll=True, elem_id="data-log")

            def show_folder(path, side, number, fresh=False):
                try:
                    where = checked(path)
                    if not where.is_dir():
                        raise ValueError(f"{path} is not a folder")
                    scan = scanned(where, int(side), fresh)
                except (OutsideRoots, ValueError) as error:
                    return f"**{error}**", [], [], []
                shown_images = [(str(where / rel), text) for rel, text in data.page_of(scan, number or 1, PAGE)]
                pages = max(1, -(-len(scan.images) // PAGE))
                text = (f"**{len(scan.images)} images** to import, {len(scan.skipped)} skipped; page "
                        f"{min(int(number or 1), pages)} of {pages}")
                return (text, shown_images, [list(row) for row in scan.skipped],
                        [[bucket, n] for bucket, n in sorted(scan.buckets.items())])

            read.click(lambda *a: show_folder(*a, fresh=True), [folder, resolution, page],
                       [summary, gallery, skipped, buckets])
            page.change(show_folder, [folder, resolution, page], [summary, gallery, skipped, buckets])

            def pick(path, side, number, evt: gr.SelectData):
                where = checked(path)
                scan = scanned(where, int(side), fresh=False)
                return data.page_of(scan, number or 1, PAGE)[evt.index]

            gallery.select(pick, [folder, resolution, page], [selected, caption])

            def save_caption(path, rel, text):
                if not rel:
                    return "pick an image first"
                written = data.write_caption(checked(path), rel, text)
                for scan in scans.values():
                    scan.captions[rel] = text.strip()
                return f"saved {written.name}"

            save.click(save_caption, [folder, selected, caption], [summary])

            def prepare_data(path, side, dataset_name, vae_name, tokenizer_name):
                try:
                    source = checked(path)
                    base = checked(Path("data") / dataset_name)
                except OutsideRoots as error:
                    return str(error)
                side = int(side)
                commands = [data.import_command(source, base / "shards", side, keep_aspect=False),
                            data.encode_command(base / "shards", base / "latents", vae_name, side, buckets=False),
                            *data.dataset_commands(base / "shards", base / "captions", base / "latents",
                                                   base / "dataset", tokenizer_name)]
                return start("data", commands)

            prepare.click(prepare_data, [folder, resolution, name, vae, tokenizer], [data_command])

        with gr.Tab("Train", elem_id="tab-train"):
            with gr.Row():
                preset = gr.Dropdown(presets(repository), label="preset",
                                     value=str(repository / "configs/quickstart/from_scratch.yaml"),
                                     allow_custom_value=True, elem_id="train-preset")
                hardware = gr.Dropdown([("none", "")] + presets(repository, "hardware"), value="",
                                       label="card recipe (second --config)", elem_id="train-hardware")
                run_name = gr.Textbox(label="run name", value="my_run", elem_id="train-run")
                gpus = gr.Number(label="GPUs", value=gpus_present(), precision=0, minimum=1, elem_id="train-gpus")
            fields = gr.Textbox(label="fields, one 'field: value' a line (override the preset)", lines=4,
                                elem_id="train-fields")
            verdict = gr.Markdown(elem_id="train-verdict")
            with gr.Row():
                card = gr.Number(label="card memory (GB) for the estimate; 0: this machine's", value=24,
                                 elem_id="train-card")
                estimate = gr.Button("Estimate memory", elem_id="train-estimate")
                launch = gr.Button("Launch / Resume", variant="primary", elem_id="train-launch")
                stop = gr.Button("Stop (saves a checkpoint)", variant="stop", elem_id="train-stop")
            train_command = gr.Code(label="command", language="shell", elem_id="train-command")
            train_state = gr.Textbox(label="state", interactive=False, elem_id="train-state")
            loss_plot = gr.LinePlot(x="step", y="loss", title="loss", elem_id="train-loss")
            last = gr.Textbox(label="last logged step", interactive=False, elem_id="train-last")
            samples = gr.Gallery(label="sample grids", columns=4, height=260, elem_id="train-samples")
            train_log = gr.Textbox(label="log", lines=8, max_lines=8, autoscroll=True, elem_id="train-log")
            run_table = gr.Dataframe(headers=["run", "state", "step", "of", "loss", "folder"], label="runs",
                                     elem_id="train-runs")
            with gr.Accordion("every field: default, allowed values, what it does", open=False):
                gr.Dataframe(value=field_reference(), headers=["field", "default", "allowed", "doc"], wrap=True)

            def settings(preset_path, hardware_path, run, field_text):
                flags = parse_fields(field_text or "")
                return preset_path, hardware_path or None, checked(runs_root / run), flags

            def do_launch(preset_path, hardware_path, run, field_text, count):
                try:
                    preset_path, hardware_path, run_dir, flags = settings(preset_path, hardware_path, run, field_text)
                except (ValueError, OutsideRoots) as error:
                    return f"**refused:** {error}", ""
                problem = check_training(preset_path, hardware_path, run_dir, flags, workdir)
                if problem:
                    return f"**refused:** {problem}", ""
                holder = run_info(run_dir).state
                if holder.startswith("training"):
                    return f"**{run_dir} is in use:** {holder}", ""
                command = training_command(preset_path, hardware_path, run_dir, flags, int(count or 1))
                shown_command = start(f"train_{run}", [command])
                if not shown_command.startswith("#"):
                    metrics[run] = JsonlTail(run_dir / "metrics.jsonl")
                return "", shown_command

            def do_estimate(preset_path, hardware_path, run, field_text, card_gb, count):
                try:
                    preset_path, hardware_path, run_dir, flags = settings(preset_path, hardware_path, run, field_text)
                except (ValueError, OutsideRoots) as error:
                    return f"**refused:** {error}", ""
                command = training_command(preset_path, hardware_path, run_dir, flags, 1)
                command += ["--estimate_memory", "true", "--world_size", str(int(count or 1))]
                if card_gb:
                    command += ["--gpu_memory_gb", str(card_gb)]
                return "", start(f"estimate_{run}", [command])

            launch.click(do_launch, [preset, hardware, run_name, fields, gpus], [verdict, train_command])
            estimate.click(do_estimate, [preset, hardware, run_name, fields, card, gpus], [verdict, train_command])
            def do_stop(run):
                job = jobs.get(f"train_{run}")
                if job is not None:
                    job.stop()

            stop.click(do_stop, [run_name], [])

            def refresh(run):
                started = [job for job in (jobs.get(f"train_{run}"), jobs.get(f"estimate_{run}")) if job]
                job_name = max(started, key=lambda job: job.started).name if started else ""
                state, log = status(job_name)
                tail = metrics.get(run)
                rows = tail.read() if tail else []
                frame = pd.DataFrame([{"step": r["step"], "loss": r["loss"]} for r in rows
                                      if isinstance(r.get("step"), int) and isinstance(r.get("loss"), (int, float))],
                                     columns=["step", "loss"])
                last_row = "" if not tail or tail.last is None else \
                    ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in tail.last.items())
                if tail and tail.evaluations:  # FID / CLIP score of the latest evaluation (eval_every)
                    last_row += "\nlatest evaluation: " + ", ".join(
                        f"{key[5:]} {value:.4g} at step {step}" if isinstance(value, float) else f"{key[5:]} {value}"
                        for key, (step, value) in sorted(tail.evaluations.items()))
                grids = sorted((runs_root / run / "samples").glob("**/*.png"))[-8:] if run else []
                table = [info.row() for info in list_runs(runs_root)]
                return f"{run}: {state}" if state else "", frame, last_row, [str(p) for p in grids], log, table

            polls.append((refresh, [run_name], [train_state, loss_plot, last, samples, train_log, run_table]))
            polls.append((lambda: status("data"), [], [data_state, data_log]))

        with gr.Tab("Sample", elem_id="tab-sample"):
            with gr.Row():
                sample_run = gr.Textbox(label="run folder or checkpoint", value="runs/my_run", elem_id="sample-run")
                lora = gr.Textbox(label="LoRA / LyCORIS file (optional, FILE:SCALE)", elem_id="sample-lora")
                embedding = gr.Textbox(label="embedding (optional, FILE:TOKEN)", elem_id="sample-embedding")
            prompt = gr.Textbox(label="prompt", value="a photo", elem_id="sample-prompt")
            negative = gr.Textbox(label="negative prompt", elem_id="sample-negative")
            with gr.Row():
                sampler = gr.Dropdown(["auto", "ddim", "dpm++", "euler", "lcm", "flow_euler", "flow_heun"],
                                      value="auto", label="sampler", elem_id="sample-sampler")
                steps = gr.Number(label="steps", value=30, precision=0, elem_id="sample-steps")
                cfg = gr.Number(label="CFG", value=7.5, elem_id="sample-cfg")
                seed = gr.Number(label="seed", value=0, precision=0, elem_id="sample-seed")
                size = gr.Number(label="size (px, 0: the model's)", value=0, precision=0, elem_id="sample-size")
                count = gr.Number(label="images", value=1, precision=0, elem_id="sample-n")
                best = gr.Checkbox(label="best checkpoint", value=False, elem_id="sample-best")
            with gr.Row():
                controlnet = gr.Textbox(label="ControlNet (optional)", elem_id="sample-controlnet")
                control = gr.Image(label="its conditioning image", type="filepath", elem_id="sample-control")
            go = gr.Button("Sample", variant="primary", elem_id="sample-go")
            sample_command = gr.Code(label="command", language="shell", elem_id="sample-command")
            sample_state = gr.Textbox(label="state", interactive=False, elem_id="sample-state")
            images = gr.Gallery(label="images (their PNGs carry the settings as parameters)", columns=4,
                                elem_id="sample-images")
            sample_out = {"dir": None}

            def do_sample(run, lora_file, embedding_file, text, negative_text, sampler_name, step_count, scale,
                          first_seed, side, n, use_best, controlnet_path, control_image):
                try:
                    checkpoint = checked(run)
                    out = checked(Path("samples") / checkpoint.name)
                except OutsideRoots as error:
                    return str(error)
                args = ["--ckpt", checkpoint, "--prompt", text, "--sampler", sampler_name, "--steps", int(step_count),
                        "--cfg", scale, "--seed", int(first_seed), "--n", int(n), "--out", out]
                if negative_text:
                    args += ["--negative", negative_text]
                if int(side or 0):
                    args += ["--height", int(side), "--width", int(side)]
                if lora_file:
                    args += ["--lora", lora_file]
                if embedding_file:
                    args += ["--embedding", embedding_file]
                if use_best:
                    args += ["--best", "true"]
                if controlnet_path:
                    args += ["--controlnet", controlnet_path, "--control", control_image or ""]
                sample_out["dir"] = out
                return start("sample", [python_command("SD_ImageGen.py", *args)])

            go.click(do_sample, [sample_run, lora, embedding, prompt, negative, sampler, steps, cfg, seed, size,
                                 count, best, controlnet, control], [sample_command])

            def sample_refresh():
                state, _ = status("sample")
                out = sample_out["dir"]
                found = sorted(p for p in out.glob("*.png") if p.name != "grid.png") if out and out.is_dir() else []
                return state, [str(p) for p in found[-12:]]

            polls.append((sample_refresh, [], [sample_state, images]))

        with gr.Tab("Export", elem_id="tab-export"):
            export_run = gr.Textbox(label="run folder or checkpoint", value="runs/my_run", elem_id="export-run")
            export_format = gr.Dropdown(list(EXPORTS), value="LoRA (kohya layout)", label="format",
                                        elem_id="export-format")
            gr.Dataframe(value=[[name, flag, where] for name, (flag, _, where) in EXPORTS.items()],
                         headers=["format", "SD_ImageGen.py flag", "where other tools expect it"], wrap=True)
            export = gr.Button("Export", variant="primary", elem_id="export-go")
            export_command = gr.Code(label="command", language="shell", elem_id="export-command")
            export_state = gr.Textbox(label="state", interactive=False, elem_id="export-state")
            export_log = gr.Textbox(label="log", lines=6, elem_id="export-log")

            def do_export(run, kind):
                try:
                    checkpoint = checked(run)
                    flag, file_name, _ = EXPORTS[kind]
                    target = checked(Path("exports") / checkpoint.name / file_name)
                except (OutsideRoots, KeyError) as error:
                    return str(error)
                return start("export", [python_command("SD_ImageGen.py", "--ckpt", checkpoint, flag, target)])

            export.click(do_export, [export_run, export_format], [export_command])
            polls.append((lambda: status("export"), [], [export_state, export_log]))

        timer = gr.Timer(2.0)  # at the top level: a timer inside a tab ticks only while its tab is shown
        for function, inputs, outputs in polls:
            timer.tick(function, inputs, outputs)

    studio.jobs = jobs  # for the command line's shutdown: running jobs are stopped (and save) with the studio
    return studio

