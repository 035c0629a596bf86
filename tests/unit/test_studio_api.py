"""sd.studio.api: jobs submitted over HTTP go through the pages' own checks; bad input (an unknown field, a path
outside the root, a kind that is not ours) is answered with a JSON error and nothing runs; the token guards every
route, downloads included; without a token only loopback hosts and JSON POSTs of no other origin are answered."""

import base64
import json

from pathlib import Path

import pytest

from sd.studio.handlers import Studio
from sd.studio.runs import Roots

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

import sd.studio.api  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LOCAL = {"Host": "127.0.0.1:7860"}


@pytest.fixture
def studio(tmp_path):
    work = tmp_path / "work"
    (work / "runs" / "mine" / "samples").mkdir(parents=True)
    (work / "my_images" / "cats").mkdir(parents=True)
    (work / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "secret.png").write_bytes(b"\x89PNG secret")
    (work / "runs" / "mine" / "samples" / "step_10.png").write_bytes(b"\x89PNG grid")
    (work / "runs" / "mine" / "samples" / "leak.png").symlink_to(tmp_path / "elsewhere" / "secret.png")
    rows = [{"step": s, "loss": 1.0 / s, "lr": 1e-4 * min(1, s / 5)} for s in range(1, 11)]
    rows[4]["eval_fid"] = 40.0
    rows[9]["eval_fid"] = 30.0
    (work / "runs" / "mine" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    opened = Studio(Roots([work]), ROOT)
    opened.queue.start = lambda job: opened.queue.update(job.id, state="running", started=0.0, pid=None,
                                                                host="another-host")
    yield opened  # jobs are recorded, never run
    opened.queue.close()


def client(studio, token=None):
    return TestClient(sd.studio.api.create(studio, token=token), base_url="http://127.0.0.1:7860")


TRAIN = {"kind": "train", "recipe": "configs/quickstart/from_scratch.yaml", "run": "r1", "fields": {"max_steps": 4}}


def test_a_job_submitted_runs_the_command_the_train_page_builds(studio):
    api = client(studio)
    answer = api.post("/jobs", json=TRAIN)
    assert answer.status_code == 201, answer.text
    job = answer.json()
    assert job["name"] == "train_r1" and job["state"] == "running" and job["waits"] is True
    name, commands, _ = studio.train_job("configs/quickstart/from_scratch.yaml", "", "r1", "max_steps: 4", 1)
    assert studio.queue.get(job["id"]).commands == [[str(w) for w in commands[0]]]
    second = api.post("/jobs", json={**TRAIN, "run": "r2"}).json()
    assert second["state"] == "queued" and second["described"] == "queued: 0 jobs ahead"
    assert api.post("/jobs", json=TRAIN).status_code == 409  # the same run twice
    listed = api.get("/jobs", params={"limit": 1}).json()
    assert [j["id"] for j in listed["jobs"]] == [second["id"]] and listed["next"] == second["id"]
    assert [j["id"] for j in api.get("/jobs", params={"before": listed["next"]}).json()["jobs"]] == [job["id"]]
    shown = api.get(f"/jobs/{job['id']}", params={"lines": 5}).json()
    assert shown["log"][0].startswith("$ python") and "SD_Train.py" in shown["command"]
    assert api.post(f"/jobs/{second['id']}/move", json={"where": "top"}).status_code == 200
    assert api.post(f"/jobs/{second['id']}/stop", json={}).json()["state"] == "cancelled"
    assert api.post(f"/jobs/{second['id']}/retry", json={}).json()["state"] == "queued"
    sets = api.get("/queue").json()["sets"]
    assert len(sets) == 1 and [j["name"] for j in sets[0]["queued"]] == ["train_r2"]


@pytest.mark.parametrize("body, status, said", [
    ({**TRAIN, "bogus": 1}, 422, "bogus: not a field of this kind of job"),
    ({"kind": "shell", "command": "rm -rf ~"}, 422, "kind: one of train"),
    ({"kind": "sample", "model": "../elsewhere", "prompt": "x"}, 400, "outside the folders"),
    ({"kind": "data", "folder": "/etc"}, 400, "outside the folders"),
    ({**TRAIN, "run": "../../x"}, 400, "run name"),
    ({**TRAIN, "recipe": "/etc/passwd"}, 400, "outside"),
    ({**TRAIN, "fields": {"out_dir": "/tmp/x"}}, 400, "out_dir"),
    ({**TRAIN, "fields": {"lr": -1}}, 400, "lr"),
    ({**TRAIN, "webhook": "file:///etc/passwd"}, 400, "http:// or https://"),
    ({**TRAIN, "gpu_set": 2}, 400, "GPU set 2"),
    ({"kind": "sample", "model": "runs/mine", "prompt": "x", "sampler": "; rm"}, 400, "sampler"),
    ({"kind": "export", "model": "runs/mine", "format": "zip"}, 400, "format"),
    ({"kind": "tool", "tool": "extract", "first": "/etc/passwd", "second": "runs/mine"}, 400, "outside"),
])
def test_bad_input_is_a_json_error_and_nothing_runs(studio, body, status, said):
    answer = client(studio).post("/jobs", json=body)
    assert answer.status_code == status and said in answer.json()["error"], answer.text
    assert studio.queue.list() == []


def test_the_token_guards_every_route_downloads_included(studio):
    api = sd.studio.api.create(studio, token="tøken")
    paths = {route.path for route in api.routes if getattr(route, "methods", None)}
    assert {"/jobs", "/jobs/{job_id}", "/runs/{name}/samples/{file:path}", "/folders", "/openapi.json"} <= paths
    concrete = {"/jobs/{job_id}": "/jobs/1", "/jobs/{job_id}/stop": "/jobs/1/stop", "/jobs/{job_id}/retry":
                "/jobs/1/retry", "/jobs/{job_id}/move": "/jobs/1/move", "/runs/{name}/metrics": "/runs/mine/metrics",
                "/runs/{name}/samples": "/runs/mine/samples", "/runs/{name}/samples/{file:path}":
                "/runs/mine/samples/step_10.png"}
    wrong = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer tøke".encode()},
             {"Authorization": "Basic " + base64.b64encode("studio:wrong".encode()).decode()}]
    with TestClient(api, base_url="http://127.0.0.1:7860") as http:
        for route in api.routes:
            for method in getattr(route, "methods", set()) - {"HEAD"}:
                path = concrete.get(route.path, route.path)
                for headers in wrong:
                    answer = http.request(method, path, headers=headers, json=TRAIN if method == "POST" else None)
                    assert answer.status_code == 401 and "token" in answer.json()["error"], (method, path, headers)
        assert studio.queue.list() == []
        good = {"Authorization": "Bearer tøken".encode()}
        assert http.get("/runs/mine/samples/step_10.png", headers=good).content == b"\x89PNG grid"
        basic = {"Authorization": "Basic " + base64.b64encode("studio:tøken".encode()).decode()}
        assert http.get("/jobs", headers=basic).status_code == 200
        assert http.get("/jobs", headers={**good, "Host": "anything.example"}).status_code == 200


