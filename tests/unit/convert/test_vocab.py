"""reduce-vocab / expand-vocab against the real embedded SmolLM2 target's LM head."""

from __future__ import annotations

import pytest
import torch
from convert_fixtures import all_tensors, edit_tensors, read_config, smollm2_cfg, tiny_cfg, write_drafter

from convert.convert import convert_checkpoint
from convert.validate import validate_folder
from convert.vocab import expand_vocab, read_target_head, reduce_vocab
from dflash_train.data.vocab import reduced_vocab_maps, write_token_freq
from dflash_train.errors import CheckpointError, ConfigError


@pytest.fixture(scope="module")
def reduced(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("vocab")
    write_drafter(root / "full", smollm2_cfg())
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 50, (49152,), generator=g)
    counts[::7] = 0
    write_token_freq(root / "token_freq.json", counts)
    result = reduce_vocab(root / "full", root / "reduced", root / "token_freq.json", 1000, target=str(smollm2_path))
    return root, counts, result


def test_reduced_head_is_target_rows(reduced, smollm2_path):
    root, counts, result = reduced
    tensors = all_tensors(root / "reduced")
    d2t, t2d = reduced_vocab_maps(counts, 1000)
    assert torch.equal(tensors["d2t"], d2t) and torch.equal(tensors["t2d"], t2d)
    head = read_target_head(str(smollm2_path)).weight
    assert torch.equal(tensors["lm_head.weight"], head[t2d].float())
    cfg = read_config(root / "reduced")
    assert cfg["draft_vocab_size"] == 1000 and cfg["transformer_layer_config"]["vocab_size"] == 49152
    assert validate_folder(root / "reduced").ok
    assert any("covering" in n for n in result.notes)


def test_zlab_refuses_reduced_vocab(reduced, tmp_path):
    root, _, _ = reduced
    with pytest.raises(CheckpointError, match="SGLang cannot serve"):
        convert_checkpoint(root / "reduced", tmp_path / "z", "zlab")


def test_expand_vocab_restores_the_full_drafter(reduced, tmp_path):
    root, _, _ = reduced
    result = expand_vocab(root / "reduced", tmp_path / "z", "zlab")  # default target: embedded SmolLM2
    assert "logits over the kept ids are unchanged" in result.notes[-1]
    full, back = all_tensors(root / "full"), all_tensors(tmp_path / "z")
    assert sorted(full) == sorted(back) and all(torch.equal(full[k], back[k]) for k in full)
    assert validate_folder(tmp_path / "z").ok


def test_expand_vocab_says_when_it_is_not_exact(reduced, tmp_path):
    import shutil

    root, _, _ = reduced
    shutil.copytree(root / "reduced", tmp_path / "trained")
    edit_tensors(tmp_path / "trained", lambda t: {**t, "lm_head.weight": t["lm_head.weight"] * 1.5})
    result = expand_vocab(tmp_path / "trained", tmp_path / "z", "zlab")
    assert "NOT exact" in result.notes[-1]


def test_expand_needs_a_matching_target(tmp_path):
    write_drafter(tmp_path / "r", tiny_cfg(draft_vocab_size=33))
    with pytest.raises(ConfigError, match="--target"):
        expand_vocab(tmp_path / "r", tmp_path / "z", "zlab")


def test_validate_against_the_target(reduced, tmp_path):
    root, _, _ = reduced
    report = validate_folder(root / "full", use_target=True)
    assert report.ok, [(c.check, c.reason) for c in report.failures()]
    assert {"target_hidden_size", "target_layers", "target_vocab", "target_mask_token"} <= {c.check for c in report.checks}
    write_drafter(tmp_path / "im_start", smollm2_cfg(mask_token_id=1))  # <|im_start|>: the template emits it
    write_drafter(tmp_path / "text", smollm2_cfg(mask_token_id=300))     # an ordinary text token
    write_drafter(tmp_path / "tiny", tiny_cfg())
    for name, check in (("im_start", "target_mask_token"), ("text", "target_mask_token"),
                        ("tiny", "target_hidden_size"), ("tiny", "target_vocab")):
        failed = {c.check: c.reason for c in validate_folder(tmp_path / name, use_target=True).failures()}
        assert check in failed and "mask_token_id" in failed.get("target_mask_token", "mask_token_id")
