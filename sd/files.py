"""Atomic writes (a reader, or a crash, never sees a half-written file or folder), bounded reads of
untrusted files and archive members, and one-writer folder locks.

Every output of the project goes through these: the data is written under a temporary name in the
same folder, flushed, and renamed onto the final name (``os.replace`` is atomic on one file system).
Inputs from outside (a zip member, a gzip file, an image on disk) are read with a size cap, so a
small archive that inflates to gigabytes is refused instead of filling the memory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


def temporary_name(path: Path) -> Path:
    """The hidden sibling a file or folder is written under before it is renamed into place."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


_UMASK: int | None = None


def file_mode() -> int:
    """The mode a new file gets from ``open`` under this process's umask (0644 under the usual 022).

    Some writers (safetensors among them) create their files 0600; outputs are meant to be read by
    other users and tools, so every atomic write ends with this mode.
    """
    global _UMASK
    if _UMASK is None:
        try:  # Linux says it without changing it
            line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("Umask:"))
            _UMASK = int(line.split()[1], 8)
        except (OSError, StopIteration, ValueError):
            _UMASK = os.umask(0o022)
            os.umask(_UMASK)
    return 0o666 & ~_UMASK


def normal_permissions(path: Path) -> None:
    """Give a file, or every file under a folder, the mode of :func:`file_mode`."""
    path = Path(path)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    for item in files:
        os.chmod(item, file_mode())


def write_atomic(path: str | Path, write) -> None:
    """Call ``write(tmp_path)`` then rename onto ``path``: readers never see a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        write(tmp)
        normal_permissions(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    write_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def write_json_atomic(path: str | Path, value, indent: int | None = 1) -> None:
    write_text_atomic(path, json.dumps(value, indent=indent) + "\n")


def save_npy_atomic(path: str | Path, array) -> None:
    import numpy as np

    def write(tmp):
        with open(tmp, "wb") as handle:
            np.save(handle, array)

    write_atomic(path, write)


def save_png_atomic(path: str | Path, image, **options) -> None:
    """A PIL image as PNG (``options`` go to ``Image.save``, e.g. ``pnginfo``)."""
    write_atomic(path, lambda tmp: image.save(tmp, format="PNG", **options))


def write_folder_atomic(folder: str | Path, write) -> None:
    """Call ``write(staging_folder)`` then swap the folder into place, replacing an older one.

    The old folder is moved aside before the new one is renamed in, so at every moment either the
    old or the new complete folder exists under the final name (or, for an instant, neither).
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = temporary_name(folder)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write(staging)
        normal_permissions(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_folder(staging, folder)


def replace_folder(staging: Path, folder: Path) -> None:
    """Rename a complete ``staging`` folder onto ``folder``, removing an older ``folder`` first."""
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(staging, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, folder)


def fsync_tree(folder: Path) -> None:
    """Flush every file directly in ``folder`` to storage (before a rename marks it complete)."""
    for path in Path(folder).iterdir():
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


# ---------------------------------------------------------------------------------------------
# Bounded reads
# ---------------------------------------------------------------------------------------------


class TooLarge(ValueError):
    """A file or archive member bigger than the cap its reader allows."""


def read_zip_member(archive, info, limit: int) -> bytes:
    """The bytes of zip member ``info``, refusing one that declares, or inflates to, more than ``limit``.

    The declared size is checked before reading; the read itself stops at ``limit + 1`` bytes, so a
    header that lies about the size cannot make it inflate further.
    """
    if info.file_size > limit:
        raise TooLarge(f"{info.filename} declares {info.file_size} bytes, over the cap of {limit}")
    with archive.open(info) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(f"{info.filename} inflates past the cap of {limit} bytes")
    return data


def read_file_bounded(path: str | Path, limit: int) -> bytes:
    """A file's bytes, refusing one over ``limit`` (checked before and while reading)."""
    path = Path(path)
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise TooLarge(f"{path} has {size} bytes, over the cap of {limit}")
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(f"{path} grew past the cap of {limit} bytes while read")
    return data


def gunzip_bounded(data: bytes, limit: int, name: str = "gzip data") -> bytes:
    """Decompress gzip ``data``, refusing output over ``limit`` bytes (a gzip bomb stops at the cap)."""
    import zlib

    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as error:
        raise ValueError(f"{name} is not valid gzip data ({error})") from None
    if len(out) > limit:
        raise TooLarge(f"{name} inflates past the cap of {limit} bytes")
    if not inflater.eof:
        raise ValueError(f"{name} is truncated gzip data")
    return out


# ---------------------------------------------------------------------------------------------
# One writer per folder
# ---------------------------------------------------------------------------------------------


class FolderLocked(RuntimeError):
    """Another live process holds the folder's lock."""


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


class FolderLock:
    """``FOLDER/.lock`` holding this process's host and pid, created exclusively (``O_EXCL``).

    A second process that finds a lock of a live process raises ``FolderLocked`` naming the folder,
    host and pid. A lock left by a dead process on this host (a crash, SIGKILL) is taken over; a
    lock from another host cannot be checked from here, so it is reported and left for the user to
    remove once that job is gone.
    """

    NAME = ".lock"

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / self.NAME
        self.held = False
        self.created_folder = False  # removed again on release if nothing else was written

    def acquire(self) -> "FolderLock":
        import socket

        if not self.path.parent.exists():
            self.path.parent.mkdir(parents=True)
            self.created_folder = True
        mine = {"host": socket.gethostname(), "pid": os.getpid()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder.get("host") == mine["host"] and not _process_alive(int(holder.get("pid", -1))):
                    self.path.unlink(missing_ok=True)  # stale: its process is gone
                    continue
                raise FolderLocked(
                    f"{self.path.parent} is in use by process {holder.get('pid', '?')} on host "
                    f"{holder.get('host', '?')} (lock file {self.path}); wait for it to finish, or remove the lock "
                    "file if that process is gone") from None
            with os.fdopen(fd, "w") as handle:
                handle.write(json.dumps(mine) + "\n")
            self.held = True
            return self
        raise FolderLocked(f"could not take the lock {self.path}")

    def _holder(self) -> dict:
        try:
            value = json.loads(self.path.read_text() or "{}")
            return value if isinstance(value, dict) else {}
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False
            if self.created_folder and not any(self.path.parent.iterdir()):
                self.path.parent.rmdir()
