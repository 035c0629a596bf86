"""SD_Studio.py's server: the loopback address by default, the network only behind a token; before the login
nothing of the API; a handler called through Gradio's API checks what it is given as the page's button does."""

import http.cookiejar
import json
import os
import select
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


def fetch(url: str, data: dict | None = None, opener=None) -> tuple[int, str]:
    """``(status, body)`` of a GET (a form POST with ``data``)."""
    request = urllib.request.Request(url, data=urllib.parse.urlencode(data).encode() if data else None)
    try:
        with (opener or urllib.request.build_opener()).open(request, timeout=30) as response:
            return response.status, response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode("utf-8", errors="replace")


def status(url: str, data: dict | None = None, opener=None) -> int:
    return fetch(url, data, opener)[0]


def call(base: str, name: str, *values) -> list:
    """What the handler ``name`` returns when called through Gradio's API as any script can."""
    request = urllib.request.Request(f"{base}/gradio_api/call/{name}", data=json.dumps({"data": list(values)}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        event = json.loads(response.read())["event_id"]
    with urllib.request.urlopen(f"{base}/gradio_api/call/{name}/{event}", timeout=60) as response:
        lines = response.read().decode().splitlines()
    assert "event: complete" in lines, lines
    return json.loads(lines[lines.index("event: complete") + 1].removeprefix("data: "))


def serve(tmp_path, *flags, token: str | None = None):
    port = free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
    env.pop("SD_STUDIO_TOKEN", None)
    if token:
        env["SD_STUDIO_TOKEN"] = token
    server = subprocess.Popen([sys.executable, str(ROOT / "SD_Studio.py"), "--port", str(port), *flags], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = time.monotonic()
    lines = []  # (seconds after the start, line) until it says it serves
    while not (lines and lines[-1][1].startswith("SD studio on")) and time.monotonic() - started < 180:
        if select.select([server.stdout], [], [], 1)[0]:
            lines.append((time.monotonic() - started, server.stdout.readline()))
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except OSError:  # said it serves, or said nothing, and does not: stopped, not left behind
        server.kill()
        raise
    (said_at_once, first), (_, serving) = lines[0], lines[-1]
    return server, port, (first, said_at_once, serving)


def test_listen_needs_a_token(capsys, monkeypatch):
    monkeypatch.delenv("SD_STUDIO_TOKEN", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        studio.parse_args(["--listen"])
    assert exit_info.value.code == 2 and "SD_STUDIO_TOKEN" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        studio.parse_args(["--root", "/no/such/folder"])


def test_the_login_compares_any_letters():
    """A token with letters outside ASCII (compared as UTF-8 bytes: hmac.compare_digest refuses such str)."""
    check = studio.password_check("s3cret-tök€n")
    assert check("studio", "s3cret-tök€n") is True
    wrong = (("studio", "s3cret-tok€n"), ("stüdio", "s3cret-tök€n"), ("studio", ""), ("studio", "s3cret-tök€n "))
    assert not any(check(user, password) for user, password in wrong)


@pytest.mark.slow
def test_loopback_by_default_and_the_network_behind_the_token(tmp_path):
    (tmp_path / "work" / "my_images").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    server, port, (first, said_at_once, serving) = serve(tmp_path / "work")
    try:
        assert first == "starting the studio ...\n" and said_at_once < 10  # before Gradio's import
        assert serving.startswith(f"SD studio on http://127.0.0.1:{port}")
        assert status(f"http://127.0.0.1:{port}/config") == 200
        address = outside_address()
        if address is not None:  # the machine's own network address is not served
            with pytest.raises(OSError):
                socket.create_connection((address, port), timeout=3).close()
        # the caption handler through the API: an image name that leaves the folder writes nothing
        from PIL import Image

        Image.new("RGB", (64, 64)).save(tmp_path / "elsewhere" / "victim.png")
        Image.new("RGB", (64, 64)).save(tmp_path / "work" / "my_images" / "cat.png")
        base = f"http://127.0.0.1:{port}"
        for folder, name in (("my_images", "../../elsewhere/victim.png"), (".", "../elsewhere/victim.png"),
                             ("my_images", str(tmp_path / "elsewhere" / "victim.png"))):
            said, = call(base, "save_caption", folder, name, "pwned")
            assert said.startswith("**not saved:**"), said
        assert not (tmp_path / "elsewhere" / "victim.txt").exists()
        assert call(base, "save_caption", "my_images", "cat.png", "a cat") == ["saved cat.txt"]
        verdict, command = call(base, "do_launch", "configs/quickstart/from_scratch.yaml", "", "r1",
                                "out_dir: /elsewhere/run", 1, False, 0)
        assert "out_dir is the run name's" in verdict and command == ""
    finally:
        server.terminate()
        server.wait(60)


@pytest.mark.slow
def test_before_the_login_nothing_of_the_api_and_any_letter_in_the_token(tmp_path):
    """The login page, /config, the API's description: none says an endpoint, a field or where the repository is
    to a client that has not logged in; a token with letters outside ASCII logs in (compared as UTF-8 bytes)."""
    token = "s3cret-tök€n-ß"
    server, port, (_, _, serving) = serve(tmp_path, "--listen", token=token)
    base = f"http://127.0.0.1:{port}"
    secrets = ("save_caption", "do_launch", "prepare_data", "named_endpoints", str(ROOT), "from_scratch.yaml")
    try:
        assert serving.startswith(f"SD studio on http://0.0.0.0:{port}")
        for path in ("/", "/?all_endpoints=true", "/?view=api", "/config", "/gradio_api/info",
                     "/gradio_api/info?all_endpoints=true", "/info", "/gradio_api/openapi.json", "/gradio_api/runs",
                     "/gradio_api/runs?all_endpoints=true", "/gradio_api/startup-events", "/gradio_api/app_id",
                     "/manifest.json", "/gradio_api/api/save_caption"):
            code, body = fetch(base + path)
            assert not [word for word in secrets if word in body], (path, code, body[:300])
        assert status(base + "/config") == 401 and status(base + "/gradio_api/info") == 401
        for user, password in (("studio", "wrong"), ("studio", token[:-1]), ("stüdio", token), ("Studio", token)):
            assert status(f"{base}/login", {"username": user, "password": password}) == 400
        session = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        assert status(f"{base}/login", {"username": "studio", "password": token}, session) == 200
        code, info = fetch(f"{base}/gradio_api/info", opener=session)  # after the login: the API, for its pages
        assert code == 200 and "save_caption" in info
        code, page = fetch(f"{base}/", opener=session)
        assert code == 200 and "window.gradio_api_info = null;" in page
        # the HTTP API: every route wants the token, the login's cookie is not enough, a wrong token is refused
        for path in ("/api/jobs", "/api/queue", "/api/runs", "/api/openapi.json", "/api/folders",
                     "/api/runs/mine/samples/step_1.png", "/api/jobs/1"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer " + token[:-1]}):
                request = urllib.request.Request(base + path, headers={  # the token's UTF-8 bytes, as curl sends them
                    key: value.encode().decode("latin-1") for key, value in headers.items()})
                with pytest.raises(urllib.error.HTTPError) as refused:
                    session.open(request, timeout=30)
                assert refused.value.code == 401 and "token" in json.loads(refused.value.read())["error"], path
        request = urllib.request.Request(f"{base}/api/jobs", headers={"Authorization": f"Bearer {token}".encode()
                                                                      .decode("latin-1")})
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert json.loads(answer.read()) == {"jobs": [], "next": None}
    finally:
        server.terminate()
        server.wait(60)
