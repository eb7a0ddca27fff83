"""dflash_train/cli.py: the spellings of --resume (typer options take no optional value)."""

import pytest

from dflash_train.cli import bare_resume


@pytest.mark.parametrize("argv, expected", [
    (["train", "--config", "r.yaml", "--resume"], ["train", "--config", "r.yaml", "--resume=must"]),
    (["train", "--resume", "--max-steps", "2"], ["train", "--resume=must", "--max-steps", "2"]),
    (["train", "--resume", "auto", "--max-steps", "2"], ["train", "--resume", "auto", "--max-steps", "2"]),
    (["train", "--resume=auto"], ["train", "--resume=auto"]),
    (["train", "--resume", "bogus"], ["train", "--resume", "bogus"]),  # left to the command, which names it
    (["train", "--set", "x=--resume"], ["train", "--set", "x=--resume"]),
])
def test_bare_resume_means_must(argv, expected):
    assert bare_resume(argv) == expected
