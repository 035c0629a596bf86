"""The next optimizer step's micro-batches, built in a background thread while the current step runs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from sd.data.training_data import MixedData


class Prefetcher:
    """Builds the next optimizer step's micro-batches in a background thread while the current step
    runs, into pinned memory on a CUDA run (so the copy to the device is asynchronous).

    A batch depends only on its key ``(epoch, position)``, never on when it was built, so resuming
    is unaffected: a batch read ahead and not used is dropped.
    """

    def __init__(self, data: MixedData, pin: bool):
        self.data, self.pin = data, pin
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self.pending = None  # (key, future)

    def build(self, batches: list, flips: list | None = None, draws: list | None = None) -> list:
        """The micro-batches of ``batches`` (global indices), with their flip coins and caption draw keys
        (``sd.data.training_data.epoch_plan``): here, in the background thread, the loader's captions
        are read and tokenised."""
        none = [None] * len(batches)
        micro = [self.data.batch(rows, flipped) if keys is None else self.data.batch(rows, flipped, keys)
                 for rows, flipped, keys in zip(batches, flips or none, draws or none)]
        if self.pin:
            micro = [tuple(t.pin_memory() for t in pair) for pair in micro]
        return micro

    def ahead(self, key, batches: list, flips: list | None = None, draws: list | None = None) -> None:
        self.pending = (key, self.pool.submit(self.build, batches, flips, draws))

    def take(self, key, batches: list, flips: list | None = None, draws: list | None = None) -> list:
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] == key:
            return pending[1].result()
        if pending is not None:
            pending[1].cancel()
        return self.build(batches, flips, draws)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
