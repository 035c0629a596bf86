"""Fault injection for the tests: crash points that are inert unless armed.

The tests start a program with ``SD_FAULT=NAME:KEY`` (several separated by commas);
``sd.runtime.start_process()`` arms them once, and ``point(NAME, KEY)`` then acts when reached:

    after_unet:STEP       SD_Train.py: SIGKILL this process while checkpoint STEP is half written
    sigterm_parent:STEP   SD_Train.py: SIGTERM the launcher (torchrun) after optimizer step STEP
    after_npy:SHARD       encode_latents.py: SIGKILL after shard SHARD's .npy, before its keys file
    fail_validation_loss:RANK, fail_grid:RANK
                          SD_Train.py: raise ``Injected`` once on rank RANK in its share of the validation
                          loss, or of the sample grid (a failure one rank meets while the others wait)

Unarmed, ``point`` is one set lookup, so the hooks cost nothing in the loops that call them.
"""

from __future__ import annotations

import os
import signal

ENV = "SD_FAULT"
_armed: set[str] = set()


def arm(spec: str | None) -> None:
    """Arm the points in ``spec`` (``NAME:KEY[,NAME:KEY...]``); None or empty disarms all."""
    _armed.clear()
    _armed.update(part.strip() for part in (spec or "").split(",") if part.strip())


def arm_from_environment() -> None:
    arm(os.environ.get(ENV))


class Injected(RuntimeError):
    """The error a ``fail_*`` point raises."""


def point(name: str, key) -> None:
    """Act if ``NAME:KEY`` is armed: ``sigterm_parent`` signals the parent, a ``fail_*`` point raises
    ``Injected`` (once: it disarms itself), the rest SIGKILL this process."""
    if not _armed or f"{name}:{key}" not in _armed:
        return
    if name.startswith("fail_"):
        _armed.discard(f"{name}:{key}")
        raise Injected(f"injected fault {name}:{key}")
    if name == "sigterm_parent":
        os.kill(os.getppid(), signal.SIGTERM)
    else:
        os.kill(os.getpid(), signal.SIGKILL)
