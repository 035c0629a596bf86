import os
import random
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
# torch's threads, and so do the processes it starts (OMP_NUM_THREADS, which SD_Train.py and the demo
# respect). With every process on all the cores, OpenMP threads waiting for their turn made a tiny
# training step 6.7x slower (2.39 s against 0.36 s measured on the 2-core machine).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def schedule_order(items: list) -> list:
    """The order make test's two workers take the test files in (xdist runs with --no-loadscope-reorder):
    the demo chain first, as it takes the longest, then the rest by their number of slow tests, most
    first, so the last files to start are quick ones, except that the quickest goes third: xdist starts
    each worker with two files, and the demo's worker takes the third. Tests keep their order within a
    file."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    e2e = [f for f in files if f.startswith("tests/e2e/")]
    slow = {f: sum("slow" in item.keywords for item in tests) for f, tests in files.items()}
    rest = sorted((f for f in files if f not in e2e), key=lambda f: (-slow[f], -len(files[f])))
    ordered = e2e + rest[:1] + rest[-1:] + rest[1:-1] if e2e and len(rest) > 1 else e2e + rest
    return [item for f in ordered for item in files[f]]


def reorder(items: list, order: str) -> list:
    """The tests in another order, to find tests that pass only after (or before) some other test:
    ``reverse`` (the files last to first, each file's tests last to first) or ``random:SEED`` (the files
    and each file's tests shuffled by SEED). A file's tests stay together, as xdist's loadfile keeps them."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    groups = list(files.values())
    if order == "reverse":
        return [item for group in reversed(groups) for item in reversed(group)]
    kind, _, seed = order.partition(":")
    if kind != "random" or not seed.isdigit():
        raise pytest.UsageError(f"--test-order {order!r}: use reverse or random:SEED (random:1)")
    rng = random.Random(int(seed))
    rng.shuffle(groups)
    for group in groups:
        rng.shuffle(group)
    return [item for group in groups for item in group]


def pytest_addoption(parser):
    parser.addoption("--full-demo", action="store_true",
                     help="also run the learned demo chains, at 32 and 64 px (tests marked full_demo; make test-demo)")
    parser.addoption("--test-order", default="",
                     help="reverse or random:SEED: run the files and their tests in another order (make test-order)")


def pytest_collection_modifyitems(config, items):
    order = config.getoption("--test-order")
    items[:] = reorder(items, order) if order else schedule_order(items)
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    skip_full = None if config.getoption("--full-demo") else pytest.mark.skip(
        reason="a learned demo chain (32 px: about 3 minutes; 64 px: about 40 on 2 cores): make test-demo")
    for item in items:
        tier = Path(item.fspath).parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)
        if skip_full is not None and "full_demo" in item.keywords:
            item.add_marker(skip_full)


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
