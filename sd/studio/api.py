"""The studio's HTTP API under ``/api/``: jobs submitted, listed, followed, stopped, moved and retried; a run's
metrics and sample grids; a folder's scan and its subfolders. JSON in and out, described by ``/api/openapi.json``
(docs/studio_api.json is the same file, kept in the repository).

A job is submitted by kind with the fields of the page that builds it (``POST /api/jobs`` with ``{"kind":
"train", "recipe": ..., "run": ...}``) and goes through the very checks and command builders the pages use
(``Studio.train_job`` ...): a field the kind does not have, a path outside ``--root`` or a kind that is not one
of ours is answered ``{"error": ...}`` with a 4xx status, and nothing runs.

Who may call: with a token (``SD_STUDIO_TOKEN``, always with ``--listen``) every route, downloads included,
wants ``Authorization: Bearer TOKEN`` (or the login's user and token as HTTP basic auth). Without one the studio
listens on the loopback only, and the API still refuses a request whose ``Host`` is not a loopback name (a web
page that rebinds its DNS name to 127.0.0.1), and a POST that is not ``application/json`` or comes from a page of
another origin (a form a web page submits behind the user's back).
"""


import base64
import hmac
import json
import urllib.parse
from pathlib import Path
from typing import Annotated, Literal, Union

import sd.studio.data as data
import sd.studio.prefer
from sd.studio.handlers import PAGE, Studio
from sd.studio.jobs import last_lines
from sd.studio.queue import ENDED, LIVE, QueueError
from sd.studio.runs import folder_name, list_runs, run_info

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
MAX_BODY = 1 << 20  # bytes of a request's body
SAMPLES_LISTED = 16  # latest sample grids a run's listing shows


