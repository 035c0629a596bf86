import os
from pathlib import Path

import pytest
import torch

# Tests never reach a model hub; everything is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

ROOT = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "e2e", "gpu")  # tests/<tier>/ folders, each also a marker

# Under pytest-xdist (make test runs -n 2) the workers share the cores: each takes its part of them for
# torch's threads instead of all, which would leave every worker waiting on the others' threads.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config, items):
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        tier = Path(item.fspath).parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def dataset_64(tmp_path_factory):
    """A caption dataset joined to tiny latents: 64 training and 8 validation samples, built once."""
    from data_factory import make_dataset

    return make_dataset(tmp_path_factory.mktemp("dataset_64"), n_train=64, n_val=8)


@pytest.fixture(scope="session")
def dataset_16(tmp_path_factory):
    """The small one: 16 training and 4 validation samples, built once."""
    from data_factory import make_dataset

    return make_dataset(tmp_path_factory.mktemp("dataset_16"), n_train=16, n_val=4)
