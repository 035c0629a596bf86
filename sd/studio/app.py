"""The studio's pages (Gradio): Data, Train, Sample, Prefer and Export, each running the command line it shows.

The widgets call ``sd.studio.handlers.Studio``'s methods, which check every value they are given (Gradio's API
reaches them with any values, as any script can), build the same command a user would type, show it and run it
as a ``Job``; the timer then reads the jobs' logs, the run's ``metrics.jsonl`` and its sample grids.
``WithoutApiDescription`` keeps the API's description out of the pages themselves: a browser fetches it from
``/gradio_api/info``, which needs the login when the studio has one.
"""

import re
from pathlib import Path

import sd.cli
import sd.sampling
import sd.studio.prefer
import sd.studio.tags
from sd.studio.handlers import EXPORTS, Studio
from sd.studio.runs import Roots
from sd.studio.training import field_reference, gpus_present, presets


def build(roots: Roots, repository: Path, uploads: Path | None = None, gpu_sets: list[str | None] | None = None,
          webhook: str | None = None):
    """The studio's ``gr.Blocks``: jobs run in the first root (relative paths in recipes, ``data/``, ``runs/``,
    are the user's there, as on the command line) from the queue in ROOT/.studio; ``roots`` bound every path.
    The handlers are ``page_set.studio`` (the HTTP API serves the same)."""
    gr = sd.cli.import_extra("gradio", "studio", "the studio")
    from gradio.utils import get_upload_folder

    studio = Studio(roots, repository, uploads or Path(get_upload_folder()), gpu_sets=gpu_sets, webhook=webhook)
    polls = []  # (function, inputs, outputs) the timer refreshes

    with gr.Blocks(title="SD studio", analytics_enabled=False) as page_set:
        gr.Markdown("# Stable Diffusion 1.x studio\nEach page runs the command line it shows; copy it into a "
                    "script or a cluster job to run it without the studio.")
        with gr.Tab("Data", elem_id="tab-data"):
            data_page(gr, studio, polls)
        with gr.Tab("Train", elem_id="tab-train"):
            train_page(gr, studio, repository, polls)
        with gr.Tab("Sample", elem_id="tab-sample"):
            sample_page(gr, studio, polls)
        with gr.Tab("Prefer", elem_id="tab-prefer") as prefer_tab:
            sd.studio.prefer.page(gr, studio, polls, prefer_tab)
        with gr.Tab("Export", elem_id="tab-export"):
            export_page(gr, studio, polls)
        with gr.Tab("Jobs", elem_id="tab-jobs"):
            jobs_page(gr, studio, polls)
        timer = gr.Timer(2.0)  # at the top level: a timer inside a tab ticks only while its tab is shown
        for function, inputs, outputs in polls:
            timer.tick(function, inputs, outputs)

    page_set.studio = studio
    return page_set