def create(studio: Studio, token: str | None = None):
    """The FastAPI application of ``studio``'s API, to be mounted at ``/api``."""
    from fastapi import Depends, FastAPI, Query, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.exceptions import HTTPException

    class Refused(Exception):
        def __init__(self, status: int, message: str):
            self.status, self.message = status, message

    def allowed(request: Request) -> None:
        length = request.headers.get("content-length", "0")
        if not length.isdigit() or int(length) > MAX_BODY:
            raise Refused(413, f"a request of {request.headers['content-length']} bytes: the API takes at most "
                               f"{MAX_BODY} (a job's fields are a few hundred)")
        if token is not None:
            if not authorised(request.headers.get("authorization", ""), token):
                raise Refused(401, "this studio wants its token: Authorization: Bearer $SD_STUDIO_TOKEN")
            return
        host = hostname("//" + request.headers.get("host", ""))
        if host not in LOOPBACK_HOSTS:
            raise Refused(403, f"host {host!r}: without a token the studio answers only on 127.0.0.1 or localhost")
        if request.method == "POST":
            if not request.headers.get("content-type", "").startswith("application/json"):
                raise Refused(415, "a POST to the API sends JSON (Content-Type: application/json)")
            origin = request.headers.get("origin")
            if origin and hostname(origin) not in LOOPBACK_HOSTS:
                raise Refused(403, f"origin {origin}: the API answers no other web page's requests")

    api = FastAPI(title="SD studio API", version="1", docs_url=None, redoc_url=None, openapi_url=None,
                  servers=[{"url": "/api"}],
                  dependencies=[Depends(allowed)],
                  description="The studio's jobs, runs and folders. Every job runs a command line the pages "
                              "would build, shown in its `command`.")

    @api.exception_handler(Refused)
    async def refused(request, error: Refused):
        return JSONResponse({"error": error.message}, status_code=error.status)

    @api.exception_handler(RequestValidationError)
    async def invalid(request, error: RequestValidationError):
        return JSONResponse({"error": "; ".join(problem_text(problem) for problem in error.errors())},
                            status_code=422)

    @api.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        return JSONResponse({"error": str(error.detail)}, status_code=error.status_code)

    class Fields(BaseModel):
        model_config = ConfigDict(extra="forbid")

    class Queueing(Fields):
        waits: bool | None = Field(None, description="wait in the GPU set's queue (default: training and data "
                                                     "preparation wait, the rest start at once)")
        gpu_set: int = Field(0, ge=0, description="which --gpus set runs it")
        keep_going: bool = Field(False, description="its failure does not hold the queue")
        webhook: str | None = Field(None, description="a URL told of the job's start, grids and end (JSON POST)")

    class Train(Queueing):
        kind: Literal["train"]
        recipe: str = Field(description="a recipe of configs/ or a YAML file under a root")
        run: str = Field(description="the run's folder name: runs/RUN")
        hardware: str = Field("", description="a card's recipe, the second --config")
        fields: dict[str, Union[str, int, float, bool, list, None]] | str = Field(
            {}, description="fields overriding the recipe: {field: value} or 'field: value' lines")
        gpus: int = Field(1, ge=1, description="GPUs (torchrun with more than one)")

    class Estimate(Train):
        kind: Literal["estimate"]
        card_gb: float = Field(0, ge=0, description="the card's memory in GB (0: this machine's)")

    class Data(Queueing):
        kind: Literal["data"]
        folder: str
        resolution: int = Field(64, ge=8)
        dataset: str = Field("mine", description="data/DATASET")
        vae: str = "runs/my_vae"
        tokenizer: str = "tiny"
        train_vae: bool = True

    class Sample(Queueing):
        kind: Literal["sample"]
        model: str = Field(description="a run folder, checkpoint, single file or hub id")
        prompt: str
        lora: str = ""
        embedding: str = ""
        negative: str = ""
        sampler: str = "auto"
        steps: int = Field(0, ge=0)
        cfg: float = Field(0, ge=0)
        seed: int = 0
        size: int = Field(0, ge=0)
        n: int = Field(4, ge=1, le=64)
        best: bool = False
        controlnet: str = ""
        control: str = ""
        clip_skip: Literal["auto", "1", "2"] = "auto"

    class Export(Queueing):
        kind: Literal["export"]
        model: str
        format: str = "LoRA (kohya layout)"

    class Tool(Queueing):
        kind: Literal["tool"]
        tool: Literal["extract", "resize"]
        first: str
        second: str = ""
        rank: int = Field(32, ge=1)

    class Prefer(Queueing):
        kind: Literal["prefer"]
        folder: str = Field(description="a draw folder of 01g_draw_pairs.py: its answers made into pair shards")

    Job = Annotated[Union[Train, Estimate, Data, Sample, Export, Tool, Prefer], Field(discriminator="kind")]

    class Move(Fields):
        where: Literal["top", "up", "down", "bottom"]

    class Resume(Fields):
        gpu_set: int = Field(0, ge=0)

    def built(job) -> tuple[str, list, Path | None]:
        """The job's name, commands and run folder from the page's own builder: its checks, its refusals."""
        if job.kind in ("train", "estimate"):
            text = job.fields if isinstance(job.fields, str) else \
                "\n".join(f"{key}: {json.dumps(value)}" for key, value in job.fields.items())
            studio.check_gpus(job.gpus, job.gpu_set)
            if job.kind == "train":
                return studio.train_job(job.recipe, job.hardware, job.run, text, job.gpus)
            return studio.estimate_job(job.recipe, job.hardware, job.run, text, job.card_gb, job.gpus)
        if job.kind == "data":
            return studio.data_job(job.folder, job.resolution, job.dataset, job.vae, job.tokenizer, job.train_vae)
        if job.kind == "sample":
            return studio.sample_job(job.model, job.lora, job.embedding, job.prompt, job.negative, job.sampler,
                                     job.steps, job.cfg, job.seed, job.size, job.n, job.best, job.controlnet,
                                     job.control or None, job.clip_skip)
        if job.kind == "export":
            return studio.export_job(job.model, job.format)
        if job.kind == "prefer":
            page = sd.studio.prefer.PreferPage(studio)
            return sd.studio.prefer.JOB, [page.pairs_command(page.read(job.folder))], None
        return studio.tool_job(job.tool, job.first, job.second, job.rank)

    def shown_job(record, lines: int = 0) -> dict:
        body = {**record.public(), "described": studio.describe(record)}
        if lines:
            body["log"] = last_lines(studio.queue.log(record), lines)
        return body

    def queued(call):
        try:
            return call()
        except (ValueError, TypeError, OSError) as error:  # QueueError, OutsideRoots: said, nothing changed
            raise Refused(409 if isinstance(error, QueueError) else 400, str(error)) from None

    @api.get("/openapi.json", summary="This description (OpenAPI 3)", include_in_schema=False)
    def description() -> dict:  # FastAPI's own route would skip the token's check
        return api.openapi()

    @api.post("/jobs", status_code=201, summary="Submit a job (checked as its page checks it)")
    def submit(job: Job) -> dict:
        def start():
            name, commands, run = built(job)
            record = studio.submit(name, commands, run=run, waits=job.waits, gpu_set=job.gpu_set,
                                   keep_going=job.keep_going, webhook=job.webhook)
            return shown_job(record)
        return queued(start)

    @api.get("/jobs", summary="The jobs, newest first, a page at a time")
    def jobs(state: Annotated[list[str], Query()] = [], limit: int = Query(50, ge=1, le=500),  # noqa: B006
             before: int | None = Query(None, description="the id the previous page ended at")) -> dict:
        unknown = set(state) - {"queued", *LIVE, *ENDED}
        if unknown:
            raise Refused(400, f"state {sorted(unknown)}: one of queued, {', '.join(LIVE + ENDED)}")
        records = studio.queue.list(tuple(state), limit, before)
        return {"jobs": [shown_job(record) for record in records],
                "next": records[-1].id if len(records) == limit else None}

    @api.get("/jobs/{job_id}", summary="A job's state, command and the last lines of its log")
    def job(job_id: int, lines: int = Query(50, ge=0, le=2000)) -> dict:
        return queued(lambda: shown_job(studio.queue.get(job_id), lines))

    @api.post("/jobs/{job_id}/stop", summary="Stop a running job (it saves) or cancel a queued one")
    def stop(job_id: int) -> dict:
        return queued(lambda: shown_job(studio.queue.stop(job_id)))

    @api.post("/jobs/{job_id}/retry", status_code=201, summary="Queue an ended job again (a run resumes)")
    def retry(job_id: int) -> dict:
        return queued(lambda: shown_job(studio.queue.retry(job_id)))

    @api.post("/jobs/{job_id}/move", summary="Move a queued job within its set's queue")
    def move(job_id: int, where: Move) -> dict:
        return queued(lambda: shown_job(studio.queue.move(job_id, where.where)))

    @api.get("/queue", summary="Each GPU set: its devices, its running job, its queue, whether it is held")
    def queue() -> dict:
        held = studio.queue.held()
        running = studio.queue.list(LIVE, limit=100)
        return {"sets": [{"gpu_set": index, "devices": devices, "held": held.get(index),
                          "running": [shown_job(r) for r in running if r.gpu_set == index and r.waits],
                          "queued": [shown_job(r) for r in studio.queue.waiting(index)]}
                         for index, devices in enumerate(studio.queue.gpu_sets)]}

    @api.post("/queue/resume", summary="Let a set's queue go on after a failure held it")
    def resume(which: Resume) -> dict:
        queued(lambda: studio.queue.resume(which.gpu_set))
        return queue()

    def run_folder(name: str) -> Path:
        folder = queued(lambda: studio.roots.check(studio.runs_root / folder_name(name)))
        if not folder.is_dir():
            raise Refused(404, f"no run {name} in {studio.runs_root}")
        return folder

    @api.get("/runs", summary="The runs under runs/ with their state")
    def runs() -> dict:
        return {"runs": [{"name": info.name, "state": info.state, "step": info.step, "max_steps": info.max_steps,
                          "loss": info.loss} for info in list_runs(studio.runs_root)]}

    @api.get("/runs/{name}/metrics", summary="A run's logged steps (at most 2,000, evenly spaced) and evaluations")
    def metrics(name: str) -> dict:
        run_folder(name)
        tail = studio.metrics_tail(name)
        rows = tail.read()
        info = run_info(studio.runs_root / name)
        return {"run": name, "state": info.state, "points": rows, "evaluations": tail.evaluation_rows,
                "last": tail.last}

    @api.get("/runs/{name}/samples", summary="A run's latest sample grids")
    def samples(name: str) -> dict:
        folder = run_folder(name)
        grids = sorted((folder / "samples").glob("**/*.png"), key=lambda p: p.stat().st_mtime)[-SAMPLES_LISTED:]
        return {"samples": [{"file": str(path.relative_to(folder / "samples")),
                             "url": f"/api/runs/{name}/samples/{path.relative_to(folder / 'samples')}"}
                            for path in grids]}

    @api.get("/runs/{name}/samples/{file:path}", summary="One sample grid (PNG)")
    def sample_file(name: str, file: str):
        folder = run_folder(name) / "samples"
        path = queued(lambda: studio.roots.check(folder / file))
        if folder.resolve() not in path.parents or path.suffix.lower() != ".png" or not path.is_file():
            raise Refused(404, f"no sample grid {file} in {folder}")
        return FileResponse(path, media_type="image/png")

    @api.get("/folders", summary="A folder under a root: its subfolders, and its images as 01e reads them")
    def folders(path: str = ".", resolution: int = Query(64, ge=8), page: int = Query(1, ge=1),
                scan: bool = Query(False, description="scan its images (headers only)")) -> dict:
        where = queued(lambda: studio.roots.check(path))
        if not where.is_dir():
            raise Refused(404, f"{path} is not a folder")
        body = {"folder": str(where), **studio.subfolders(str(where))}
        if scan:
            found = studio.scanned(where, resolution, fresh=page == 1)
            body.update(images=len(found.images), skipped=[list(row) for row in found.skipped],
                        buckets=dict(sorted(found.buckets.items())), page=page,
                        captions=[{"image": rel, "caption": text} for rel, text in
                                  data.page_of(found, page, PAGE)])
        return body

    return api


