"""dflash_train/train/metrics.Laps: a run's seconds by stage, with the checks and checkpoints inside the steps
counted apart from them."""

import time

import pytest

from dflash_train.train.metrics import Laps


def test_blocks_set_aside_leave_the_lap_they_sit_in():
    lap = Laps()
    time.sleep(0.05)
    lap("setup")
    for _ in range(2):
        time.sleep(0.05)  # a step
        with lap.aside("checks"):
            time.sleep(0.1)
    with lap.aside("checkpoints"):
        time.sleep(0.05)
    lap("steps")
    seconds = lap.final()
    assert list(seconds) == ["setup", "steps", "checks", "checkpoints", "final"]
    assert seconds["setup"] == pytest.approx(0.05, abs=0.03)
    assert seconds["steps"] == pytest.approx(0.10, abs=0.04)  # without the 0.25 s set aside inside it
    assert seconds["checks"] == pytest.approx(0.20, abs=0.04) and seconds["checkpoints"] == pytest.approx(0.05, abs=0.03)
    assert seconds["final"] < 0.02


def test_a_block_that_raises_is_still_counted_aside():
    lap = Laps()
    with pytest.raises(RuntimeError), lap.aside("checks"):
        time.sleep(0.05)
        raise RuntimeError("out of memory")
    lap("steps")
    assert lap.final()["checks"] == pytest.approx(0.05, abs=0.03) and lap.final()["steps"] < 0.03
