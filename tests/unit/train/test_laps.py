"""dflash_train/train/metrics.Laps: a run's seconds by stage, with the checks and checkpoints inside the steps
counted apart from them. A clock the test moves, so the numbers are exact on a busy machine too."""

import time

import pytest

from dflash_train.train.metrics import Laps


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> None:
        self.now += seconds


def test_blocks_set_aside_leave_the_lap_they_sit_in():
    clock = Clock()
    lap = Laps(clock)
    clock.wait(0.05)
    lap("setup")
    for _ in range(2):
        clock.wait(0.05)  # a step
        with lap.aside("checks"):
            clock.wait(0.1)
    with lap.aside("checkpoints"):
        clock.wait(0.05)
    lap("steps")
    clock.wait(0.01)
    seconds = lap.final()
    assert list(seconds) == ["setup", "steps", "checks", "checkpoints", "final"]
    assert seconds == pytest.approx({"setup": 0.05, "steps": 0.10, "checks": 0.20, "checkpoints": 0.05,
                                     "final": 0.01})  # the steps without the 0.25 s set aside inside them


def test_a_block_that_raises_is_still_counted_aside():
    clock = Clock()
    lap = Laps(clock)
    with pytest.raises(RuntimeError), lap.aside("checks"):
        clock.wait(0.05)
        raise RuntimeError("out of memory")
    clock.wait(0.02)
    lap("steps")
    assert lap.final() == pytest.approx({"checks": 0.05, "steps": 0.02, "final": 0.0})


def test_the_default_clock_counts_real_seconds():
    lap = Laps()
    time.sleep(0.05)
    lap("setup")
    assert 0.04 <= lap.final()["setup"] < 5  # a lower bound that holds on any machine, however busy


def test_each_lap_records_the_memory_high_water_mark_as_it_closes():
    import psutil

    lap = Laps()
    lap("load")
    resident = psutil.Process().memory_info().rss / 1024**3
    block = bytearray(300 * 1024**2)
    block[::4096] = b"x" * len(block[::4096])  # every page resident
    lap("features")
    lap.final()
    assert list(lap.memory) == ["load", "features", "final"]
    marks = {k: v["process"] for k, v in lap.memory.items()}
    # the block took this process past resident + 0.29 GiB: the mark is there now, whatever it was before
    assert marks["features"] >= max(marks["load"], resident + 0.28), (resident, marks)
    assert marks["final"] == marks["features"] and lap.memory["final"]["children"] >= 0
    del block
