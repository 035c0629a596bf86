"""The local web studio: data, training runs, samples and exports in the browser, over the same commands.

    python SD_Studio.py [--root DIR ...] [--port 7860]           # http://127.0.0.1:7860, this machine only
    SD_STUDIO_TOKEN=secret python SD_Studio.py --listen          # every address, behind the token
    python SD_Studio.py --gpus 0,1 --gpus 2,3                    # two queues, one per set of GPUs

Each page shows the command line it runs (copy it into a script or a SLURM job). Paths are confined to the
``--root`` folders (default: the current folder); commands run in the first, as typed there (``data/``,
``runs/`` and a recipe's relative paths are its), from a queue kept in ROOT/.studio (jobs.sqlite3, each job's
log in jobs/ID/). Jobs go on when the studio stops; started again, it follows them. The HTTP API is under /api/
(docs/studio.md).
"""

from __future__ import annotations

import argparse
import hmac
import os
import re
import signal
import sys
from pathlib import Path

import sd.cli
import sd.runtime

TOKEN_ENV = "SD_STUDIO_TOKEN"
REPOSITORY = Path(__file__).resolve().parent


def parse_args(argv=None) -> argparse.Namespace:
    parser = sd.cli.ArgumentParser(prog="SD_Studio.py", description=__doc__)
    parser.add_argument("--root", action="append", default=[],
                        help="a folder the studio may read and write under; repeatable (default: the current folder)")
    parser.add_argument("--port", type=int, default=7860, help="the port to serve on (default: %(default)s)")
    parser.add_argument("--gpus", action="append", default=[], metavar="IDS",
                        help="a set of GPUs with a queue of its own, as CUDA_VISIBLE_DEVICES lists them (e.g. 0,1); "
                             "repeatable (default: one queue over the GPUs the environment shows)")
    parser.add_argument("--webhook", default=None, metavar="URL",
                        help="an http(s) URL told of every job's start, validation grids and end by a JSON POST "
                             "(each job may name its own too) (default: none)")
    parser.add_bool("--stop_jobs_on_exit", help="stop the running jobs (they save) when the studio stops, instead "
                                                "of leaving them running for the next studio to follow (default: off)")
    parser.add_bool("--listen", help=f"serve on every address, not only this machine's; needs {TOKEN_ENV} set "
                                     "(the password of the login page, user 'studio') (default: off)")
    args = parser.parse_args(argv)
    if args.listen and not os.environ.get(TOKEN_ENV):
        parser.error(f"--listen serves the studio to the network: set {TOKEN_ENV} to a password first")
    roots = [Path(root) for root in (args.root or [os.getcwd()])]
    for root in roots:
        if not root.is_dir():
            parser.error(f"--root {root} is not a folder")
    for ids in args.gpus:
        if not re.fullmatch(r"[0-9]+(,[0-9]+)*|[A-Za-z0-9-]+(,[A-Za-z0-9-]+)*", ids):
            parser.error(f"--gpus {ids!r}: device numbers (or GPU-UUIDs) separated by commas, e.g. --gpus 0,1")
    if args.webhook:
        from sd.studio.webhooks import check_url

        try:
            check_url(args.webhook)
        except ValueError as error:
            parser.error(f"--webhook: {error}")
    return argparse.Namespace(**{**vars(args), "root": roots})


def password_check(token: str):
    """The login's check: user ``studio`` and ``token``, compared as UTF-8 bytes in constant time (any letter)."""
    expected_user, expected = b"studio", token.encode("utf-8")

    def check(user: str, password: str) -> bool:
        same_user = hmac.compare_digest(str(user).encode("utf-8"), expected_user)
        return hmac.compare_digest(str(password).encode("utf-8"), expected) and same_user

    return check


def main(argv=None) -> int:
    sd.runtime.start_process(uses_torch=False)
    args = parse_args(argv)
    print("starting the studio ...", flush=True)  # Gradio's import and the pages take half a minute
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # never calls out
    from sd.studio import api as studio_api
    from sd.studio.app import build, server_options
    from sd.studio.queue import StudioBusy
    from sd.studio.runs import Roots

    roots = Roots(args.root)
    try:  # StudioBusy: another studio has the folder, or its job table is damaged
        pages = build(roots, REPOSITORY, gpu_sets=args.gpus or None, webhook=args.webhook)
        handlers = pages.studio
        handlers.queue.follow()
    except (sd.cli.MissingExtra, StudioBusy) as error:
        print(f"SD_Studio.py: {error}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, interrupted)  # a service manager's stop: the same shutdown as Ctrl-C, which
    # says which jobs go on (or stops them with --stop_jobs_on_exit)
    host = "0.0.0.0" if args.listen else "127.0.0.1"
    token = os.environ.get(TOKEN_ENV) or None
    auth = password_check(token) if args.listen else None
    api = studio_api.create(handlers, token=token)
    try:
        pages.launch(server_name=host, server_port=args.port, auth=auth, allowed_paths=[str(r) for r in roots.folders],
                     show_error=True, quiet=True, inbrowser=False, prevent_thread_lock=True,
                     app_kwargs=server_options(api))
        print(f"SD studio on http://{host}:{args.port} (roots: {', '.join(str(r) for r in roots.folders)}); "
              f"its API on http://{host}:{args.port}/api/; Ctrl-C stops it", flush=True)
        pages.block_thread()
    except KeyboardInterrupt:
        pass
    finally:
        shut_down(handlers, args.stop_jobs_on_exit)
    return 0


def interrupted(number, frame):
    raise KeyboardInterrupt


def shut_down(handlers, stop_jobs: bool) -> None:
    """The queue closed; running jobs stopped (they save) or left running, said either way."""
    live = handlers.queue.list(("running", "stopping"), limit=1000)
    if stop_jobs:
        handlers.queue.stop_all()
    elif live:
        print(f"{len(live)} job(s) go on: " + ", ".join(f"{job.name} (pid {job.pid})" for job in live) +
              "; SD_Studio.py started again follows them (--stop_jobs_on_exit stops them with the studio)", flush=True)
    handlers.queue.close()
    handlers.webhooks.close()


if __name__ == "__main__":
    sys.exit(main())
