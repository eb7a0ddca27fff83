"""The next step's micro-batches, built on the host while the device runs this step.

Building a micro-batch is host work (reading rows, packing, sampling anchors, laying out blocks, the
pinned copy; in online mode the target's forward too): done between steps it leaves the GPU idle.
`StepPrefetch` builds step s + 1 in one background thread as soon as step s has taken its own, so the
loop finds it ready (on a GPU; on a CPU the loop builds each step itself: `worth_prefetching`).
Which rows and anchors a step trains on depends only on (step, micro-batch, rank) and seeds of their own, never on when it is built, so a prefetched run trains on exactly what an
unprefetched one does, and a resumed run exactly what an uninterrupted one does. Only host and
target work happens in the thread: the collectives (the global weight's all_reduce) stay on the loop's
thread, in the same order on every rank. An error in the thread is raised by `get`, in the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


def worth_prefetching(device: torch.device, setting: str | bool = "auto") -> bool:
    """`engine.prefetch`: true, false, or auto: whether building the next step in a background thread
    pays. On a GPU it does (the host is free while the device runs). On a CPU the host work and the step share the
    cores, and the thread's tensor ops fight the step's OpenMP threads for them: the demo's steps took 1.20x
    as long with the thread (2 cores; `python bench/bench_prefetch.py`)."""
    return setting is True or (setting == "auto" and device.type != "cpu")


class StepPrefetch(Generic[T]):
    """`get(step)` returns `build(step)` and starts building step + 1 (below `total`) in the background."""

    def __init__(self, build: Callable[[int], T], total: int, device: torch.device | None = None,
                 enabled: bool = True):
        self.build, self.total = build, total
        self._pending: tuple[int, Future] | None = None
        self._pool = None
        if enabled:
            def same_device():  # the CUDA current device is per thread: the rank's, as in the loop
                if device is not None and device.type == "cuda":
                    torch.cuda.set_device(device)

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="step-prefetch", initializer=same_device)

    def get(self, step: int) -> T:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == step:
            result = pending[1].result()
        else:  # the first step, or a step other than the one prefetched (nothing to reuse)
            if pending is not None:
                pending[1].cancel()
                _quietly(pending[1])
            result = self.build(step)
        if self._pool is not None and step + 1 < self.total:
            self._pending = (step + 1, self._pool.submit(self.build, step + 1))
        return result

    def close(self) -> None:
        """Drop a prefetched step nobody will take and stop the thread (waits for a build under way)."""
        if self._pending is not None:
            self._pending[1].cancel()
            _quietly(self._pending[1])
            self._pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> StepPrefetch[T]:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _quietly(future: Future) -> None:
    """Wait for a discarded build; its error (if any) no longer matters."""
    if not future.cancelled():
        try:
            future.result()
        except Exception:  # noqa: BLE001 - nobody takes this step's batches
            pass
