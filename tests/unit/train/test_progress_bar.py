"""The run records: the progress bar shows the check's every-position acceptance beside the step's own."""

from dflash_train.train.metrics import Progress


def _entry(accept_len):
    return {"loss": 1.0, "acc": [0.5], "accept_len": accept_len, "positions": 100}


def test_the_bar_shows_the_last_checks_beside_the_steps_tau():
    bar = Progress(total=10, start=0, enabled=True)
    bar.show(_entry(2.234), 1e-3, 100)
    assert bar.bar.postfix.startswith("loss=1.000, tau=2.23, lr=") and "fit=" not in bar.bar.postfix
    bar.show(_entry(2.234), 1e-3, 200, fit=_entry(1.904), val=_entry(1.661))
    # the step's sampled blocks, then training rows and held-out rows at every position, in that order
    assert "tau=2.23, fit=1.90, val=1.66, lr=1.00e-03" in bar.bar.postfix
    bar.close()


def test_no_bar_still_counts_the_sessions_positions():
    quiet = Progress(total=10, start=0, enabled=False)
    quiet.show(_entry(1.5), 1e-3, 300, fit=_entry(1.4))
    assert quiet.bar is None and quiet.positions0 == 200
