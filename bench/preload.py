"""Python scripts run in children forked from one interpreter that has imported the heavy libraries once.

    python bench/preload.py serve SOCKET MODULE...     # imports the modules, then serves SOCKET
    python bench/preload.py run SOCKET SCRIPT ARGS...  # as `python SCRIPT ARGS`, in a child of the server

bench/gpu_suite.sh --smoke runs its pieces this way: at the tiniest size on a CPU a piece spends most
of its time importing torch, diffusers and transformers (about 10 of its 13 s on 2 cores), and the
server pays that once. The full suite on a GPU starts every piece in a fresh process.

``run`` hands the server its standard input, output and error and the script's command line; the
server forks a child (a process group of its own) that runs the script as ``__main__`` in the server's
folder and environment, and sends back its exit status (128 + N for a signal N), which ``run`` exits
with. A SIGTERM or SIGINT to ``run`` (a timeout) goes on to the child's group, and if ``run`` itself
dies, the server kills the group. The server serves one script at a time, and ends when the process
that started it does. ``run`` imports nothing but the standard library, so it starts in milliseconds.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import sys
import traceback


def serve(path: str, modules: list[str]) -> None:
    for name in modules:
        importlib.import_module(name)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen()
    os.rename(path + ".tmp", path)  # the socket appears when the imports are done
    listener.settimeout(1.0)
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        with conn:
            conn.settimeout(None)
            serve_one(conn, listener)


def serve_one(conn: socket.socket, listener: socket.socket) -> None:
    message, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    pid = os.fork()
    if pid == 0:
        listener.close()
        conn.close()
        run_script(json.loads(message), fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        readable, _, _ = select.select([conn], [], [], 0.1)
        if readable and not conn.recv(1):  # `run` is gone: so goes its script
            kill_group(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return
    code = os.waitstatus_to_exitcode(status)
    conn.sendall(f"{128 - code if code < 0 else code}\n".encode())


def run_script(argv: list[str], fds: list[int]) -> None:
    """In the forked child: the script as ``python SCRIPT ARGS`` would run it; never returns."""
    import runpy

    code = 1
    try:
        os.setpgid(0, 0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        script = os.path.abspath(argv[0])  # as __main__.__file__ is
        sys.argv = argv
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the traceback goes to the script's stderr, as Python's would
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe; the exit status still counts
                pass
        os._exit(code)


def kill_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


def run(path: str, argv: list[str]) -> int:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    socket.send_fds(client, [json.dumps(argv).encode()], [0, 1, 2])
    replies = client.makefile("r")
    pid = int(replies.readline())

    def forward(signum, frame):
        kill_group(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    line = replies.readline()
    return int(line) if line else 1


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "serve":
        serve(argv[1], argv[2:])
        return 0
    if len(argv) >= 3 and argv[0] == "run":
        return run(argv[1], argv[2:])
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
