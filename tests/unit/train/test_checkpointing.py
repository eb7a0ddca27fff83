"""Which checkpoints can be resumed from, judged from real files: a whole one passes; a truncated
engine file, an unreadable state.json, a missing RNG / optimizer / weight shard are each named."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from dflash_train.errors import CheckpointError
from dflash_train.model.checkpoint import save_drafter
from dflash_train.model.modeling_dflash import DFlashDraftModel
from dflash_train.train import checkpointing as ckpt
from dflash_train.train.engine import World


def make_checkpoint(run: Path, step: int, tiny_config, world_size: int = 1, zero: bool = False) -> Path:
    """The files save_checkpoint writes, with real torch.save archives and a real drafter."""
    folder = run / "checkpoints" / ckpt.step_name(step)
    save_drafter(DFlashDraftModel(tiny_config), folder, own=True, command="train")
    state = folder / ckpt.STATE
    (state / "engine").mkdir(parents=True)
    torch.save({"module": {"w": torch.randn(64, 64)}}, state / "engine" / "mp_rank_00_model_states.pt")
    for r in range(world_size):
        torch.save({"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": None},
                   state / f"rng-rank{r}.pt")
        if zero:
            torch.save({"m": torch.randn(32)}, state / "engine" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    (state / "state.json").write_text(json.dumps({"step": step, "world_size": world_size, "history": []}))
    return folder


def truncate(path: Path, keep: float = 0.5) -> None:
    os.truncate(path, int(path.stat().st_size * keep))


@pytest.fixture
def run(tmp_path, tiny_config):
    for step in (2, 4, 6):
        make_checkpoint(tmp_path, step, tiny_config)
    return tmp_path


def test_whole_checkpoints_pass_newest_first(run):
    whole, damaged = ckpt.usable_checkpoints(run)
    assert [p.name for p in whole] == ["step-000006", "step-000004", "step-000002"] and damaged == []
    assert ckpt.checkpoint_problem(whole[0]) is None


@pytest.mark.parametrize("damage, needle", [
    (lambda f: truncate(f / "trainer_state" / "engine" / "mp_rank_00_model_states.pt"),
     "trainer_state/engine/mp_rank_00_model_states.pt is truncated"),
    (lambda f: (f / "trainer_state" / "state.json").write_text('{"step": 6, "hist'), "state.json is unreadable"),
    (lambda f: (f / "trainer_state" / "state.json").unlink(), "state.json is missing"),
    (lambda f: (f / "trainer_state" / "rng-rank0.pt").unlink(), "trainer_state/rng-rank0.pt is missing"),
    (lambda f: (f / "trainer_state" / "engine" / "mp_rank_00_model_states.pt").unlink(), "holds no model states"),
    (lambda f: truncate(f / "model.safetensors", 0.9), "drafter files damaged"),
    (lambda f: (f / "model.safetensors").unlink(), "drafter files damaged"),
    (lambda f: (f / "config.json").write_text("{"), "drafter files damaged"),
])
def test_each_kind_of_damage_is_named(run, damage, needle):
    newest = run / "checkpoints" / "step-000006"
    damage(newest)
    whole, damaged = ckpt.usable_checkpoints(run)
    assert [p.name for p in whole] == ["step-000004", "step-000002"]
    assert [p.name for p, _ in damaged] == ["step-000006"] and needle in damaged[0][1]


def test_missing_rank_shards_are_damage(tmp_path, tiny_config):
    folder = make_checkpoint(tmp_path, 2, tiny_config, world_size=2, zero=True)
    assert ckpt.checkpoint_problem(folder) is None
    (folder / "trainer_state" / "engine" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert "optimizer shard of rank(s) [1]" in ckpt.checkpoint_problem(folder)
    folder = make_checkpoint(tmp_path, 4, tiny_config, world_size=2)
    (folder / "trainer_state" / "rng-rank1.pt").unlink()
    assert "rng-rank1.pt is missing" in ckpt.checkpoint_problem(folder)


class _Engine:
    """Stands in for the DeepSpeed engine's loader only: torch.load of the real engine file."""

    def __init__(self):
        self.loaded = []

    def load_checkpoint(self, load_dir, tag, **_):
        path = Path(load_dir) / tag / "mp_rank_00_model_states.pt"
        torch.load(path, weights_only=False)
        self.loaded.append(Path(load_dir).parent.name)
        return str(path), {}


def test_resume_falls_back_past_damaged_checkpoints_and_says_so(run):
    truncate(run / "checkpoints" / "step-000006" / "trainer_state" / "engine" / "mp_rank_00_model_states.pt")
    (run / "checkpoints" / "step-000004" / "trainer_state" / "state.json").write_text("not json")
    notes, engine = [], _Engine()
    state = ckpt.resume_latest(engine, World(0, 1, 0, torch.device("cpu")), run, notes.append)
    assert state["step"] == 2 and engine.loaded == ["step-000002"]
    assert notes[0].startswith("warning: checkpoint ") and "step-000006 is damaged" in notes[0]
    assert "step-000004 is damaged" in notes[1] and "state.json is unreadable" in notes[1]
    assert notes[2] == f"resuming from {run / 'checkpoints' / 'step-000002'} (step 2)"
    # the damaged folders are left for the user to inspect; nothing was deleted
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004", "step-000006"]


def test_a_file_that_passes_the_checks_but_fails_to_load_is_skipped_too(run):
    engine_file = run / "checkpoints" / "step-000006" / "trainer_state" / "engine" / "mp_rank_00_model_states.pt"
    data = bytearray(engine_file.read_bytes())
    start = data.index(b"data.pkl") + 60  # inside the pickle: the zip directory stays whole
    data[start:start + 40] = b"\x00" * 40
    engine_file.write_bytes(bytes(data))
    assert ckpt.checkpoint_problem(engine_file.parents[2]) is None
    notes = []
    state = ckpt.resume_latest(_Engine(), World(0, 1, 0, torch.device("cpu")), run, notes.append)
    assert state["step"] == 4 and "step-000006 is damaged (" in notes[0] and "cannot be loaded" in notes[0]


def test_no_usable_checkpoint_is_a_clear_error(run):
    for step in (2, 4, 6):
        (run / "checkpoints" / ckpt.step_name(step) / "trainer_state" / "state.json").unlink()
    notes = []
    with pytest.raises(CheckpointError, match=r"--resume: no usable checkpoint in .*checkpoints \(all damaged"):
        ckpt.resume_latest(_Engine(), World(0, 1, 0, torch.device("cpu")), run, notes.append)
    assert len(notes) == 3 and all("is damaged" in n for n in notes)
