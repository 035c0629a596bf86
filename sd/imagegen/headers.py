"""The ``modelspec`` header of a file an export writes (``sd.metadata``), with what a run of ours records of its
training when the source is one."""

from __future__ import annotations

import time
from pathlib import Path

import sd.formats
import sd.metadata
import sd.run_folder
from sd.sampling import Pipeline


def training_record(source: str | None) -> sd.metadata.TrainingRecord | None:
    """What a run of ours (a run or checkpoint folder) records of its training; None for any other source."""
    try:
        if not source or sd.formats.run_config(source) is None:
            return None
        return sd.metadata.TrainingRecord.read(sd.run_folder.resolve_checkpoint(source))
    except (OSError, ValueError):
        return None


def file_header(kind: str, out: str | Path, model: Pipeline, source: str | None,
                record: sd.metadata.TrainingRecord | None = None) -> dict[str, str]:
    """The ``modelspec`` header of an exported file of ``kind``, titled by the name ``out`` gives it. When
    ``source`` is a run of ours (``record``, when read already): the resolution and date of its training;
    else, and where the run does not record them, the model's own size (``sd.metadata.model_resolution``)
    and ``source``'s time."""
    record = record or training_record(source)
    resolution = sd.metadata.training_resolution(record.config) if record else None
    date = record.saved_at if record else None
    header = sd.metadata.modelspec(kind, Path(out).name.removesuffix(".safetensors"), model.prediction_type,
                                   resolution or sd.metadata.model_resolution(model.unet),
                                   source_time(source) if date is None else date)
    if record and kind == "checkpoint":  # tuned on pairs or distilled: it says so (a LoRA's ss_* keys do)
        header.update(sd.metadata.preference_keys(record.preference, record.config.get("init_from")))
        header.update(sd.metadata.distillation_keys(record.distillation, record.config.get("init_from")))
    return header


def source_time(source: str | None) -> float:
    """When ``source``'s weights were written: its file's or folder's time when it is here, else now (a hub
    model, whose export makes this file)."""
    try:
        return Path(source).stat().st_mtime if source else time.time()
    except OSError:
        return time.time()
