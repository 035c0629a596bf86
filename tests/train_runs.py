"""Several SD_Train.py runs one after another in the ranks of one torchrun launch (tests):

    torchrun --standalone --nproc_per_node=2 -m tests.train_runs '[["--config", "a.yaml"], ["--config", "b.yaml"]]'

Each run is SD_Train.py's own: its command line read by ``load_config``, the run trained by
``SD_Train.train`` in the process group set up once for all of them. A tiny run spends most of a launch
starting up (imports, the process group); here the runs share one start-up. The first run that does
not end with exit status 0 ends the launch with its status.
"""

from __future__ import annotations

import json
import logging
import sys

import SD_Train
import sd.distributed
import sd.runtime
from sd.train.config_loading import load_config


def main(argv: list[str]) -> int:
    sd.runtime.start_process()
    runs = json.loads(argv[0])
    device = load_config(runs[0]).device
    d = sd.distributed.setup(device)
    logging.basicConfig(level=logging.INFO if d.is_main else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        for run in runs:
            config = load_config(run)
            if config.device != device:  # the process group is the first run's
                raise ValueError(f"{run}: device {config.device!r}, the first run's is {device!r}")
            code = SD_Train.train(config, d)
            if code != 0:
                return code
        return 0
    finally:
        sd.distributed.teardown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
