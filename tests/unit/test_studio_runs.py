"""sd.studio.runs: paths confined to the studio's folders, a model as a preset, a hub id or a path inside them, run
and dataset names of one folder, and run states from the lock's holder."""

import json
import os

import pytest

import sd.files
from sd.studio import runs


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
