"""SD_Studio.py's server: the loopback address by default, the network only behind a token."""

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
studio = __import__("SD_Studio")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def outside_address() -> str | None:
    """This machine's address on its network (no packet is sent), or None when it has only the loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 1))
            address = sock.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def status(url: str, data: dict | None = None) -> int:
    request = urllib.request.Request(url, data=urllib.parse.urlencode(data).encode() if data else None)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def serve(tmp_path, *flags, token: str | None = None):
    port = free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
    env.pop("SD_STUDIO_TOKEN", None)
    if token:
        env["SD_STUDIO_TOKEN"] = token
    server = subprocess.Popen([sys.executable, str(ROOT / "SD_Studio.py"), "--port", str(port), *flags], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = server.stdout.readline()
    for _ in range(240):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.5)
    return server, port, first


def test_listen_needs_a_token(capsys, monkeypatch):
    monkeypatch.delenv("SD_STUDIO_TOKEN", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        studio.parse_args(["--listen"])
    assert exit_info.value.code == 2 and "SD_STUDIO_TOKEN" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        studio.parse_args(["--root", "/no/such/folder"])


@pytest.mark.slow
def test_loopback_by_default_and_the_network_behind_the_token(tmp_path):
    server, port, first = serve(tmp_path)
    try:
        assert first.startswith(f"SD studio on http://127.0.0.1:{port}")
        assert status(f"http://127.0.0.1:{port}/config") == 200
        address = outside_address()
        if address is not None:  # the machine's own network address is not served
            with pytest.raises(OSError):
                socket.create_connection((address, port), timeout=3).close()
    finally:
        server.terminate()
        server.wait(60)
    server, port, first = serve(tmp_path, "--listen", token="s3cret-token")
    try:
        assert first.startswith(f"SD studio on http://0.0.0.0:{port}")
        assert status(f"http://127.0.0.1:{port}/config") == 401  # nothing without logging in
        assert status(f"http://127.0.0.1:{port}/login", {"username": "studio", "password": "wrong"}) == 400
        assert status(f"http://127.0.0.1:{port}/login", {"username": "studio", "password": "s3cret-token"}) == 200
    finally:
        server.terminate()
        server.wait(60)
