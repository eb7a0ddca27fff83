"""How much RAM a command took at its peak: what a newcomer's laptop must have free.

Two measures, each for one question:
- `TreePeak`: the anonymous resident memory (the resident set less its file-backed and shared pages) of a process
  and every process under it, summed and sampled while it runs (a stage of the demo or a sweep: the train command
  with its vLLM worker, the lanes' stages side by side). That is what has to fit in RAM: a mapped file's pages (the
  feature cache the steps read, the torch libraries every process maps) are counted by the kernel in each
  process's resident set but can be dropped under pressure and read again.
- `high_water`: what the kernel recorded as this process's own resident peak, and its largest finished child's
  (a vLLM worker once it has ended), mapped files' pages included. A run reads it at each lap, so its summary says
  which lap raised the peak.
"""

from __future__ import annotations

import sys
import threading

GIB = 1024**3


def gib(n_bytes: float) -> float:
    return round(n_bytes / GIB, 2)


def anonymous_bytes(memory) -> int:
    """A psutil `memory_info()`'s resident bytes less the file-backed and shared ones (Linux reports them; macOS and
    Windows do not, so there it is the whole resident set)."""
    return memory.rss - getattr(memory, "shared", 0)


def tree_anonymous_bytes(pid: int) -> int:
    """`anonymous_bytes` of `pid` and its descendants, summed (0 once it has ended)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:  # ended
        return 0
    total = 0
    for proc in procs:
        try:
            total += anonymous_bytes(proc.memory_info())
        except psutil.Error:  # ended between the listing and the read
            pass
    return total


class TreePeak:
    """`with TreePeak(pid) as peak:` samples `tree_anonymous_bytes(pid)` every `interval` seconds in a thread until
    the block ends; `peak.bytes` is the largest sum seen (a spike shorter than the interval can be missed)."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval, self.bytes = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name=f"tree-peak-{pid}", daemon=True)

    def _sample(self) -> None:
        while True:
            self.bytes = max(self.bytes, tree_anonymous_bytes(self.pid))
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> TreePeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def high_water() -> dict[str, float]:
    """{"process": GiB, "children": GiB}: this process's resident peak so far, and that of its largest child that
    has ended (and been waited for); both only grow. A forked child's mark starts at its parent's resident set
    when it forked, so "children" is at least the parent's size then. Empty where the OS keeps no such record
    (Windows)."""
    try:
        import resource
    except ImportError:
        return {}
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return {"process": gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale),
            "children": gib(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale)}
