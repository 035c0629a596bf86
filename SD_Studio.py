"""The local web studio: data, training runs, samples and exports in the browser, over the same commands.

    python SD_Studio.py [--root DIR ...] [--port 7860]           # http://127.0.0.1:7860, this machine only
    SD_STUDIO_TOKEN=secret python SD_Studio.py --listen          # every address, behind the token

Each page shows the command line it runs (copy it into a script or a SLURM job). Paths are confined to the
``--root`` folders (default: the current folder); commands run in the first, as typed there (``data/``,
``runs/`` and a recipe's relative paths are its), and their logs go to ROOT/.studio/logs.
"""

from __future__ import annotations

import argparse
import hmac
import os
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
    parser.add_bool("--listen", help=f"serve on every address, not only this machine's; needs {TOKEN_ENV} set "
                                     "(the password of the login page, user 'studio') (default: off)")
    args = parser.parse_args(argv)
    if args.listen and not os.environ.get(TOKEN_ENV):
        parser.error(f"--listen serves the studio to the network: set {TOKEN_ENV} to a password first")
    roots = [Path(root) for root in (args.root or [os.getcwd()])]
    for root in roots:
        if not root.is_dir():
            parser.error(f"--root {root} is not a folder")
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
    from sd.studio.app import build, server_options
    from sd.studio.runs import Roots

    roots = Roots(args.root)
    try:
        studio = build(roots, REPOSITORY)
    except sd.cli.MissingExtra as error:
        print(f"SD_Studio.py: {error}", file=sys.stderr)
        return 2
    host = "0.0.0.0" if args.listen else "127.0.0.1"
    auth = password_check(os.environ[TOKEN_ENV]) if args.listen else None
    try:
        studio.launch(server_name=host, server_port=args.port, auth=auth, allowed_paths=[str(r) for r in roots.folders],
                      show_error=True, quiet=True, inbrowser=False, prevent_thread_lock=True,
                      app_kwargs=server_options())
        print(f"SD studio on http://{host}:{args.port} (roots: {', '.join(str(r) for r in roots.folders)}); "
              "Ctrl-C stops it", flush=True)
        studio.block_thread()
    except KeyboardInterrupt:
        pass
    finally:
        studio.jobs.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
