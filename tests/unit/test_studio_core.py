"""sd.studio's jobs, incremental readers, run states and confined paths (the parts under the web pages)."""

import json
import os

import sys
import time
import tracemalloc

import pytest

import sd.files
from sd.studio import jobs, runs


def test_a_job_runs_its_argument_list_and_logs_it(tmp_path):
    registry = jobs.Jobs(tmp_path / "logs", cwd=tmp_path)
    command = [sys.executable, "-c", "import sys; print('hello', sys.argv[1:])", "a b", "$HOME;", "'"]
    job = registry.start("hello", command)
    assert job.wait(60) == 0 and job.state == "finished"
    log = (tmp_path / "logs" / "hello.log").read_text()
    assert log.splitlines()[0] == """$ python -c 'import sys; print('"'"'hello'"'"', sys.argv[1:])' 'a b' '$HOME;' ''"'"''"""
    assert "hello ['a b', '$HOME;', \"'\"]" in log  # no shell: every word arrives as written


def test_stop_sends_the_signal_that_saves_and_a_running_name_is_refused(tmp_path):
    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: (print('saved', flush=True), sys.exit(143)))\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    registry = jobs.Jobs(tmp_path / "logs", cwd=tmp_path)
    job = registry.start("train", [sys.executable, "-c", script])
    tail = jobs.LogTail(job.log)
    for _ in range(600):
        if "ready" in tail.read().splitlines()[1:]:  # (the first line is the command, which says ready too)
            break
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="still running"):
        registry.start("train", [sys.executable, "-c", "pass"])
    job.stop()
    assert job.wait(60) == 143 and job.state == "stopped (exit 143)"
    assert tail.read().splitlines()[-1] == "saved"
    assert registry.start("train", [sys.executable, "-c", "pass"]).wait(60) == 0  # stopped: the name is free again


def test_log_tail_reads_only_what_is_new_and_keeps_the_last_lines(tmp_path):
    path = tmp_path / "log"
    path.write_text("a\nb\nprogress 1%\rprogress 2%")
    tail = jobs.LogTail(path, lines=3)
    assert tail.read() == "a\nb\nprogress 2%"
    with open(path, "a") as handle:
        handle.write("\rprogress 100%\nc\nd\n")
    assert tail.read() == "progress 100%\nc\nd" and tail.offset == path.stat().st_size
    assert jobs.LogTail(tmp_path / "missing").read() == ""


def test_metrics_tail_stays_bounded_and_evenly_spaced(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = jobs.JsonlTail(path, points=100)
    with open(path, "w") as handle:
        for step in range(1, 1001):
            handle.write(json.dumps({"step": step, "loss": 1 / step}) + "\n")
        handle.write('{"step": 1001, "lo')  # a line being written
    rows = tail.read()
    steps = [row["step"] for row in rows]
    assert len(rows) <= 100 and steps[0] == 1 and len(set(b - a for a, b in zip(steps, steps[1:]))) == 1
    assert tail.last == {"step": 1000, "loss": 0.001}
    with open(path, "a") as handle:
        handle.write('ss": 0.5}\nnot json\n{"step": 1001, "eval_fid": 31.5}\n')
        for step in range(1002, 1400):
            handle.write(json.dumps({"step": step, "loss": 0.1}) + "\n")
    tail.read()
    assert tail.last == {"step": 1399, "loss": 0.1}
    assert tail.evaluations == {"eval_fid": (1001, 31.5)}  # kept whatever the thinning drops


@pytest.mark.slow
def test_metrics_tail_memory_is_flat_over_a_long_run(tmp_path):
    """A run of 150,000 logged steps (23 MB of metrics) read by the studio: a few MB held at most."""
    path = tmp_path / "metrics.jsonl"
    line = json.dumps({"step": 0, "loss": 0.1234567, "lr": 1e-4, "grad_norm": 0.5, "images_per_s": 12.5,
                       "note": "x" * 60})
    with open(path, "w") as handle:
        for step in range(150_000):
            handle.write(line.replace('"step": 0', f'"step": {step}') + "\n")
    tracemalloc.start()
    try:
        tail = jobs.JsonlTail(path, points=2000, chunk=1 << 18)
        rows = tail.read()
        peak_mb = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    assert path.stat().st_size > 20 * 2**20
    assert len(rows) <= 2000 and tail.last["step"] == 149_999
    assert peak_mb < 8, peak_mb  # a chunk, its lines and 2,000 rows: not the file


def test_roots_confine_paths(tmp_path):
    (tmp_path / "data" / "photos").mkdir(parents=True)
    roots = runs.Roots([tmp_path / "data"])
    assert roots.check("photos") == (tmp_path / "data" / "photos").resolve()
    assert roots.check(tmp_path / "data") == (tmp_path / "data").resolve()
    for outside in ("../secret", "/etc/passwd", tmp_path / "data" / ".." / "other"):
        with pytest.raises(runs.OutsideRoots, match="outside the folders"):
            roots.check(outside)
    (tmp_path / "data" / "link").symlink_to("/etc")
    with pytest.raises(runs.OutsideRoots):
        roots.check("link/passwd")


def test_a_model_is_a_preset_a_hub_id_or_a_path_inside_the_roots(tmp_path):
    roots = runs.Roots([tmp_path])
    assert roots.source("tiny") == "tiny" and roots.source("stabilityai/sd-vae-ft-mse") == "stabilityai/sd-vae-ft-mse"
    (tmp_path / "runs" / "my_vae").mkdir(parents=True)
    assert roots.source("runs/my_vae") == str((tmp_path / "runs" / "my_vae").resolve())  # here: a path
    assert roots.source("runs/other") == str((tmp_path / "runs" / "other").resolve())  # runs/ is here: not a hub id
    for outside in ("/etc/vae", "../vae", "~/vae", "a/../../vae", "./../x", str(tmp_path.parent)):
        with pytest.raises(runs.OutsideRoots):
            roots.source(outside)


def test_a_run_or_dataset_name_is_one_folder_name():
    for name in ("mine", "my_run-2", "r.1", "phase_7"):
        assert runs.folder_name(name) == name
    for name in ("team/r1", "..", ".hidden", "", "a b", "r1/", "x\n", "../x", "/abs", None):
        with pytest.raises(ValueError, match="one folder name"):
            runs.folder_name(name)


def test_run_states_and_the_lock_holder(tmp_path):
    run = tmp_path / "runs" / "mine"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "config.yaml").write_text("max_steps: 8\n")
    (run / "metrics.jsonl").write_text('{"step": 4, "loss": 0.5}\n')
    assert runs.run_info(run).state == "stopped before its first checkpoint"
    (run / "checkpoints" / "step_00000004" / "COMPLETE").write_text("")
    info = runs.run_info(run)
    assert (info.state, info.step, info.max_steps, info.loss) == ("stopped: the same command resumes it", 4, 8, 0.5)
    lock = sd.files.FolderLock(run).acquire()
    try:
        holder = runs.lock_holder(run)
        assert holder["pid"] == os.getpid()
        assert runs.run_info(run).state.startswith(f"training (pid {os.getpid()} on ")
    finally:
        lock.release()
    assert runs.lock_holder(run) is None
    (run / ".lock").write_text(json.dumps({"host": os.uname().nodename, "pid": 2**22 + 12345}))  # gone
    assert runs.lock_holder(run) is None
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 8, "loss": 0.25}\n')
    assert runs.run_info(run).state == "finished"
    assert [r.name for r in runs.list_runs(tmp_path / "runs")] == ["mine"] and runs.list_runs(tmp_path / "no") == []


