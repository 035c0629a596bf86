"""What the studio's buttons and timer do, as plain functions of the widgets' values.

Gradio's API (``/gradio_api/call/<name>``) reaches every one of these as a script would, with any values, so
each checks what it is given where it enters: every path resolves inside the studio's roots (``Roots``; a
recipe may also be one of the repository's, a model a hub id), a run or dataset name is one folder name, an
image whose caption is written is one that 01e reads. Each action builds the command a user would type
(``sd.studio.data``, ``sd.studio.training``: ``data_job``, ``train_job`` ... return it, and the HTTP API submits
what they return), shows it and submits it to the queue (``sd.studio.queue``); the pages read the job's log,
the run's ``metrics.jsonl`` and its sample grids incrementally.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import shutil
import time
from pathlib import Path

import sd.studio.data as data
import sd.studio.training as training
from sd.studio.jobs import JsonlTail, LogTail, python_command, shown
from sd.studio.queue import JobRecord, Queue
from sd.studio.webhooks import Webhooks, check_url
from sd.studio.runs import Roots, folder_name, list_runs, run_info

PAGE = 24  # thumbnails a page on the Data page
FOLDERS = 500  # subfolders the folder picker lists at most
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
ESTIMATE_STATES = {"stopping": "estimating ..."}  # an estimate's state where ``describe``'s would not say it
RUNNING = {"train": "training", "estimate": "estimating ...", "data": "preparing the dataset ...",
           "sample": "sampling ...", "export": "exporting ...", "prefer": "writing the pair shards ..."}
FINISHED = {"estimate": "estimate done"}
WAITS = ("train", "data")  # kinds of job that wait their turn in the queue of their GPU set
TAILS = 64  # job logs followed at once
SUMMARY_START = "Predicted device memory"  # where --estimate_memory's summary begins


def refused(error: Exception) -> str:
    return f"# not started: {error}"


def is_run_name(name) -> bool:
    try:
        folder_name(name)
        return True
    except ValueError:
        return False


def kind_of(name: str) -> str:
    """The kind of the job ``name``: ``train_RUN`` -> train, ``estimate_RUN`` -> estimate, else the name."""
    return name.split("_", 1)[0] if name.startswith(("train_", "estimate_")) else name


class Studio:
    """The handlers of one studio: its roots (the first is where jobs run and ``runs/``, ``data/`` are), the
    repository (its recipes), the folder Gradio keeps a page's uploads in, and the jobs it started."""

    def __init__(self, roots: Roots, repository: Path, uploads: Path | None = None,
                 gpu_sets: list[str | None] | None = None, webhook: str | None = None):
        self.roots, self.repository = roots, Path(repository)
        self.workdir = roots.folders[0]
        self.uploads = Path(uploads).resolve() if uploads else None
        self.webhooks = Webhooks(webhook)
        self.queue = Queue(self.workdir / ".studio", self.workdir, gpu_sets, notify=self.webhooks)
        self.runs_root = self.workdir / "runs"
        self.tails: dict[int, LogTail] = {}  # by job id
        self.metrics: dict[str, JsonlTail] = {}
        self.scans: dict[tuple, data.FolderScan] = {}  # the last scan of each folder and size: paging reads no file
        self.sample_dir: Path | None = None

    # -- jobs ----------------------------------------------------------------------------------------------------
    def submit(self, name: str, commands: list[list[str]], *, run: Path | None = None, waits: bool | None = None,
               gpu_set: int = 0, keep_going: bool = False, webhook: str | None = None) -> JobRecord:
        """``commands`` as the job ``name`` of the queue: training and data preparation wait their turn in their GPU
        set's queue unless ``waits`` says otherwise, the rest start at once. A QueueError (a ValueError) says why
        not."""
        kind = kind_of(name)
        return self.queue.submit(name, kind, commands, waits=kind in WAITS if waits is None else bool(waits),
                                 gpu_set=int(gpu_set), keep_going=bool(keep_going),
                                 webhook=check_url(webhook) if webhook else None, run=str(run) if run else None)

    def start(self, name: str, commands: list[list[str]], **options) -> str:
        """``submit``, for a page: the commands as shown, or why it was not started (a ``#`` line)."""
        try:
            self.submit(name, commands, **options)
        except ValueError as error:  # the same job is queued or running, a set that does not exist
            return refused(error)
        return "\n".join(shown(c) for c in commands)

    def tail(self, job: JobRecord) -> LogTail:
        """The job's log, read on from where the last call stopped (the latest ``TAILS`` jobs are kept)."""
        if job.id not in self.tails:
            while len(self.tails) >= TAILS:
                self.tails.pop(next(iter(self.tails)))
            self.tails[job.id] = LogTail(self.queue.log(job))
        return self.tails[job.id]

    def describe(self, job: JobRecord) -> str:
        """A job's state as what it is: ``queued: 1 job ahead``, ``estimating ...``, ``failed (exit 1)``."""
        if job.state == "queued":
            ahead = self.queue.ahead(job) if job.waits else 0
            held = self.queue.held().get(job.gpu_set)
            where = f" on GPU set {job.gpu_set}" if len(self.queue.gpu_sets) > 1 else ""
            return (f"queued{where}: {ahead} job{'s' * (ahead != 1)} ahead" +
                    (f"; the queue is held ({held}): resume it on the Jobs page" if held else ""))
        if job.state == "running":
            return RUNNING.get(job.kind, "running")
        if job.state in ("failed", "stopped"):
            return f"{job.state} (exit {job.exit_code})"
        if job.state == "lost":
            return "lost: it ended while the studio was not following it (its last lines are in the log)"
        if job.state == "finished":
            return FINISHED.get(job.kind, "finished")
        return job.state

    def status(self, name: str) -> tuple[str, str]:
        job = self.queue.latest(name)
        if job is None:
            return "", ""
        log = self.tail(job).read()
        if job.state == "lost":
            log = "\n".join(filter(None, [log, job.detail]))
        return self.describe(job), log

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

    def subfolders(self, path) -> dict:
        """The folder picker's view of ``path`` (a folder under a root; the first root when empty): its subfolders
        by name (hidden ones left out; the first ``FOLDERS`` when there are more, read in bounded memory), and its
        parent when that lies under a root too."""
        where = self.roots.check(path or self.workdir)
        if not where.is_dir():
            raise ValueError(f"{path} is not a folder")
        with os.scandir(where) as entries:
            names = heapq.nsmallest(FOLDERS + 1, (entry.name for entry in entries
                                                  if not entry.name.startswith(".") and entry.is_dir()))
        try:
            parent = str(self.roots.check(where.parent)) if where not in self.roots.folders else None
        except ValueError:
            parent = None
        shown_path = str(where.relative_to(self.workdir)) if self.workdir in (where, *where.parents) else str(where)
        return {"path": shown_path, "parent": parent, "subfolders": names[:FOLDERS],
                "truncated": len(names) > FOLDERS}

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
            name, commands, _ = self.data_job(path, side, dataset_name, vae_name, tokenizer_name, train_vae)
        except (ValueError, TypeError) as error:
            return refused(error)
        return self.start(name, commands)

    def data_job(self, path, side, dataset_name, vae_name, tokenizer_name, train_vae=True) -> tuple:
        """``("data", commands, None)`` of ``prepare_data``; a ValueError says what is refused."""
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
        commands += [data.encode_command(base / "shards", base / "latents", vae, side, buckets=False),
                     *data.dataset_commands(base / "shards", base / "captions", base / "latents", base / "dataset",
                                            tokenizer)]
        return "data", commands, None

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

    def train_job(self, preset, hardware, run, field_text, count) -> tuple:
        """``("train_RUN", [command], run folder)``; a ValueError says what is refused (a run in use too)."""
        preset_path, hardware_path, run_dir, flags = self.settings(preset, hardware, run, field_text)
        gpus = int(count or 1)
        holder = run_info(run_dir).state
        if holder.startswith("training"):
            raise ValueError(f"{run_dir} is in use: {holder}")
        return f"train_{run}", [training.training_command(preset_path, hardware_path, run_dir, flags, gpus)], run_dir

    def do_launch(self, preset, hardware, run, field_text, count, keep_going=False, gpu_set=0) -> tuple[str, str]:
        """The run queued (it starts when its GPU set is free; at once when nothing runs there)."""
        try:
            name, commands, run_dir = self.train_job(preset, hardware, run, field_text, count)
            self.check_gpus(count, gpu_set)
        except (ValueError, TypeError) as error:
            return f"**refused:** {error}", ""
        return "", self.start(name, commands, run=run_dir, keep_going=bool(keep_going), gpu_set=int(gpu_set or 0))

    def check_gpus(self, count, gpu_set) -> None:
        """A run's GPU count fits its set (``--gpus 0,1`` holds two); a ValueError says what would."""
        sets = self.queue.gpu_sets
        index = int(gpu_set or 0)
        if not 0 <= index < len(sets):
            raise ValueError(f"GPU set {index}: this studio has {len(sets)}, numbered from 0 (SD_Studio.py --gpus)")
        if sets[index] is not None and int(count or 1) > len(sets[index].split(",")):
            raise ValueError(f"{int(count)} GPUs on GPU set {index} ({sets[index]}): it has "
                             f"{len(sets[index].split(','))}; ask for fewer or pick a larger set")

    def estimate_job(self, preset, hardware, run, field_text, card_gb, count) -> tuple:
        preset_path, hardware_path, run_dir, flags = self.settings(preset, hardware, run, field_text)
        extra = ["--estimate_memory", "true", "--world_size", str(int(count or 1))]
        if card_gb:
            extra += ["--gpu_memory_gb", str(float(card_gb))]
        return f"estimate_{run}", [training.training_command(preset_path, hardware_path, run_dir, flags, 1) + extra], \
            None

    def do_estimate(self, preset, hardware, run, field_text, card_gb, count) -> tuple[str, str]:
        try:
            name, commands, _ = self.estimate_job(preset, hardware, run, field_text, card_gb, count)
        except (ValueError, TypeError) as error:
            return f"**refused:** {error}", ""
        return "", self.start(name, commands)

    def do_stop(self, run) -> None:
        """The run's job stopped: SIGTERM when it runs (the trainer saves), cancelled when it waits."""
        job = self.queue.latest(f"train_{run}")
        if job is not None:
            self.queue.stop(job.id)

    def run_name_for(self, preset, current):
        """The run name a recipe writes to (its ``out_dir``'s folder), for the page to follow the recipe."""
        try:
            return training.recipe_run_name(training.recipe(preset, self.repository, self.roots)) or current
        except ValueError:
            return current

    def estimate_summary(self, run) -> str:
        """The memory estimate of ``run``: its state (estimating, estimate done, failed) and its summary lines."""
        job = self.queue.latest(f"estimate_{run}")
        if job is None:
            return ""
        described = self.describe(job)
        state = ESTIMATE_STATES.get(described, described if described.startswith("estimat") else
                                    f"estimate {described}")
        lines = self.tail(job).read().splitlines()[1:]  # (the first is the command)
        starts = [i for i, line in enumerate(lines) if line.startswith(SUMMARY_START)]
        if starts:
            lines = [line for line in lines[starts[-1]:] if not line.startswith("{")]
        elif job.state not in ("running", "queued"):
            lines = lines[-6:]  # what went wrong
        else:
            lines = lines[-1:]
        return "\n".join([state, *lines])

    def metrics_tail(self, run: str) -> JsonlTail | None:
        """The run's ``metrics.jsonl`` followed from where the last read stopped (the latest ``TAILS`` runs)."""
        if run not in self.metrics:
            if not (self.runs_root / run).is_dir():
                return None
            while len(self.metrics) >= TAILS:
                self.metrics.pop(next(iter(self.metrics)))
            self.metrics[run] = JsonlTail(self.runs_root / run / "metrics.jsonl")
        return self.metrics[run]

    def refresh(self, run):
        """The Train page's live part: the run's state, loss, last metrics, grids, log, the runs, the estimate."""
        import pandas as pd

        table = [info.row() for info in list_runs(self.runs_root)]
        if not is_run_name(run):  # nothing of a run to show
            return "", pd.DataFrame(columns=["step", "loss"]), "", [], "", table, ""
        state, log = self.status(f"train_{run}")
        tail = self.metrics_tail(run)
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

    def plots(self, run):
        """The learning rate and every evaluation (``eval_*``: FID, CLIP score ...) over the run's steps."""
        import pandas as pd

        tail = self.metrics_tail(run) if is_run_name(run) else None
        rows = tail.read() if tail else []
        rates = pd.DataFrame([{"step": r["step"], "lr": r["lr"]} for r in rows
                              if isinstance(r.get("step"), int) and isinstance(r.get("lr"), (int, float))],
                             columns=["step", "lr"])
        evaluations = pd.DataFrame([{"step": r["step"], "evaluation": key[5:], "value": value}
                                    for r in (tail.evaluation_rows if tail else []) if isinstance(r.get("step"), int)
                                    for key, value in r.items() if key.startswith("eval_")
                                    and isinstance(value, (int, float))], columns=["step", "evaluation", "value"])
        return rates, evaluations

    # -- Jobs ----------------------------------------------------------------------------------------------------
    def jobs_view(self, selected=0, listed: int = 50):
        """The Jobs page: the queue's state, the latest ``listed`` jobs, and the selected job's log."""
        held = self.queue.held()
        sets = [f"GPU set {index} ({devices or 'all GPUs'}): " + (f"**held** ({held[index]})" if index in held
                                                                  else "going")
                for index, devices in enumerate(self.queue.gpu_sets)]
        table = [[job.id, job.name, self.describe(job), job.gpu_set if job.waits else "at once",
                  time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.created)), job.shown]
                 for job in self.queue.list(limit=listed)]
        log = ""
        try:
            if int(selected or 0) > 0:
                job = self.queue.get(int(selected))
                log = self.tail(job).read() + (f"\n{job.detail}" if job.detail else "")
        except (ValueError, TypeError):
            log = ""
        return "  \n".join(sets), table, log

    def job_action(self, action: str, job_id) -> str:
        """A button of the Jobs page: stop (or cancel), top, up, down, retry a job; resume the held queue."""
        try:
            if action == "resume":
                for gpu_set in list(self.queue.held()):
                    self.queue.resume(gpu_set)
                return "the queue goes on"
            job_id = int(job_id or 0)
            if action == "stop":
                return f"job {job_id}: {self.describe(self.queue.stop(job_id))}"
            if action == "retry":
                return f"queued again as job {self.queue.retry(job_id).id}"
            if action in ("top", "up", "down", "bottom"):
                return f"job {job_id}: {self.describe(self.queue.move(job_id, action))}"
            raise ValueError(f"action: stop, retry, top, up, down, bottom or resume, got {action!r}")
        except (ValueError, TypeError) as error:
            return f"**refused:** {error}"

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
        """The Sample page's button: ``sample_job``'s command started, its images followed."""
        try:
            name, commands, out = self.sample_job(run, lora_file, embedding_file, text, negative_text, sampler_name,
                                                  step_count, scale, first_seed, side, n, use_best, controlnet_path,
                                                  control_image, clip_skip)
        except (ValueError, TypeError) as error:
            return refused(error)
        said = self.start(name, commands)
        if not said.startswith("#"):
            self.sample_dir = out
        return said

    def sample_job(self, run, lora_file, embedding_file, text, negative_text, sampler_name, step_count, scale,
                   first_seed, side, n, use_best, controlnet_path, control_image, clip_skip="auto") -> tuple:
        """``("sample", [SD_ImageGen.py ...], the folder its images go to)``; a ValueError says what is refused."""
        import sd.imagegen.embedding  # SD_ImageGen.py's own reading of FILE:SCALE and FILE:TOKEN
        import sd.imagegen.lora
        import sd.sampling

        if sampler_name not in ("auto", *sd.sampling.SAMPLERS):
            raise ValueError(f"sampler: auto or one of {', '.join(sd.sampling.SAMPLERS)}, got {sampler_name!r}")
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
        return "sample", [python_command("SD_ImageGen.py", *args)], out

    def sample_refresh(self) -> tuple[str, list[str]]:
        state, _ = self.status("sample")
        out = self.sample_dir
        job = self.queue.latest("sample") if out is None else None  # started before this studio was
        if job is not None and "--out" in job.commands[0]:
            out = Path(job.commands[0][job.commands[0].index("--out") + 1])
        found = sorted(p for p in out.glob("*.png") if p.name != "grid.png") if out and out.is_dir() else []
        return state, [str(p) for p in found[-12:]]

    def do_tool(self, tool, first, second, rank) -> str:
        try:
            name, commands, _ = self.tool_job(tool, first, second, rank)
        except (ValueError, TypeError) as error:
            return refused(error)
        return self.start(name, commands)

    def tool_job(self, tool, first, second, rank) -> tuple:
        """``SD_Tools.py``: a LoRA extracted from ``first`` (the tuned model) minus ``second`` (its base), or the
        LoRA file ``first`` resized; at ``rank``, into ROOT/exports/ (as the job ``export``)."""
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
        return "export", [python_command("SD_Tools.py", *args)], None

    def do_export(self, run, kind) -> str:
        try:
            name, commands, _ = self.export_job(run, kind)
        except (ValueError, TypeError) as error:
            return refused(error)
        return self.start(name, commands)

    def export_job(self, run, kind) -> tuple:
        checkpoint = self.roots.source(run, presets=())
        if kind not in EXPORTS:
            raise ValueError(f"format: one of {', '.join(EXPORTS)}, got {kind!r}")
        flag, file_name, _ = EXPORTS[kind]
        target = self.roots.check(Path("exports") / Path(checkpoint).name / file_name)
        return "export", [python_command("SD_ImageGen.py", "--ckpt", checkpoint, flag, target)], None