def test_without_a_token_only_loopback_json_requests_of_no_other_origin(studio):
    api = client(studio)
    assert api.get("/jobs", headers={"Host": "evil.example:7860"}).status_code == 403
    assert api.post("/jobs", content=json.dumps(TRAIN), headers={"Content-Type": "text/plain"}).status_code == 415
    assert api.post("/jobs", json=TRAIN, headers={"Origin": "http://evil.example"}).status_code == 403
    huge = api.post("/jobs", content=b"{" + b" " * (2 << 20) + b"}", headers={"Content-Type": "application/json"})
    assert huge.status_code == 413 and "at most 1048576" in huge.json()["error"]
    assert studio.queue.list() == []
    assert api.post("/jobs", json=TRAIN, headers={"Origin": "http://localhost:7860"}).status_code == 201


def test_a_runs_metrics_samples_and_a_folder_picked(studio):
    api = client(studio)
    metrics = api.get("/runs/mine/metrics").json()
    assert len(metrics["points"]) == 10 and metrics["evaluations"] == [{"step": 5, "eval_fid": 40.0},
                                                                         {"step": 10, "eval_fid": 30.0}]
    listed = api.get("/runs/mine/samples").json()["samples"]
    assert {s["file"] for s in listed} >= {"step_10.png"}
    assert api.get("/runs/mine/samples/leak.png").status_code in (400, 404)  # a link out of the roots
    assert api.get("/runs/mine/samples/../../../../elsewhere/secret.png").status_code in (400, 404)
    assert api.get("/runs/nope/metrics").status_code == 404
    assert api.get("/runs/..%2F..%2Felsewhere/metrics").status_code in (400, 404)
    folders = api.get("/folders", params={"path": "my_images"}).json()
    assert folders["subfolders"] == ["cats"] and folders["parent"] == str(studio.workdir)
    assert api.get("/folders", params={"path": ".."}).status_code == 400
    assert api.get("/folders", params={"path": "my_images", "scan": True}).json()["images"] == 0


def test_the_openapi_file_in_the_docs_is_the_apis_own(studio):
    """docs/studio_api.json is what /api/openapi.json serves (python -m sd.studio.api docs/studio_api.json)."""
    served = client(studio).get("/openapi.json").json()
    assert served["servers"] == [{"url": "/api"}]
    kept = json.loads((ROOT / "docs" / "studio_api.json").read_text())
    assert kept == served, "docs/studio_api.json is out of date: python -m sd.studio.api docs/studio_api.json"


def test_the_api_and_the_page_plots_read_the_same_records(studio):
    rates, evaluations = studio.plots("mine")
    assert list(rates["lr"])[:2] == [pytest.approx(2e-5), pytest.approx(4e-5)]
    assert evaluations.to_dict("records") == [{"step": 5, "evaluation": "fid", "value": 40.0},
                                             {"step": 10, "evaluation": "fid", "value": 30.0}]

