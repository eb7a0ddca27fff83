"""Conversions between every registered format pair, and the sources they accept."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from convert_fixtures import all_tensors, edit_tensors, read_config, tiny_cfg, write_config, write_drafter

from convert.convert import convert_checkpoint, read_source, resolve_source
from dflash_train.errors import CheckpointError, ConfigError
from dflash_train.model import formats
from dflash_train.model.checkpoint import expected_shapes
from dflash_train.model.weights import INDEX_FILE

PAIRS = list(itertools.permutations(sorted(formats.FORMATS), 2))


def _config_fields(folder, dropped=()):
    cfg = read_source(folder).config.model_dump()
    return {k: v for k, v in cfg.items() if k not in dropped}


def _assert_bit_exact(a, b):
    ta, tb = all_tensors(a), all_tensors(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name].view(torch.uint8), tb[name].view(torch.uint8)), name


@pytest.mark.parametrize(("fmt_a", "fmt_b"), PAIRS, ids=[f"{a}->{b}->{a}" for a, b in PAIRS])
def test_round_trip_is_bit_exact(tmp_path, fmt_a, fmt_b):
    """A -> B -> A over every registered pair: identical tensors, config and config.json."""
    write_drafter(tmp_path / "seed")
    start = tmp_path / f"start-{fmt_a}"
    convert_checkpoint(tmp_path / "seed", start, fmt_a)
    convert_checkpoint(start, tmp_path / "mid", fmt_b)
    convert_checkpoint(tmp_path / "mid", tmp_path / "back", fmt_a)
    assert formats.detect_format(tmp_path / "mid").NAME == fmt_b
    _assert_bit_exact(start, tmp_path / "back")
    lost = formats.FORMATS[fmt_b].NOT_CARRIED
    assert _config_fields(start, lost) == _config_fields(tmp_path / "back", lost)
    if not lost:
        assert read_config(start) == read_config(tmp_path / "back")


@pytest.mark.parametrize("fmt", [n for n, m in formats.FORMATS.items() if m.SUPPORTS_REDUCED_VOCAB])
def test_reduced_vocab_round_trip_keeps_vocab_tensors(tmp_path, fmt):
    write_drafter(tmp_path / "seed", tiny_cfg(draft_vocab_size=33))
    convert_checkpoint(tmp_path / "seed", tmp_path / "a", fmt)
    convert_checkpoint(tmp_path / "a", tmp_path / "b", fmt)
    _assert_bit_exact(tmp_path / "seed", tmp_path / "b")
    assert {"lm_head.weight", "d2t", "t2d"} <= set(all_tensors(tmp_path / "b"))


def test_speculators_output_follows_formats_section_3(tmp_path):
    write_drafter(tmp_path / "seed")
    convert_checkpoint(tmp_path / "seed", tmp_path / "z", "zlab")
    zl = read_config(tmp_path / "z")
    assert zl["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    convert_checkpoint(tmp_path / "z", tmp_path / "s", "speculators", block_size=6)
    d = read_config(tmp_path / "s")
    assert "model_type" not in d
    assert d["aux_hidden_state_layer_ids"] == [2, 4, 6]
    assert d["block_size"] == 6
    assert d["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert d["sliding_window_non_causal"] is True and d["sample_from_anchor"] is False
    body = d["transformer_layer_config"]
    assert body["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert body["rope_theta"] == 10000.0 and body["head_dim"] == 16 and body["vocab_size"] == 101


def test_specforge_folder_with_nested_block_size_and_prefixed_tensors(tmp_path):
    """z-lab/SpecForge layout: block_size only in dflash_config, auto_map, `model.` prefixes,
    no target_layer_ids (derived from num_target_layers and the fc width, as z-lab does)."""
    write_drafter(tmp_path / "seed")
    convert_checkpoint(tmp_path / "seed", tmp_path / "sf", "zlab")
    d = read_config(tmp_path / "sf")
    del d["block_size"], d["dflash_config"]["target_layer_ids"]
    d["auto_map"] = {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    d["num_target_layers"] = 36
    write_config(tmp_path / "sf", d)
    edit_tensors(tmp_path / "sf", lambda t: {f"model.{k}": v for k, v in t.items()})
    res = convert_checkpoint(tmp_path / "sf", tmp_path / "out", "speculators")
    out = read_config(tmp_path / "out")
    assert out["aux_hidden_state_layer_ids"] == [2, 18, 34]  # z-lab default ids for L=36, N=3, plus one
    assert out["block_size"] == 8 and out["num_target_layers"] == 36
    ta, tb = all_tensors(tmp_path / "seed"), all_tensors(tmp_path / "out")
    assert sorted(tb) == sorted(ta) and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert res.source_format == "zlab"


def test_layer_ids_flag_and_missing_ids_error(tmp_path):
    write_drafter(tmp_path / "seed")
    convert_checkpoint(tmp_path / "seed", tmp_path / "z", "zlab")
    d = read_config(tmp_path / "z")
    del d["dflash_config"]["target_layer_ids"], d["num_target_layers"]
    write_config(tmp_path / "z", d)
    with pytest.raises(ConfigError, match="--layer-ids"):
        convert_checkpoint(tmp_path / "z", tmp_path / "s", "speculators")
    convert_checkpoint(tmp_path / "z", tmp_path / "s", "speculators", layer_ids=[0, 3, 6])
    assert read_config(tmp_path / "s")["aux_hidden_state_layer_ids"] == [1, 4, 7]


def test_mask_named_by_string_needs_flag(tmp_path):
    write_drafter(tmp_path / "seed")
    convert_checkpoint(tmp_path / "seed", tmp_path / "z", "zlab")
    d = read_config(tmp_path / "z")
    del d["dflash_config"]["mask_token_id"]
    d["dflash_config"]["mask_token"] = "<|MASK|>"
    write_config(tmp_path / "z", d)
    with pytest.raises(CheckpointError, match="--mask-token-id"):
        convert_checkpoint(tmp_path / "z", tmp_path / "s", "speculators")
    convert_checkpoint(tmp_path / "z", tmp_path / "s", "speculators", mask_token_id=99)
    assert read_config(tmp_path / "s")["mask_token_id"] == 99


def test_speculators_copies_are_dropped_and_causal_flag_fixed(tmp_path):
    write_drafter(tmp_path / "src")
    edit_tensors(tmp_path / "src", lambda t: {**t, "embed_tokens.weight": torch.ones(101, 64),
                                              "lm_head.weight": torch.ones(101, 64),
                                              "verifier_lm_head.weight": torch.ones(101, 64)})
    d = read_config(tmp_path / "src")
    d["sliding_window_non_causal"] = False
    write_config(tmp_path / "src", d)
    res = convert_checkpoint(tmp_path / "src", tmp_path / "out", "speculators")
    assert sorted(res.dropped) == ["embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"]
    assert set(all_tensors(tmp_path / "out")) == set(expected_shapes(tiny_cfg()))
    assert read_config(tmp_path / "out")["sliding_window_non_causal"] is True
    assert any("sliding_window_non_causal" in n for n in res.notes)


def test_unknown_tensor_is_named(tmp_path):
    write_drafter(tmp_path / "src")
    edit_tensors(tmp_path / "src", lambda t: {**t, "mystery.weight": torch.ones(3)})
    with pytest.raises(CheckpointError, match="`mystery.weight`"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", "zlab")
    assert not (tmp_path / "out").exists()


def test_sharded_output_has_an_index(tmp_path):
    write_drafter(tmp_path / "src")
    res = convert_checkpoint(tmp_path / "src", tmp_path / "out", "speculators", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "out" / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and set(shards) < set(res.files)
    _assert_bit_exact(tmp_path / "src", tmp_path / "out")


def test_run_folder_uses_final_then_newest_complete_step(tmp_path):
    run = tmp_path / "run"
    write_drafter(run / "checkpoints" / "step-100", seed=1)
    write_drafter(run / "checkpoints" / "step-20", seed=2)
    write_drafter(run / "checkpoints" / "step-300", seed=3)
    (run / "checkpoints" / "step-300" / "model.safetensors").unlink()  # incomplete: skipped
    assert resolve_source(run) == run / "checkpoints" / "step-100"
    write_drafter(run / "final", seed=4)
    assert resolve_source(run) == run / "final"
    convert_checkpoint(run, tmp_path / "out", "zlab")
    _assert_bit_exact(run / "final", tmp_path / "out")
    with pytest.raises(CheckpointError, match="final/"):
        resolve_source(tmp_path / "out" / "..")


def test_verifier_architectures_read_from_its_config(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    write_drafter(tmp_path / "src", tiny_cfg(verifier_architectures=None))
    convert_checkpoint(tmp_path / "src", tmp_path / "out", "speculators", verifier=str(tmp_path / "target"))
    verifier = read_config(tmp_path / "out")["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(tmp_path / "target"), "architectures": ["LlamaForCausalLM"]}


def test_mask_embedding_travels_along(tmp_path):
    write_drafter(tmp_path / "src")
    torch.save({"embedding": torch.zeros(64), "mask_token_id": 100}, tmp_path / "src" / "mask_embedding.pt")
    convert_checkpoint(tmp_path / "src", tmp_path / "out", "zlab")
    assert (tmp_path / "out" / "mask_embedding.pt").read_bytes() == (tmp_path / "src" / "mask_embedding.pt").read_bytes()
