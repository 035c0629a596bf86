"""Atomic writes (a reader, or a crash, never sees a half-written file or folder), bounded reads of
untrusted files and archive members, safetensors files read with an error naming a damaged one, and
one-writer folder locks.

Every output of the project goes through these: the data is written under a temporary name in the
same folder, flushed, and renamed onto the final name (``os.replace`` is atomic on one file system).
Inputs from outside (a zip member, a gzip file, an image on disk) are read with a size cap, so a
small archive that inflates to gigabytes is refused instead of filling the memory.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

try:
    import fcntl
except ImportError:  # Windows: FolderLock falls back to its pid check
    fcntl = None

log = logging.getLogger("sd_files")


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


SAFETENSORS_DTYPES = {"torch.float16": "F16", "torch.bfloat16": "BF16", "torch.float32": "F32", "torch.float64": "F64",
                      "torch.int64": "I64", "torch.int32": "I32", "torch.uint8": "U8", "torch.bool": "BOOL"}


def write_safetensors_streamed(path: str | Path, layout: dict, tensors, metadata: dict | None = None) -> None:
    """A ``.safetensors`` file written one tensor at a time, atomically: ``layout`` is ``{name: (dtype, shape)}``
    in file order, ``tensors`` yields ``(name, tensor)`` in that order, each of its layout (a tensor made only
    when written: memory holds one). The format: an 8-byte little-endian header size, the JSON header (8-byte
    aligned), the tensors' bytes."""
    import torch

    offsets, header, start = {}, {}, 0
    for name, (dtype, shape) in layout.items():
        size = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(dtype)], "shape": list(shape),
                        "data_offsets": [start, start + size]}
        offsets[name], start = (dtype, tuple(shape), size), start + size
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)

    def write(tmp):
        with open(tmp, "wb") as handle:
            handle.write(len(text).to_bytes(8, "little") + text)
            count = -1
            for count, (name, tensor) in enumerate(tensors):
                dtype, shape, size = offsets[name] if name in offsets else (None, None, None)
                if dtype is None or tensor.dtype != dtype or tuple(tensor.shape) != shape:
                    raise ValueError(f"{path}: tensor {name} {tensor.dtype} {tuple(tensor.shape)} is not the "
                                     f"{dtype} {shape} its layout says")
                data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                handle.write(data)
            if count + 1 != len(layout):
                raise ValueError(f"{path}: {count + 1} tensors written of the {len(layout)} its layout names")

    write_atomic(path, write)


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


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file; a missing or damaged file is an error naming it.

    (safetensors has no checksum: a flipped bit inside the tensor data loads as a different number.)
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} is missing")
    try:
        return load_file(str(path))
    except SafetensorError as error:
        raise ValueError(f"{path}: not a readable safetensors file, damaged or truncated ({error})") from error


# ---------------------------------------------------------------------------------------------
# One writer per folder
# ---------------------------------------------------------------------------------------------


class FolderLocked(RuntimeError):
    """Another live process holds the folder's lock."""


# flock's errors on a file system that has no locks (NFS mounted with nolock, some FUSE file systems)
NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


