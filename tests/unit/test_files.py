"""sd.files.FolderLock: one writer per folder, held by the kernel (flock), so a dead writer never blocks."""

import errno
import fcntl
import json
import logging
import os
import socket

import pytest

import sd.files

HOST = socket.gethostname()


def holder_of(folder) -> dict:
    return json.loads((folder / ".lock").read_text())


@pytest.mark.parametrize("content", [
    json.dumps({"host": HOST, "pid": os.getpid()}),  # a restarted container's trainer got the pid of the old one
    "",  # the disk filled up before host and pid were written
    json.dumps({"host": HOST, "pid": os.getppid()}),  # a live process that holds no lock: a zombie, a reused pid
    json.dumps({"host": "pod-7f9c", "pid": 12}),  # written on a pod whose hostname has since changed
], ids=["own-pid", "empty", "live-pid-not-holding", "other-host"])
def test_a_lock_file_nobody_holds_is_taken_over_whatever_it_names(tmp_path, content):
    (tmp_path / ".lock").write_text(content)
    lock = sd.files.FolderLock(tmp_path).acquire()
    assert lock.held and holder_of(tmp_path) == {"host": HOST, "pid": os.getpid()}
    lock.release()
    assert not (tmp_path / ".lock").exists()


def test_a_held_lock_is_refused_naming_folder_host_pid_and_file(tmp_path):
    fd = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT)  # another open file: flock sees another holder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps({"host": "gpu-7", "pid": 4242}).encode())
        with pytest.raises(sd.files.FolderLocked) as refused:
            sd.files.FolderLock(tmp_path).acquire()
        assert str(refused.value).startswith(f"{tmp_path} is in use by process 4242 on host gpu-7 (lock file "
                                             f"{tmp_path / '.lock'}); wait for it to finish or stop it")
        assert holder_of(tmp_path) == {"host": "gpu-7", "pid": 4242}  # left as it was
    finally:
        os.close(fd)
    sd.files.FolderLock(tmp_path).acquire().release()  # its holder is gone: free


def test_a_second_lock_in_the_same_process_is_refused_and_a_created_folder_is_removed_on_release(tmp_path):
    folder = tmp_path / "new"
    first = sd.files.FolderLock(folder).acquire()
    with pytest.raises(sd.files.FolderLocked, match=f"in use by process {os.getpid()} on host"):
        sd.files.FolderLock(folder).acquire()
    first.release()
    assert not folder.exists()


def test_a_waiter_that_locks_a_file_its_holder_removed_tries_again_on_the_new_one(tmp_path, monkeypatch):
    first, waiter, third = (sd.files.FolderLock(tmp_path) for _ in range(3))
    first.acquire()
    real_flock = fcntl.flock

    def holder_lets_go_then_another_takes_it(fd, operation):
        # Between the waiter's open and its flock, the holder releases and a third process takes the lock.
        monkeypatch.setattr(fcntl, "flock", real_flock)
        first.release()
        third.acquire()
        return real_flock(fd, operation)  # succeeds: the waiter's file is the removed one

    monkeypatch.setattr(fcntl, "flock", holder_lets_go_then_another_takes_it)
    with pytest.raises(sd.files.FolderLocked, match="in use by process"):
        waiter.acquire()
    assert third.held and not waiter.held
    third.release()


def test_without_file_locks_the_pid_check_stands_in_and_the_log_says_so(tmp_path, monkeypatch, caplog):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock_file = tmp_path / ".lock"
    lock_file.write_text(json.dumps({"host": HOST, "pid": os.getppid()}))  # alive, on this host
    with caplog.at_level(logging.WARNING), pytest.raises(sd.files.FolderLocked) as refused:
        sd.files.FolderLock(tmp_path).acquire()
    assert f"in use by process {os.getppid()}" in str(refused.value) and "remove the lock file" in str(refused.value)
    assert f"{lock_file}: this file system has no file locks" in caplog.text
    for content in ("", json.dumps({"host": HOST, "pid": os.getpid()})):  # cut short; a previous container's
        lock_file.write_text(content)
        lock = sd.files.FolderLock(tmp_path).acquire()
        assert holder_of(tmp_path) == {"host": HOST, "pid": os.getpid()}
        lock.release()
        assert not lock_file.exists()


def test_a_lock_file_this_user_may_not_open_is_refused_in_one_line_naming_its_owner(tmp_path, monkeypatch):
    """Another user's run in the same folder: the lock file is theirs (0644), and opening it for writing once
    ended in a PermissionError traceback. (The test runs as whoever runs it, so the refusal is simulated.)"""
    import pwd

    (tmp_path / ".lock").write_text("")
    real_open = os.open

    def refused(path, flags, *args):
        if str(path) == str(tmp_path / ".lock"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refused)
    owner = pwd.getpwuid((tmp_path / ".lock").stat().st_uid).pw_name
    with pytest.raises(sd.files.FolderLocked, match=f"cannot be opened \\(Permission denied\\): {tmp_path} belongs "
                                                    f"to {owner}; use a folder of your own"):
        sd.files.FolderLock(tmp_path).acquire()


def test_a_streamed_safetensors_file_reads_back_and_a_wrong_tensor_leaves_nothing(tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(3, 5).half(), "b": torch.arange(7), "c": torch.randn(2, 2, 2).bfloat16(),
               "scalar": torch.tensor(1.5), "empty": torch.zeros(0, 3)}
    layout = {k: (v.dtype, v.shape) for k, v in tensors.items()}
    sd.files.write_safetensors_streamed(tmp_path / "x.safetensors", layout, iter(tensors.items()), {"k": 1})
    back = load_file(tmp_path / "x.safetensors")
    assert list(back) == list(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"k": "1"}
    wrong = {**tensors, "b": torch.arange(8)}
    with pytest.raises(ValueError, match="tensor b torch.int64 \\(8,\\) is not the torch.int64 \\(7,\\)"):
        sd.files.write_safetensors_streamed(tmp_path / "y.safetensors", layout, iter(wrong.items()))
    with pytest.raises(ValueError, match="4 tensors written of the 5"):
        sd.files.write_safetensors_streamed(tmp_path / "y.safetensors", layout, iter(list(tensors.items())[:4]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]
