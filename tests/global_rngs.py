"""The global random number generators (torch's CPU and CUDA ones, numpy's, Python's) as a test finds them.

``left_alone()`` asserts that its body leaves every one in the state it was in. It first moves them to a
state of its own, so the check does not depend on what earlier tests drew: it passes or fails the same in
any order.
"""

import contextlib
import random

import numpy as np
import torch


def snapshot() -> dict:
    """Every global RNG's state, copied."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def changed(before: dict, after: dict) -> list[str]:
    """The names of the generators whose state differs between two snapshots."""
    def equal(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return torch.equal(a, b)
        if isinstance(a, np.ndarray):
            return np.array_equal(a, b)
        if isinstance(a, (tuple, list)):
            return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
        return a == b

    return [name for name in before if not equal(before[name], after[name])]


def scramble() -> None:
    """Move every global RNG to a state that no code under test leaves it in: seeded with a value no test
    uses, then one draw further. A function that wrongly seeds the global RNG (and draws) leaves it in a
    state of its own seed, which this one cannot be; without this, a test that had just called the same
    function would find the state it left and could not tell."""
    torch.manual_seed(SCRAMBLE_SEED)
    torch.rand(1)
    np.random.seed(SCRAMBLE_SEED)
    np.random.rand()
    random.seed(SCRAMBLE_SEED)
    random.random()


SCRAMBLE_SEED = 0x5CA3B1E


@contextlib.contextmanager
def left_alone():
    """Fail unless the body leaves every global RNG as it found it (after ``scramble``)."""
    scramble()
    before = snapshot()
    yield
    moved = changed(before, snapshot())
    assert not moved, f"the global RNG(s) {moved} were drawn from"