class FolderLock:
    """``FOLDER/.lock`` (or ``FOLDER/name``), held with ``fcntl.flock`` while this process lives.

    The kernel lets go of the lock when its process ends, however it ends (SIGKILL, the OOM killer, a
    pod taken away), so a killed writer never blocks the next one, whatever pid or host the next one
    has; this holds on local disks and NFSv4. The file also names the holder's host and pid, for the
    message of a second process, which raises ``FolderLocked``. The file is removed on release while
    still locked, and a process that locked a file no longer under that name tries again, so two
    processes never both hold the lock.

    Where the file system has no locks (flock fails with ENOLCK and the like; it is said in the log),
    the file is created exclusively instead, and a lock found there is taken over when it names no
    process, this process's pid, or a process of this host that is gone; one from another host cannot
    be checked from here and is left for the user.
    """

    NAME = ".lock"

    def __init__(self, folder: str | Path, name: str = NAME):
        self.path = Path(folder) / name
        self.held = False
        self.fd: int | None = None  # the locked file, open for as long as the lock is held
        self.owner: int | None = None  # the pid that took it: a forked child does not release it
        self.created_folder = False  # removed again on release if nothing else was written

    def acquire(self) -> FolderLock:
        if not self.path.parent.exists():
            self.path.parent.mkdir(parents=True)
            self.created_folder = True
        while True:
            fd = self._open(os.O_RDWR | os.O_CREAT)
            try:
                locked = self._flock(fd)
                current = locked and self._names(fd)
            except BaseException:
                os.close(fd)
                raise
            if current:
                break
            os.close(fd)
            if not locked:
                return self._acquire_without_locks()
            # else its holder removed the file after this process opened it: lock the one now there
        self.fd, self.held, self.owner = fd, True, os.getpid()
        self._write_holder(fd)
        return self

    def _open(self, flags: int) -> int:
        """The lock file opened with ``flags``; one this user may not open (another user's run in the same
        folder, or a folder this user cannot write) is ``FolderLocked`` naming its owner."""
        try:
            return os.open(self.path, flags, 0o644)
        except PermissionError as error:
            try:
                import pwd

                uid = self.path.stat().st_uid if self.path.exists() else self.path.parent.stat().st_uid
                owner = pwd.getpwuid(uid).pw_name
            except (ImportError, KeyError, OSError):
                owner = "another user"
            raise FolderLocked(f"{self.path} cannot be opened ({error.strerror}): {self.path.parent} belongs to "
                               f"{owner}; use a folder of your own (out_dir / --out), or ask its owner") from None

    def _flock(self, fd: int) -> bool:
        """Lock ``fd``'s file: True once held, False on a file system without locks; ``FolderLocked``
        when another process holds it."""
        if fcntl is None:  # no such locks on this platform
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise self._refusal(self._holder(), "wait for it to finish or stop it (the lock goes with the "
                                "process)") from None
        except OSError as error:
            if error.errno not in NO_LOCKS:
                raise
            log.warning("%s: this file system has no file locks (%s); the lock is a file naming host and pid, "
                        "taken over only when its process is gone from this host", self.path, os.strerror(error.errno))
            return False
        return True

    def _names(self, fd: int) -> bool:
        """Whether the lock file's name still leads to the file open as ``fd``."""
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

    def _write_holder(self, fd: int) -> None:
        """Host and pid into the held file, for the message of a process that finds it locked."""
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(self._mine()) + "\n").encode(), 0)
        except OSError as error:  # the kernel's lock holds all the same; a refused process says "?"
            log.warning("%s: could not write host and pid into the lock file (%s)", self.path, error)

    def _acquire_without_locks(self) -> FolderLock:
        mine = self._mine()
        for _ in range(2):
            try:
                fd = self._open(os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                holder = self._holder()
                if not self._stale(holder, mine):
                    raise self._refusal(holder, "wait for it to finish, or remove the lock file if that process "
                                        "is gone") from None
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as handle:
                handle.write(json.dumps(mine) + "\n")
            self.held, self.owner = True, os.getpid()
            return self
        raise FolderLocked(f"could not take the lock {self.path}")

    @staticmethod
    def _stale(holder: dict, mine: dict) -> bool:
        """A lock naming no process (cut short by a full disk), or a process of this host that is gone;
        this process's own pid is a previous container's, as this process has not written it."""
        pid = holder.get("pid")
        if not isinstance(pid, int):
            return True
        if holder.get("host") != mine["host"]:
            return False
        return pid == mine["pid"] or not _process_alive(pid)

    @staticmethod
    def _mine() -> dict:
        import socket

        return {"host": socket.gethostname(), "pid": os.getpid()}

    def _refusal(self, holder: dict, advice: str) -> FolderLocked:
        return FolderLocked(f"{self.path.parent} is in use by process {holder.get('pid', '?')} on host "
                            f"{holder.get('host', '?')} (lock file {self.path}); {advice}")

    def _holder(self) -> dict:
        try:
            value = json.loads(self.path.read_text() or "{}")
            return value if isinstance(value, dict) else {}
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        if not self.held or self.owner != os.getpid():
            return
        self.held = False
        self.path.unlink(missing_ok=True)  # while still locked: see the class's docstring
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.created_folder and not any(self.path.parent.iterdir()):
            self.path.parent.rmdir()
