"""What the studio's buttons and timer do, as plain functions of the widgets' values.

Gradio's API (``/gradio_api/call/<name>``) reaches every one of these as a script would, with any values, so
each checks what it is given where it enters: every path resolves inside the studio's roots (``Roots``; a
recipe may also be one of the repository's, a model a hub id), a run or dataset name is one folder name, an
image whose caption is written is one that 01e reads. Each action builds the command a user would type
(``sd.studio.data``, ``sd.studio.training``), shows it and runs it as a ``Job``; the pages read the job's log,
the run's ``metrics.jsonl`` and its sample grids incrementally.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import sd.studio.data as data
import sd.studio.training as training
from sd.studio.jobs import JsonlTail, Jobs, LogTail, python_command, shown
from sd.studio.runs import OutsideRoots, Roots, folder_name, list_runs, run_info

PAGE = 24  # thumbnails a page on the Data page
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
ESTIMATE_STATES = {"running": "estimating ...", "stopping": "estimating ...", "finished": "estimate done"}
SUMMARY_START = "Predicted device memory"  # where --estimate_memory's summary begins


def refused(error: Exception) -> str:
    return f"# not started: {error}"


class Studio:
    """The handlers of one studio: its roots (the first is where jobs run and ``runs/``, ``data/`` are), the
    repository (its recipes), the folder Gradio keeps a page's uploads in, and the jobs it started."""

    def __init__(self, roots: Roots, repository: Path, uploads: Path | None = None):
        self.roots, self.repository = roots, Path(repository)
        self.workdir = roots.folders[0]
        self.uploads = Path(uploads).resolve() if uploads else None
        self.jobs = Jobs(self.workdir / ".studio" / "logs", cwd=self.workdir)
        self.runs_root = self.workdir / "runs"
        self.tails: dict[str, LogTail] = {}
        self.metrics: dict[str, JsonlTail] = {}
        self.scans: dict[tuple, data.FolderScan] = {}  # the last scan of each folder and size: paging reads no file
        self.sample_dir: Path | None = None

    # -- jobs ----------------------------------------------------------------------------------------------------
    def start(self, name: str, commands: list[list[str]]) -> str:
        """Run ``commands`` one after another as the job ``name`` (a small shell-free chain in Python)."""
        if len(commands) == 1:
            command = commands[0]
        else:
            program = ("import subprocess, sys, json\n"
                       "for c in json.loads(sys.argv[1]):\n"
                       "    print('$', ' '.join(c[1:]), flush=True)\n"
                       "    code = subprocess.call(c)\n"
                       "    if code: sys.exit(code)\n")
            command = [sys.executable, "-c", program, json.dumps(commands)]
        try:
            self.jobs.start(name, command)
        except RuntimeError as error:  # the same job is running: said where the command would be
            return refused(error)
        self.tails[name] = LogTail(self.jobs.get(name).log)
        return "\n".join(shown(c) for c in commands)

    def status(self, name: str) -> tuple[str, str]:
        job = self.jobs.get(name)
        if job is None:
            return "", ""
        return job.state, self.tails[name].read()

    def data_status(self) -> tuple[str, str]:
        return self.status("data")

    def export_status(self) -> tuple[str, str]:
        return self.status("export")

    # -- Data ----------------------------------------------------------------------------------------------------
    def scanned(self, where: Path, side: int, fresh: bool) -> data.FolderScan:
        key = (str(where), side)
        if fresh or key not in self.scans:
            self.scans.clear()
            self.scans[key] = data.scan_folder(where, side)
        return self.scans[key]

    def show_folder(self, path, side, number, fresh=False):
        try:
            where = self.roots.check(path)
            if not where.is_dir():
                raise ValueError(f"{path} is not a folder")
            scan = self.scanned(where, int(side), fresh)
        except (ValueError, TypeError) as error:  # OutsideRoots is a ValueError
            return f"**{error}**", [], [], []
        shown_images = [(str(where / rel), text) for rel, text in data.page_of(scan, number or 1, PAGE)]
        pages = max(1, -(-len(scan.images) // PAGE))
        text = (f"**{len(scan.images)} images** to import, {len(scan.skipped)} skipped; page "
                f"{min(int(number or 1), pages)} of {pages}")
        return (text, shown_images, [list(row) for row in scan.skipped],
                [[bucket, n] for bucket, n in sorted(scan.buckets.items())])

    def pick(self, path, side, number, index: int) -> tuple[str, str]:
        scan = self.scanned(self.roots.check(path), int(side), fresh=False)
        return data.page_of(scan, number or 1, PAGE)[index]

    def save_caption(self, path, rel, text) -> str:
        """The caption of ``rel``, an image 01e reads from the folder ``path``, written to its ``.txt``."""
        if not rel:
            return "pick an image first"
        try:
            folder = self.roots.check(path)
            self.roots.check(data.caption_path(folder, rel))  # a .txt that links out of the roots is not followed
            written = data.write_caption(folder, rel, text or "")
        except (ValueError, OSError) as error:
            return f"**not saved:** {error}"
        for scan in self.scans.values():
            if scan.folder == folder and rel in scan.captions:
                scan.captions[rel] = (text or "").strip()
        return f"saved {written.name}"

    def prepare_data(self, path, side, dataset_name, vae_name, tokenizer_name, train_vae=True) -> str:
        """Import, (train a VAE,) encode and build the dataset ``data/NAME``: the README's quick start 2."""
        try:
            source = self.roots.check(path)
            base = self.roots.check(Path("data") / folder_name(dataset_name, "dataset name"))
            side = int(side)
            vae = self.roots.source(vae_name)
            tokenizer = self.roots.source(tokenizer_name)
            commands = [data.import_command(source, base / "shards", side, keep_aspect=False)]
            if train_vae and vae_name != "tiny":  # the VAE field names the folder it is trained into
                vae_dir = self.roots.check(vae_name)
                if not (vae_dir / "config.json").is_file():  # a VAE is there already: used as it is
                    commands.append(data.vae_command(base / "shards", vae_dir, side))
                vae = str(vae_dir)
        except (ValueError, TypeError) as error:
            return refused(error)
        commands += [data.encode_command(base / "shards", base / "latents", vae, side, buckets=False),
                     *data.dataset_commands(base / "shards", base / "captions", base / "latents", base / "dataset",
                                            tokenizer)]
        return self.start("data", commands)

    # -- Train ---------------------------------------------------------------------------------------------------
    def settings(self, preset, hardware, run, field_text) -> tuple[str, str | None, Path, list[str]]:
        """The run's recipe(s), folder and flags, each checked; a ValueError says what is refused."""
        run_dir = self.roots.check(self.runs_root / folder_name(run))
        preset_path = str(training.recipe(preset, self.repository, self.roots))
        hardware_path = str(training.recipe(hardware, self.repository, self.roots)) if hardware else None
        flags = training.parse_fields(field_text or "")
        problem = training.check_training(preset_path, hardware_path, run_dir, flags, self.workdir, self.roots)
        if problem:
            raise ValueError(problem)
        return preset_path, hardware_path, run_dir, flags

    def do_launch(self, preset, hardware, run, field_text, count) -> tuple[str, str]:
        try:
            preset_path, hardware_path, run_dir, flags = self.settings(preset, hardware, run, field_text)
            gpus = int(count or 1)
        except (ValueError, TypeError) as error:
            return f"**refused:** {error}", ""
        holder = run_info(run_dir).state
        if holder.startswith("training"):
            return f"**{run_dir} is in use:** {holder}", ""
        command = training.training_command(preset_path, hardware_path, run_dir, flags, gpus)
        shown_command = self.start(f"train_{run}", [command])
        if not shown_command.startswith("#"):
            self.metrics[run] = JsonlTail(run_dir / "metrics.jsonl")
        return "", shown_command

    def do_estimate(self, preset, hardware, run, field_text, card_gb, count) -> tuple[str, str]:
        try:
            preset_path, hardware_path, run_dir, flags = self.settings(preset, hardware, run, field_text)
            extra = ["--estimate_memory", "true", "--world_size", str(int(count or 1))]
            if card_gb:
                extra += ["--gpu_memory_gb", str(float(card_gb))]
        except (ValueError, TypeError) as error:
            return f"**refused:** {error}", ""
        command = training.training_command(preset_path, hardware_path, run_dir, flags, 1) + extra
        return "", self.start(f"estimate_{run}", [command])

    def do_stop(self, run) -> None:
        job = self.jobs.get(f"train_{run}")
        if job is not None:
            job.stop()

    def run_name_for(self, preset, current):
        """The run name a recipe writes to (its ``out_dir``'s folder), for the page to follow the recipe."""
        try:
            return training.recipe_run_name(training.recipe(preset, self.repository, self.roots)) or current
        except ValueError:
            return current

    def estimate_summary(self, run) -> str:
        """The memory estimate of ``run``: its state (estimating, estimate done, failed) and its summary lines."""
        job = self.jobs.get(f"estimate_{run}")
        if job is None:
            return ""
        state = ESTIMATE_STATES.get(job.state, f"estimate {job.state}")
        lines = self.tails[job.name].read().splitlines()[1:]  # (the first is the command)
        starts = [i for i, line in enumerate(lines) if line.startswith(SUMMARY_START)]
        if starts:
            lines = [line for line in lines[starts[-1]:] if not line.startswith("{")]
        elif job.state != "running":
            lines = lines[-6:]  # what went wrong
        else:
            lines = lines[-1:]
        return "\n".join([state, *lines])

    def refresh(self, run):
        """The Train page's live part: the run's state, loss, last metrics, grids, log, the runs, the estimate."""
        import pandas as pd

        table = [info.row() for info in list_runs(self.runs_root)]
        try:
            folder_name(run)
        except ValueError:  # not a run's name: nothing of a run to show
            return "", pd.DataFrame(columns=["step", "loss"]), "", [], "", table, ""
        state, log = self.status(f"train_{run}")
        tail = self.metrics.get(run)
        rows = tail.read() if tail else []
        points = pd.DataFrame([{"step": r["step"], "loss": r["loss"]} for r in rows
                               if isinstance(r.get("step"), int) and isinstance(r.get("loss"), (int, float))],
                              columns=["step", "loss"])
        last_row = "" if not tail or tail.last is None else \
            ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in tail.last.items())
        if tail and tail.evaluations:  # FID / CLIP score of the latest evaluation (eval_every)
            last_row += "\nlatest evaluation: " + ", ".join(
                f"{key[5:]} {value:.4g} at step {step}" if isinstance(value, float) else f"{key[5:]} {value}"
                for key, (step, value) in sorted(tail.evaluations.items()))
        grids = sorted((self.runs_root / run / "samples").glob("**/*.png"))[-8:]
        return (f"{run}: {state}" if state else "", points, last_row, [str(p) for p in grids], log, table,
                self.estimate_summary(run))

    # -- Sample and Export ---------------------------------------------------------------------------------------
    def spec(self, text: str, parse) -> tuple[str, str]:
        """``FILE[:EXTRA]`` read by SD_ImageGen.py's own ``parse`` as the job (run in the first root) reads it,
        its file checked: ``(resolved file, extra)``."""
        path, extra = parse(str(self.workdir / text))
        return str(self.roots.check(path)), extra

    def control_image(self, image) -> Path:
        """A conditioning image inside the roots; one the page uploaded (in Gradio's upload folder) is copied to
        ROOT/.studio/uploads first, so the command names a file of the studio's folders."""
        path = Path(str(image)).resolve()
        if self.uploads is not None and self.uploads in path.parents and path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
            kept = self.workdir / ".studio" / "uploads" / f"{digest}{path.suffix}"
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, kept)
            return kept
        return self.roots.check(image)

    def do_sample(self, run, lora_file, embedding_file, text, negative_text, sampler_name, step_count, scale,
                  first_seed, side, n, use_best, controlnet_path, control_image, clip_skip="auto") -> str:
        import sd.imagegen.embedding  # SD_ImageGen.py's own reading of FILE:SCALE and FILE:TOKEN
        import sd.imagegen.lora

        try:
            checkpoint = self.roots.source(run, presets=())
            out = self.roots.check(Path("samples") / Path(checkpoint).name)
            args = ["--ckpt", checkpoint, "--prompt", text or "", "--sampler", sampler_name, "--seed",
                    int(first_seed or 0), "--n", int(n or 1), "--out", out]
            if int(step_count or 0):
                args += ["--steps", int(step_count)]
            if float(scale or 0):
                args += ["--cfg", float(scale)]
            if negative_text:
                args += ["--negative", negative_text]
            if int(side or 0):
                args += ["--height", int(side), "--width", int(side)]
            if lora_file:
                path, lora_scale = self.spec(lora_file, sd.imagegen.lora.parse_lora_spec)
                args += ["--lora", f"{path}:{lora_scale:g}"]
            if embedding_file:
                path, token = self.spec(embedding_file, sd.imagegen.embedding.parse_embedding_spec)
                args += ["--embedding", f"{path}:{token}" if token else path]
            if use_best:
                args += ["--best", "true"]
            if str(clip_skip or "auto") != "auto":
                args += ["--clip_skip", int(clip_skip)]
            if controlnet_path:
                if not control_image:
                    raise ValueError("a ControlNet needs its conditioning image")
                args += ["--controlnet", self.roots.check(controlnet_path), "--control",
                         self.control_image(control_image)]
        except (ValueError, TypeError) as error:
            return refused(error)
        self.sample_dir = out
        return self.start("sample", [python_command("SD_ImageGen.py", *args)])

    def sample_refresh(self) -> tuple[str, list[str]]:
        state, _ = self.status("sample")
        out = self.sample_dir
        found = sorted(p for p in out.glob("*.png") if p.name != "grid.png") if out and out.is_dir() else []
        return state, [str(p) for p in found[-12:]]

    def do_tool(self, tool, first, second, rank) -> str:
        """``SD_Tools.py``: a LoRA extracted from ``first`` (the tuned model) minus ``second`` (its base), or the
        LoRA file ``first`` resized; at ``rank``, into ROOT/exports/."""
        try:
            rank = int(rank or 0)
            if rank < 1:
                raise ValueError(f"rank: a whole number >= 1, got {rank}")
            if tool == "extract":
                tuned, base = self.roots.source(first, presets=()), self.roots.source(second, presets=())
                target = self.roots.check(Path("exports") / f"{Path(tuned).stem}_lora_r{rank}.safetensors")
                args = ["extract", "--tuned", tuned, "--base", base, "--out", target, "--rank", rank]
            elif tool == "resize":
                lora = self.roots.check(first)
                target = self.roots.check(Path("exports") / f"{lora.stem}_r{rank}.safetensors")
                args = ["resize", "--lora", lora, "--out", target, "--rank", rank]
            else:
                raise ValueError(f"tool: extract or resize, got {tool!r}")
        except (ValueError, TypeError) as error:
            return refused(error)
        return self.start("export", [python_command("SD_Tools.py", *args)])

    def do_export(self, run, kind) -> str:
        try:
            checkpoint = self.roots.source(run, presets=())
            flag, file_name, _ = EXPORTS[kind]
            target = self.roots.check(Path("exports") / Path(checkpoint).name / file_name)
        except (ValueError, KeyError, TypeError) as error:
            return refused(error)
        return self.start("export", [python_command("SD_ImageGen.py", "--ckpt", checkpoint, flag, target)])