def data_page(gr, studio: Studio, polls: list) -> None:
    """The README's quick start 2 up to the dataset: 64 px, a tiny VAE trained on the images, the tiny tokenizer."""
    with gr.Row():
        folder = gr.Textbox(label="image folder", value="my_images", elem_id="data-folder")
        resolution = gr.Number(label="resolution", value=64, precision=0, elem_id="data-resolution")
        name = gr.Textbox(label="dataset name (data/NAME)", value="mine", elem_id="data-name")
        read = gr.Button("Read folder", elem_id="data-read")
    with gr.Row():
        here = gr.Dropdown(choices=folder_choices(studio, "my_images"), value=None, label="open a folder (.. is up)",
                           allow_custom_value=True, elem_id="data-pick")  # its choices change per folder;
        # what is picked is checked by ``Studio.subfolders`` (under a root), not against the first list
    summary = gr.Markdown(elem_id="data-summary")
    with gr.Row():
        page = gr.Number(label="page", value=1, precision=0, minimum=1, elem_id="data-page")
    gallery = gr.Gallery(label="images and captions", columns=6, height=420, elem_id="data-gallery")
    with gr.Row():
        selected = gr.Textbox(label="image", interactive=False, elem_id="data-selected")
        caption = gr.Textbox(label="caption", elem_id="data-caption")
        save = gr.Button("Save caption", elem_id="data-save")
    skipped = gr.Dataframe(headers=["file", "why it would be skipped"], label="skipped files", elem_id="data-skipped")
    buckets = gr.Dataframe(headers=["bucket", "images"], label="aspect-ratio buckets", elem_id="data-buckets")
    with gr.Row():
        vae = gr.Textbox(label="VAE (hub id, folder or tiny)", value="runs/my_vae", elem_id="data-vae")
        train_vae = gr.Checkbox(label="train the VAE into that folder first when it holds none (train_vae.py "
                                      "--preset tiny, as the README's quick start 2); untick for a hub id",
                                value=True, elem_id="data-train-vae")
        tokenizer = gr.Textbox(label="tokenizer (hub id, folder or tiny)", value="tiny", elem_id="data-tokenizer")
        prepare = gr.Button("Import, encode and build the dataset", variant="primary", elem_id="data-prepare")
    data_command = gr.Code(label="command", language="shell", elem_id="data-command")
    data_state = gr.Textbox(label="state", interactive=False, elem_id="data-state")
    data_log = gr.Textbox(label="log", lines=8, max_lines=8, autoscroll=True, elem_id="data-log")

    def read_folder(path, side, number):
        return studio.show_folder(path, side, number, fresh=True)

    def pick(path, side, number, evt: gr.SelectData):
        return studio.pick(path, side, number, evt.index)

    def open_folder(current, choice):
        if not choice:
            return current, gr.update()
        try:
            where = studio.subfolders(current)
            there = studio.subfolders(where["parent"] if choice == ".." else str(Path(where["path"]) / choice))
        except (ValueError, OSError):
            there = None
        if there is None:
            return current, gr.update(choices=folder_choices(studio, current), value=None)
        return there["path"], gr.update(choices=choices_of(there), value=None)

    here.input(open_folder, [folder, here], [folder, here])
    folder.submit(lambda current: gr.update(choices=folder_choices(studio, current), value=None), [folder], [here])
    read.click(read_folder, [folder, resolution, page], [summary, gallery, skipped, buckets])
    page.change(studio.show_folder, [folder, resolution, page], [summary, gallery, skipped, buckets])
    gallery.select(pick, [folder, resolution, page], [selected, caption])
    save.click(studio.save_caption, [folder, selected, caption], [summary])
    prepare.click(studio.prepare_data, [folder, resolution, name, vae, tokenizer, train_vae], [data_command])
    polls.append((studio.data_status, [], [data_state, data_log]))
    sd.studio.tags.section(gr, studio, folder)


def folder_choices(studio: Studio, path: str) -> list[str]:
    """The picker's entries under ``path``: ``..`` (when the parent lies under a root) and its subfolders."""
    try:
        return choices_of(studio.subfolders(path))
    except (ValueError, OSError):
        return choices_of(studio.subfolders(""))


def choices_of(where: dict) -> list[str]:
    return ([".."] if where["parent"] else []) + where["subfolders"]


def train_page(gr, studio: Studio, repository: Path, polls: list) -> None:
    """A recipe (the README's quick start 2 by default), the run's name, fields; launch, estimate, stop, watch."""
    with gr.Row():
        preset = gr.Dropdown(presets(repository), label="preset", value="configs/quickstart/from_scratch.yaml",
                             allow_custom_value=True, elem_id="train-preset")
        hardware = gr.Dropdown([("none", "")] + presets(repository, "hardware"), value="",
                               label="card recipe (second --config)", elem_id="train-hardware")
        run_name = gr.Textbox(label="run name (runs/NAME)", value="mine", elem_id="train-run")
        gpus = gr.Number(label="GPUs", value=gpus_present(), precision=0, minimum=1, elem_id="train-gpus")
        keep_going = gr.Checkbox(label="if it fails, the queue goes on", value=False, elem_id="train-keep-going")
        gpu_set = gr.Dropdown([(f"{index}: {devices}", index) for index, devices in enumerate(studio.queue.gpu_sets)],
                              value=0, label="GPU set (SD_Studio.py --gpus)", visible=len(studio.queue.gpu_sets) > 1,
                              elem_id="train-gpu-set")
    fields = gr.Textbox(label="fields, one 'field: value' a line (override the preset)", lines=4,
                        elem_id="train-fields")
    verdict = gr.Markdown(elem_id="train-verdict")
    with gr.Row():
        card = gr.Number(label="card memory (GB) for the estimate; 0: this machine's", value=24, elem_id="train-card")
        estimate = gr.Button("Estimate memory", elem_id="train-estimate")
        launch = gr.Button("Queue / Resume", variant="primary", elem_id="train-launch")
        stop = gr.Button("Stop (saves a checkpoint)", variant="stop", elem_id="train-stop")
    train_command = gr.Code(label="command", language="shell", elem_id="train-command")
    estimate_result = gr.Textbox(label="memory estimate", lines=4, max_lines=20, interactive=False,
                                 elem_id="train-estimate-result")
    train_state = gr.Textbox(label="state", interactive=False, elem_id="train-state")
    with gr.Row():
        loss_plot = gr.LinePlot(x="step", y="loss", title="loss", elem_id="train-loss")
        lr_plot = gr.LinePlot(x="step", y="lr", title="learning rate", elem_id="train-lr")
        eval_plot = gr.LinePlot(x="step", y="value", color="evaluation", title="evaluations (eval.every)",
                                elem_id="train-evals")
    last = gr.Textbox(label="last logged step", interactive=False, elem_id="train-last")
    samples = gr.Gallery(label="sample grids", columns=4, height=260, elem_id="train-samples")
    train_log = gr.Textbox(label="log", lines=8, max_lines=8, autoscroll=True, elem_id="train-log")
    run_table = gr.Dataframe(headers=["run", "state", "step", "of", "loss", "folder"], label="runs",
                             elem_id="train-runs")
    with gr.Accordion("every field: default, allowed values, what it does", open=False):
        gr.Dataframe(value=field_reference(), headers=["field", "default", "allowed", "doc"], wrap=True)

    preset.change(studio.run_name_for, [preset, run_name], [run_name])
    launch.click(studio.do_launch, [preset, hardware, run_name, fields, gpus, keep_going, gpu_set],
                 [verdict, train_command])
    estimate.click(studio.do_estimate, [preset, hardware, run_name, fields, card, gpus], [verdict, train_command])
    stop.click(studio.do_stop, [run_name], [])
    polls.append((studio.refresh, [run_name],
                  [train_state, loss_plot, last, samples, train_log, run_table, estimate_result]))
    polls.append((studio.plots, [run_name], [lr_plot, eval_plot]))