def hostname(address: str) -> str | None:
    """The host of a URL or of ``//`` + a Host header, without its port (``[::1]:7860`` -> ``::1``)."""
    try:
        return urllib.parse.urlsplit(address).hostname
    except ValueError:  # a malformed address: no host
        return None


def authorised(header: str, token: str) -> bool:
    """``Authorization: Bearer TOKEN``, or ``Basic`` with the login's user ``studio`` and the token; compared in
    constant time as UTF-8 bytes (HTTP carries a header's bytes, which Starlette hands over as Latin-1)."""
    raw = header.encode("latin-1", errors="replace")
    scheme, _, value = raw.partition(b" ")
    expected = token.encode("utf-8")
    if scheme.lower() == b"bearer":
        return hmac.compare_digest(value.strip(), expected)
    if scheme.lower() == b"basic":
        try:
            user, _, password = base64.b64decode(value.strip(), validate=True).partition(b":")
        except ValueError:
            return False
        same_user = hmac.compare_digest(user, b"studio")
        return hmac.compare_digest(password, expected) and same_user
    return False


def problem_text(problem: dict) -> str:
    """One validation problem of a request as a line: where, and what is wrong (an unknown field named)."""
    where = ".".join(str(part) for part in problem.get("loc", ()) if part not in ("body",))
    if problem.get("type") == "extra_forbidden":
        return f"{where}: not a field of this kind of job"
    if problem.get("type") == "union_tag_invalid":
        return f"kind: one of train, estimate, data, sample, export, tool, prefer; got {problem.get('input', {}).get('kind')!r}"
    return f"{where}: {problem.get('msg', 'invalid')}"


def write_description(path: str) -> None:
    """``docs/studio_api.json``: the API's OpenAPI description, as ``/api/openapi.json`` serves it."""
    import tempfile

    import sd.files
    from sd.studio.runs import Roots

    with tempfile.TemporaryDirectory() as folder:
        studio = Studio(Roots([folder]), Path(__file__).resolve().parents[2])
        description = create(studio).openapi()
        studio.queue.close()
        studio.webhooks.close(wait=0)
    sd.files.write_text_atomic(path, json.dumps(description, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    import sys

    write_description(sys.argv[1] if len(sys.argv) > 1 else "docs/studio_api.json")