def test_folder_scan_reads_headers_names_skips_and_pages(tmp_path):
    from PIL import Image

    from sd.studio import data

    folder = tmp_path / "photos"
    (folder / "sub").mkdir(parents=True)
    for i in range(60):
        Image.new("RGB", (96, 64) if i % 2 else (64, 64)).save(folder / ("sub" if i % 3 == 0 else "") / f"p{i:02d}.png")
        if i != 7:
            (folder / ("sub" if i % 3 == 0 else "") / f"p{i:02d}.txt").write_text(f"caption {i}")
    Image.new("RGB", (8, 8)).save(folder / "tiny.png")
    (folder / "tiny.txt").write_text("small")
    Image.new("RGB", (640, 64)).save(folder / "strip.png")
    (folder / "strip.txt").write_text("long")
    (folder / "broken.png").write_bytes(b"\x89PNG nothing")
    (folder / "broken.txt").write_text("a caption: 01e reads it first")
    (folder / "latin.png").write_bytes((folder / "p01.png").read_bytes())
    (folder / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (folder / "p02_mask.png").write_bytes((folder / "p01.png").read_bytes())  # a loss mask, not an image
    scan = data.scan_folder(folder, resolution=64)
    assert sorted(scan.skipped) == [("broken.png", "undecodable"), ("latin.png", "bad_caption_encoding"),
                                    ("p07.png", "no_caption"), ("strip.png", "extreme_aspect"),
                                    ("tiny.png", "too_small")]
    assert len(scan.images) == 59 and scan.captions["sub/p03.png"] == "caption 3"
    assert scan.buckets == {"64x64": 59}  # 64 px recipes have one bucket; at 256 px the 3:2 images get their own
    # (tiny.png counts at --min_size 0; p07 has no caption)
    assert data.scan_folder(folder, resolution=256, min_size=0).buckets == {"256x256": 31, "320x192": 29}
    pages = [data.page_of(scan, n, 24) for n in (1, 2, 3, 9)]
    assert [len(p) for p in pages] == [24, 24, 11, 11]  # page 9 is past the end: the last one
    assert [rel for page in pages[:3] for rel, _ in page] == scan.images
    for name in ("../outside.png", str(tmp_path / "outside.png"), "p07.txt", "p02_mask.png", "missing.png"):
        with pytest.raises(ValueError, match="not an image that 01e_import_folder.py reads"):
            data.write_caption(folder, name, "words")
    assert not (tmp_path / "outside.txt").exists() and not (folder / "p02_mask.txt").exists()
    data.write_caption(folder, "p07.png", "  new words \n")
    assert (folder / "p07.txt").read_text() == "new words\n"
    assert ("p07.png", "no_caption") not in data.scan_folder(folder, resolution=64).skipped


def test_the_gpus_present_follow_cuda_visible_devices(monkeypatch):
    from sd.studio import training

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,3")
    assert training.gpus_present() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert training.gpus_present() == 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: the CPU
    assert training.gpus_present() == 1


def test_field_lines_become_the_trainers_flags_and_the_trainer_judges_them(tmp_path):
    from sd.studio import training

    assert training.parse_fields("lr: 1e-4  # peak\n\nmax_steps: 10\n") == ["--lr", "1e-4", "--max_steps", "10"]
    with pytest.raises(ValueError, match="line 1"):
        training.parse_fields("not a field line")
    preset = str(jobs.REPOSITORY / "configs" / "quickstart" / "from_scratch.yaml")
    assert training.check_training(preset, None, tmp_path / "runs" / "x", ["--lr", "1e-4"], tmp_path) == ""
    refused = training.check_training(preset, None, tmp_path / "runs" / "x", ["--lr", "-1"], tmp_path)
    assert "lr" in refused
    assert "no_such_field" in training.check_training(preset, None, tmp_path / "runs" / "x", ["--no_such_field", "1"], tmp_path)
