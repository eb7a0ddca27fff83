"""Finding and loading drafters for evaluation: both formats, reduced vocab, trainer folders."""

from __future__ import annotations

import json

import pytest
from handbuilt_models import MASK, copy_drafter, cycle_target

from dflash_train.errors import CheckpointError, ConfigError
from dflash_train.eval.report import step_stats
from dflash_train.eval.run import EvalConfig, resolve_drafter_dir, run_eval
from dflash_train.eval.spec_decode import plain_generate, speculative_generate
from dflash_train.model.checkpoint import load_drafter, save_drafter
from dflash_train.model.formats import zlab
from dflash_train.model.weights import write_json, write_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

CYCLE = [0, 2, 3, 4, 1, 5, 6, MASK]
PROMPT = [3, 4, 1, 2, 3, 4, 1, 2, 3]


def _save_zlab(model, folder, drop_mask_id=False):
    folder.mkdir(parents=True)
    config = zlab.to_config_dict(model.config)
    if drop_mask_id:  # some z-lab releases name the mask by string only
        del config["dflash_config"]["mask_token_id"]
        config["dflash_config"]["mask_token"] = "<|MASK|>"
    write_tensors(folder, model.state_dict())
    write_json(folder / "config.json", config)
    return folder


def _tau(draft, target, max_new):
    draft.attach_target(target)
    spec = speculative_generate(draft, target, PROMPT, max_new)
    assert spec.tokens == plain_generate(target, PROMPT, max_new).tokens
    return step_stats(spec.steps, draft.config.block_size)["tau"]


@pytest.mark.parametrize("fmt, reduced", [("speculators", False), ("speculators", True), ("zlab", False)])
def test_saved_drafters_decode_exactly(tmp_path, fmt, reduced):
    target = cycle_target(CYCLE)
    model = copy_drafter(4, period=4, next_table=CYCLE, reduced=reduced)
    folder = tmp_path / "draft"
    if fmt == "zlab":
        _save_zlab(model, folder)
    else:
        save_drafter(model, folder, dtype="float32")
    loaded = load_drafter(folder, target_config=target.config)
    assert loaded.config.reduced_vocab is reduced
    assert _tau(loaded, target, max_new=13) == 4.0


def test_zlab_drafter_with_string_mask_needs_the_flag(tmp_path):
    target = cycle_target(CYCLE)
    folder = _save_zlab(copy_drafter(4, period=4, next_table=CYCLE), tmp_path / "zl", drop_mask_id=True)
    with pytest.raises(CheckpointError, match="--mask-token-id"):
        load_drafter(folder, target_config=target.config)
    loaded = load_drafter(folder, target_config=target.config, mask_token_id=MASK)
    assert _tau(loaded, target, max_new=9) == 4.0


def _drafter_folder(path):
    save_drafter(copy_drafter(4, period=4, next_table=CYCLE), path, dtype="float32")
    return path


def test_resolve_drafter_folder_and_trainer_outputs(tmp_path):
    plain = _drafter_folder(tmp_path / "plain")
    assert resolve_drafter_dir(plain) == plain

    run = tmp_path / "run"
    _drafter_folder(run / "checkpoints" / "step-9")
    _drafter_folder(run / "checkpoints" / "step-10" / "drafter")  # a checkpoint keeping its model in a subfolder
    (run / "checkpoints" / "step-11").mkdir()  # an unfinished checkpoint: skipped
    assert resolve_drafter_dir(run) == run / "checkpoints" / "step-10" / "drafter"
    _drafter_folder(run / "final")
    assert resolve_drafter_dir(run) == run / "final"

    with pytest.raises(CheckpointError, match="^--draft .*step-11: no config.json with weights here, no final/ and no "
                                              "complete checkpoints/step-\\*/ folder; give a drafter checkpoint"):
        resolve_drafter_dir(tmp_path / "run" / "checkpoints" / "step-11")
    with pytest.raises(CheckpointError, match="^--draft .*missing: no such folder"):
        resolve_drafter_dir(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="^--draft .*config.json: a file, not a folder; give a drafter checkpoint "
                                              "folder"):
        resolve_drafter_dir(plain / "config.json")


def test_run_eval_refuses_a_too_large_block_before_loading(tmp_path):
    folder = _drafter_folder(tmp_path / "d")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    cfg = EvalConfig(draft=str(folder), target=str(tmp_path / "no-such-target"), prompts=str(prompts), block_size=9)
    with pytest.raises(ConfigError, match="--block-size 9: larger than the drafter's trained block_size 4"):
        run_eval(cfg, progress=False)


def test_devices_this_machine_cannot_run_are_refused_first(tmp_path):
    import torch

    from dflash_train.eval.run import check_device

    check_device(None)
    check_device("cpu")
    with pytest.raises(ConfigError, match="--device gpu0: not a torch device; use cpu, cuda or cuda:N"):
        check_device("gpu0")
    if not torch.cuda.is_available():
        folder = _drafter_folder(tmp_path / "d")
        cfg = EvalConfig(draft=str(folder), target=str(tmp_path / "no-such-target"), prompts="unused", device="cuda:0")
        with pytest.raises(ConfigError, match=r"--device cuda:0: (this torch build has no CUDA|no CUDA GPU is visible); "
                                              "use --device cpu"):
            run_eval(cfg, progress=False)