def sample_page(gr, studio: Studio, polls: list) -> None:
    """The README's quick start 2's last command: runs/mine, "a red circle", the sampler's own steps and CFG."""
    with gr.Row():
        sample_run = gr.Textbox(label="run folder, checkpoint, single .safetensors/.ckpt (or hub id)", value="runs/mine",
                                elem_id="sample-run")
        lora = gr.Textbox(label="LoRA / LyCORIS file (optional, FILE:SCALE)", elem_id="sample-lora")
        embedding = gr.Textbox(label="embedding (optional, FILE:TOKEN)", elem_id="sample-embedding")
    prompt = gr.Textbox(label="prompt", value="a red circle", elem_id="sample-prompt")
    negative = gr.Textbox(label="negative prompt", elem_id="sample-negative")
    with gr.Row():
        sampler = gr.Dropdown(["auto", *sd.sampling.SAMPLERS], value="auto", label="sampler",
                              elem_id="sample-sampler")
        steps = gr.Number(label="steps (0: the sampler's default)", value=0, precision=0, elem_id="sample-steps")
        cfg = gr.Number(label="CFG (0: the sampler's default, 7.5; 1 with lcm)", value=0, elem_id="sample-cfg")
        seed = gr.Number(label="seed", value=0, precision=0, elem_id="sample-seed")
        size = gr.Number(label="size (px, 0: the model's)", value=0, precision=0, elem_id="sample-size")
        count = gr.Number(label="images", value=4, precision=0, elem_id="sample-n")
        best = gr.Checkbox(label="best checkpoint", value=False, elem_id="sample-best")
        clip_skip = gr.Dropdown(["auto", "1", "2"], value="auto", label="CLIP skip (auto: what the model records)",
                                elem_id="sample-clip-skip")
    with gr.Row():
        controlnet = gr.Textbox(label="ControlNet (optional)", elem_id="sample-controlnet")
        control = gr.Image(label="its conditioning image", type="filepath", elem_id="sample-control")
    go = gr.Button("Sample", variant="primary", elem_id="sample-go")
    sample_command = gr.Code(label="command", language="shell", elem_id="sample-command")
    sample_state = gr.Textbox(label="state", interactive=False, elem_id="sample-state")
    images = gr.Gallery(label="images (their PNGs carry the settings as parameters)", columns=4,
                        elem_id="sample-images")
    go.click(studio.do_sample, [sample_run, lora, embedding, prompt, negative, sampler, steps, cfg, seed, size,
                                count, best, controlnet, control, clip_skip], [sample_command])
    polls.append((studio.sample_refresh, [], [sample_state, images]))


