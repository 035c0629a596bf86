"""The ``modelspec`` header of a file an export writes (``sd.metadata``), with what a run of ours records of its
training when the source is one."""

from __future__ import annotations

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
    """The ``modelspec`` header of an exported file of ``kind``, titled by the name ``out`` gives it, with the
    resolution and date of ``source``'s training (``record``, when read already) when it is a run of ours."""
    record = record or training_record(source)
    resolution = sd.metadata.training_resolution(record.config) if record else None
    return sd.metadata.modelspec(kind, Path(out).name.removesuffix(".safetensors"), model.prediction_type,
                                 resolution, record.saved_at if record else None)
