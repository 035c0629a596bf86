"""Several SD_Train.py runs one after another in the ranks of one torchrun launch (tests):

    torchrun --standalone --nproc_per_node=2 -m tests.train_runs '[["--config", "a.yaml"], ["--config", "b.yaml"]]'

Each run is SD_Train.py's own: its command line read by ``load_config``, the run trained by
``SD_Train.train`` in the process group set up once for all of them. A tiny run spends most of a launch
starting up (imports, the process group); here the runs share one start-up. The first run that does
not end with exit status 0 ends the launch with its status.

A run may also be ``{"argv": [...], "fault": "NAME:KEY,...", "exit": 2}``: ``fault`` arms those of
``sd.faults``' points that raise (``fail_*``) for this run alone, as ``SD_FAULT`` arms them for a whole
process; ``exit: 2`` expects the run to stop with a config error, as SD_Train.py does (status 2, the error
on stderr naming the rank), and the launch goes on with the next run.
"""

from __future__ import annotations

import json
import logging
import sys

import SD_Train
import sd.distributed
import sd.faults
import sd.runtime
from sd.train.config import ConfigError
from sd.train.config_loading import load_config


def run_one(run: list[str] | dict, d: sd.distributed.Dist, device: str) -> int:
    """One run's exit status: 0, the trainer's own, or 2 for a config error when the run expects one."""
    argv, fault, expected = (run, None, 0) if isinstance(run, list) else (run["argv"], run.get("fault"),
                                                                          run.get("exit", 0))
    config = load_config(argv)
    if config.device != device:  # the process group is the first run's
        raise ValueError(f"{argv}: device {config.device!r}, the first run's is {device!r}")
    if fault and any(not part.strip().startswith("fail_") for part in fault.split(",")):
        raise ValueError(f"{fault}: only fail_* points can be armed for one run (the others end the process)")
    sd.faults.arm(fault)
    try:
        code = SD_Train.train(config, d)
    except ConfigError as error:
        if expected != 2:
            raise
        print(f"SD_Train.py: error (rank {d.rank}): {error}", file=sys.stderr, flush=True)
        code = 2
    finally:
        sd.faults.arm_from_environment()
    return 0 if code == expected else code or 1


def main(argv: list[str]) -> int:
    sd.runtime.start_process()
    runs = json.loads(argv[0])
    first = runs[0] if isinstance(runs[0], list) else runs[0]["argv"]
    device = load_config(first).device
    d = sd.distributed.setup(device)
    logging.basicConfig(level=logging.INFO if d.is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        for run in runs:
            code = run_one(run, d, device)
            if code != 0:
                return code
        return 0
    finally:
        sd.distributed.teardown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
