"""Detection: drafter folders, hub ids, training runs, and refusals that say what was found."""

import json
import os
import shutil

import pytest

from dflash_train.errors import CheckpointError
from dflash_train.model.locate import newest_run_checkpoint as newest_checkpoint
from serve_shim.detect import detect_drafter, is_hub_id


def test_speculators_folder(make_tiny_drafter):
    folder = make_tiny_drafter("spec", block_size=6)
    d = detect_drafter(str(folder))
    assert (d.format, d.is_hub_id, d.location) == ("speculators", False, str(folder.resolve()))
    assert d.block_size == 6 and d.verifier == "org/tiny-target"
    assert d.config.aux_hidden_state_layer_ids == [2, 4, 6]


def test_zlab_folder(make_tiny_drafter):
    folder = make_tiny_drafter("zl", fmt="zlab", block_size=5)
    d = detect_drafter(str(folder))
    assert d.format == "zlab" and d.block_size == 5
    # z-lab ids are aux - 1 on disk; detection reads them back as aux ids
    assert json.loads((folder / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert d.config.aux_hidden_state_layer_ids == [2, 4, 6]


def test_training_run_prefers_final(make_tiny_drafter, tmp_path):
    run = tmp_path / "run"
    make_tiny_drafter("run/checkpoints/step-200", block_size=4)
    make_tiny_drafter("run/final", block_size=8)
    d = detect_drafter(str(run))
    assert d.location == str((run / "final").resolve()) and d.block_size == 8
    assert "training run" in d.found


def test_training_run_newest_complete_step(make_tiny_drafter, tmp_path):
    run = tmp_path / "run"
    make_tiny_drafter("run/checkpoints/step-9", block_size=4)
    make_tiny_drafter("run/checkpoints/step-10", block_size=6)  # numeric order: 10 > 9
    newest = make_tiny_drafter("run/checkpoints/step-11", block_size=8)
    (newest / "model.safetensors").unlink()  # an interrupted save: config but no weights
    (run / "final").mkdir()  # an empty final/ is not complete either
    (run / "checkpoints" / "step-12").mkdir()
    (run / "checkpoints" / "step-12" / "optimizer.pt").write_bytes(b"x")
    assert newest_checkpoint(run) == run / "checkpoints" / "step-10"
    assert detect_drafter(str(run)).block_size == 6


def test_hub_id_uses_fetched_config(make_tiny_drafter):
    folder = make_tiny_drafter("hubcopy", fmt="zlab", block_size=7)
    seen = []

    def fetch(repo):
        seen.append(repo)
        return folder

    d = detect_drafter("z-lab/Some-DFlash", fetch_config=fetch)
    assert seen == ["z-lab/Some-DFlash"]
    assert (d.location, d.is_hub_id, d.format, d.block_size) == ("z-lab/Some-DFlash", True, "zlab", 7)


def test_refuses_folder_without_drafter(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "sub").mkdir()
    with pytest.raises(CheckpointError) as err:
        detect_drafter(str(tmp_path))
    msg = str(err.value)
    assert "notes.txt" in msg and "sub/" in msg  # what was found
    assert "speculators_config" in msg and "dflash_config" in msg and "checkpoints/step-N" in msg  # expected


def test_refuses_plain_model_folder(smollm2_path, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    shutil.copy(smollm2_path / "config.json", target / "config.json")
    with pytest.raises(CheckpointError, match=r"model_type='llama'.*speculators_config"):
        detect_drafter(str(target))


def test_refuses_drafter_without_weights(make_tiny_drafter):
    folder = make_tiny_drafter("noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        detect_drafter(str(folder))


def test_refuses_file_and_nonsense(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file"):
        detect_drafter(str(f))
    with pytest.raises(CheckpointError, match="no such folder and not a hub id"):
        detect_drafter(str(tmp_path / "missing" / "deeper"))


def test_is_hub_id(tmp_path, monkeypatch):
    assert is_hub_id("z-lab/Qwen3-8B-DFlash-b16")
    assert not is_hub_id("/abs/path") and not is_hub_id("./rel") and not is_hub_id("a/b/c")
    monkeypatch.chdir(tmp_path)
    os.makedirs("org/name")
    assert not is_hub_id("org/name")  # an existing local folder wins


def test_broken_folders_are_refused_with_validates_reason(make_tiny_drafter, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = make_tiny_drafter("spec")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["fc.weight"][0, 0] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"CHECKPOINT {folder}: tensor `fc.weight` holds NaN or inf"):
        detect_drafter(str(folder))


def test_an_explicit_target_found_locally_is_checked(make_tiny_drafter, tmp_path, smollm2_path):
    folder = make_tiny_drafter("spec")  # hidden 64, vocab 101: not a SmolLM2 drafter
    assert detect_drafter(str(folder), target="org/not-cached").block_size == 8  # unknown here: the engine checks
    with pytest.raises(CheckpointError, match=f"target_hidden_size 64 differs from the target's hidden_size 576 "
                                              f"\\({smollm2_path}\\)"):
        detect_drafter(str(folder), target=str(smollm2_path))


def test_the_drafters_own_verifier_is_checked_when_no_target_is_given(make_tiny_drafter, smollm2_path):
    # vLLM loads the verifier named in the drafter when --target is left out: a drafter that names the
    # embedded SmolLM2 (found here) but has hidden 64 is refused before any engine starts
    folder = make_tiny_drafter("spec", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(CheckpointError, match="target_hidden_size 64 differs from the target's hidden_size 576"):
        detect_drafter(str(folder))
    assert detect_drafter(str(make_tiny_drafter("other", verifier="org/not-cached"))).block_size == 8