def export_page(gr, studio: Studio, polls: list) -> None:
    """The README's quick start 3's export: the LoRA of runs/my_lora in the kohya layout."""
    export_run = gr.Textbox(label="run folder or checkpoint", value="runs/my_lora", elem_id="export-run")
    export_format = gr.Dropdown(list(EXPORTS), value="LoRA (kohya layout)", label="format", elem_id="export-format")
    gr.Dataframe(value=[[name, flag, where] for name, (flag, _, where) in EXPORTS.items()],
                 headers=["format", "SD_ImageGen.py flag", "where other tools expect it"], wrap=True)
    export = gr.Button("Export", variant="primary", elem_id="export-go")
    export_command = gr.Code(label="command", language="shell", elem_id="export-command")
    export_state = gr.Textbox(label="state", interactive=False, elem_id="export-state")
    export_log = gr.Textbox(label="log", lines=6, elem_id="export-log")
    export.click(studio.do_export, [export_run, export_format], [export_command])
    polls.append((studio.export_status, [], [export_state, export_log]))
    gr.Markdown("A LoRA from a fine-tuned model and its base, or a LoRA at a lower rank (`SD_Tools.py`, "
                "docs/tools.md): written to exports/, the state and log above.")
    with gr.Row():
        tool = gr.Dropdown(["extract", "resize"], value="extract", label="tool", elem_id="tool-name")
        first = gr.Textbox(label="extract: the tuned model; resize: the LoRA file", elem_id="tool-first")
        second = gr.Textbox(label="extract: its base model", elem_id="tool-second")
        rank = gr.Number(label="rank", value=32, precision=0, elem_id="tool-rank")
    run_tool = gr.Button("Run the tool", elem_id="tool-go")
    run_tool.click(studio.do_tool, [tool, first, second, rank], [export_command])


def jobs_page(gr, studio: Studio, polls: list) -> None:
    """The queue: every job with its state, moved, stopped, cancelled or retried by its number; its log."""
    queue_state = gr.Markdown(elem_id="jobs-queue")
    table = gr.Dataframe(headers=list(JOB_COLUMNS), label="jobs, newest first", wrap=True, elem_id="jobs-table")
    with gr.Row():
        number = gr.Number(label="job", value=0, precision=0, minimum=0, elem_id="jobs-id")
        buttons = {action: gr.Button(label, elem_id=f"jobs-{action}") for action, label in JOB_ACTIONS.items()}
        resume = gr.Button("Resume the queue", elem_id="jobs-resume")
    said = gr.Markdown(elem_id="jobs-said")
    log = gr.Textbox(label="its log", lines=10, max_lines=10, autoscroll=True, elem_id="jobs-log")
    for action, button in buttons.items():
        button.click(lambda job_id, action=action: studio.job_action(action, job_id), [number], [said])
    resume.click(lambda: studio.job_action("resume", 0), [], [said])
    polls.append((studio.jobs_view, [number], [queue_state, table, log]))


JOB_COLUMNS = ("id", "name", "state", "GPU set", "queued at", "command")
JOB_ACTIONS = {"stop": "Stop / cancel", "top": "To the top", "up": "Up", "down": "Down", "retry": "Retry"}


def server_options(api=None) -> dict:
    """The settings of Gradio's web app for ``launch(app_kwargs=...)``: the pages without the API description,
    and the studio's own HTTP API mounted at ``/api`` (ahead of Gradio's routes)."""
    from starlette.middleware import Middleware
    from starlette.routing import Mount

    options = {"middleware": [Middleware(WithoutApiDescription)]}
    if api is not None:
        options["routes"] = [Mount("/api", app=api)]
    return options


API_INFO = re.compile(rb"<script>window\.gradio_api_info = .*?;</script>", re.DOTALL)


class WithoutApiDescription:
    """ASGI middleware: every HTML page goes out without the API's description that Gradio writes into it (for
    anyone, logged in or not: the login page carried every endpoint, its fields and defaults). The page's own
    script then asks ``/gradio_api/info`` for it, which answers only after the login."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "GET":
            return await self.app(scope, receive, send)
        start, parts = None, []

        async def hold(message):
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                if not headers.get(b"content-type", b"").startswith(b"text/html"):
                    start = False  # not a page: passed on as it comes
                    return await send(message)
                start = message
                return None
            if start is False:
                return await send(message)
            parts.append(message.get("body", b""))
            if message.get("more_body"):
                return None
            body = API_INFO.sub(b"<script>window.gradio_api_info = null;</script>", b"".join(parts))
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, hold)
