"""Saving and loading drafters: the speculators format, bit-exact reloads, and clear load errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train.errors import CheckpointError, DFlashError
from dflash_train.model.checkpoint import load_drafter, save_drafter
from dflash_train.model.init import new_drafter_for_target
from dflash_train.model.modeling_dflash import DFlashDraftModel


@pytest.fixture(scope="module")
def smollm2_drafter():
    return new_drafter_for_target(None, num_layers=2, block_size=8, num_features=5, seed=3)


@pytest.fixture
def saved(tmp_path, smollm2_drafter):
    return save_drafter(smollm2_drafter, tmp_path / "drafter", dtype="float32")


def test_saved_config_holds_every_speculators_key(saved, smollm2_path):
    cfg = json.loads((saved / "config.json").read_text())
    assert "model_type" not in cfg
    assert cfg["speculators_model_type"] == "dflash"
    assert cfg["architectures"] == ["DFlashSpeculator"]
    assert cfg["tie_word_embeddings"] is False and cfg["speculators_version"] and cfg["dtype"] == "float32"
    assert cfg["aux_hidden_state_layer_ids"] == [t + 1 for t in [1, 8, 14, 20, 27]]
    assert cfg["mask_token_id"] == 16 and cfg["block_size"] == 8
    assert cfg["draft_vocab_size"] == 49152 and cfg["target_hidden_size"] == 576
    assert cfg["sliding_window_non_causal"] is True and cfg["sample_from_anchor"] is False
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 7,
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                "architectures": ["LlamaForCausalLM"]}
    body = cfg["transformer_layer_config"]
    target = json.loads((smollm2_path / "config.json").read_text())
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                "max_position_embeddings", "attention_bias", "rope_parameters", "rope_theta"):
        assert key in body, key
    assert body["model_type"] == "qwen3" and body["num_hidden_layers"] == 2
    assert body["vocab_size"] == target["vocab_size"]
    assert body["rope_parameters"] == {"rope_type": "default", "rope_theta": target["rope_parameters"]["rope_theta"]}


def test_reload_is_bit_exact_and_stores_no_target_tensors(saved, smollm2_drafter, smollm2):
    tensors = load_file(str(saved / "model.safetensors"))
    assert not any("embed" in n or "lm_head" in n or n.startswith("model.") for n in tensors)
    model = load_drafter(saved, target_config=smollm2[0].config)
    original = smollm2_drafter.state_dict()
    assert set(model.state_dict()) == set(original)
    for name, t in model.state_dict().items():
        assert torch.equal(t, original[name]), name


def test_bf16_is_the_default_on_disk(tmp_path, smollm2_drafter):
    out = save_drafter(smollm2_drafter, tmp_path / "bf16")
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_large_drafters_are_sharded_with_an_index(tmp_path, smollm2_drafter):
    out = save_drafter(smollm2_drafter, tmp_path / "sharded", dtype="float32", max_shard_bytes=4_000_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    reloaded = load_drafter(out)
    for name, t in reloaded.state_dict().items():
        assert torch.equal(t, smollm2_drafter.state_dict()[name])


def test_overwriting_is_atomic_and_leaves_no_temp_folders(tmp_path, smollm2_drafter):
    from dflash_train.errors import OutputError
    from dflash_train.outputs import MARKER

    out = save_drafter(smollm2_drafter, tmp_path / "d", dtype="float32")
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(OutputError, match="earlier dflash-toolkit output .*--overwrite"):
        save_drafter(smollm2_drafter, out, dtype="bfloat16")
    assert (out / "model.safetensors").read_bytes() == before
    save_drafter(smollm2_drafter, out, dtype="bfloat16", overwrite=True)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    assert (out / MARKER).is_file()


def test_speculators_frozen_copies_are_accepted_and_dropped(saved, smollm2_drafter):
    tensors = load_file(str(saved / "model.safetensors"))
    tensors["embed_tokens.weight"] = torch.zeros(49152, 576)
    tensors["lm_head.weight"] = torch.zeros(49152, 576)
    tensors["verifier_lm_head.weight"] = torch.zeros(4, 576)
    save_file(tensors, str(saved / "model.safetensors"))
    model = load_drafter(saved)
    assert model.lm_head is None
    assert torch.equal(model.fc.weight, smollm2_drafter.fc.weight)


def test_zlab_folders_load(saved, smollm2_drafter):
    from dflash_train.model.formats import zlab

    cfg = json.loads((saved / "config.json").read_text())
    from dflash_train.model.formats import speculators

    zcfg = zlab.to_config_dict(speculators.from_config_dict(cfg))
    (saved / "config.json").write_text(json.dumps(zcfg))
    assert zcfg["dflash_config"]["target_layer_ids"] == [1, 8, 14, 20, 27]
    model = load_drafter(saved)
    assert model.config.aux_hidden_state_layer_ids == [2, 9, 15, 21, 28]
    assert torch.equal(model.layers[1].mlp.up_proj.weight, smollm2_drafter.layers[1].mlp.up_proj.weight)


def _edit_config(folder, edit):
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(folder, edit):
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.mark.parametrize("broken,message", [
    (lambda d: _edit_config(d, lambda c: c.pop("aux_hidden_state_layer_ids")),
     "missing required field `aux_hidden_state_layer_ids`"),
    (lambda d: _edit_config(d, lambda c: c.pop("mask_token_id")), "missing required field `mask_token_id`"),
    (lambda d: _edit_config(d, lambda c: c["transformer_layer_config"].pop("hidden_size")),
     "missing required field `hidden_size`"),
    (lambda d: _edit_tensors(d, lambda t: t.pop("layers.1.mlp.gate_proj.weight")),
     "missing tensor `layers.1.mlp.gate_proj.weight`"),
    (lambda d: _edit_tensors(d, lambda t: t.__setitem__("mask_hidden", torch.zeros(3))), "unknown tensor `mask_hidden`"),
    (lambda d: _edit_tensors(d, lambda t: t.__setitem__("model.extra.weight", torch.zeros(3))),
     "unknown tensor `model.extra.weight`"),
    (lambda d: _edit_tensors(d, lambda t: t.__setitem__("fc.weight", torch.zeros(576, 576 * 4))),
     r"tensor `fc.weight` has shape \[576, 2304\] but the config implies \[576, 2880\]"),
    (lambda d: _edit_config(d, lambda c: c.__setitem__("mask_token_id", 49152)),
     "mask_token_id 49152 is outside the target vocab"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]),
     "model.safetensors: header promises .* the file is truncated"),
])
def test_loading_errors_name_the_field_or_tensor(saved, broken, message):
    broken(saved)
    with pytest.raises(CheckpointError, match=message):
        load_drafter(saved)


def test_layer_ids_outside_the_target_are_rejected(saved, smollm2):
    _edit_config(saved, lambda c: c.__setitem__("aux_hidden_state_layer_ids", [2, 9, 15, 21, 31]))
    with pytest.raises(DFlashError, match=r"aux_hidden_state_layer_ids \[2, 9, 15, 21, 31\] reach past the target's 30"):
        load_drafter(saved, target_config=smollm2[0].config)


def test_hidden_size_differing_from_the_target_is_rejected(saved, smollm2):
    _edit_config(saved, lambda c: c.__setitem__("target_hidden_size", 1024))
    with pytest.raises(CheckpointError, match="target_hidden_size 1024 differs from the target.s hidden_size 576"):
        load_drafter(saved, target_config=smollm2[0].config)


def test_drafter_module_tree_matches_checkpoint_names(tiny_config):
    # attribute names are the tensor names: a state dict round-trips with no renaming
    model = DFlashDraftModel(tiny_config)
    assert DFlashDraftModel(tiny_config).load_state_dict(model.state_dict(), strict=True)


def test_a_non_finite_drafter_is_never_written(tmp_path, tiny_config):
    model = DFlashDraftModel(tiny_config)
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight[3, 2] = float("inf")
    with pytest.raises(CheckpointError, match=r"tensor `layers.1.mlp.down_proj.weight` holds NaN or inf; refusing"):
        save_drafter(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # no folder, no temp folder


def test_a_nan_drafter_is_refused_on_load(saved):
    tensors = load_file(str(saved / "model.safetensors"))
    tensors["hidden_norm.weight"][5] = float("nan")
    save_file(tensors, str(saved / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"--draft {saved}: tensor `hidden_norm.weight` holds NaN or inf"):
        load_drafter(saved, what="--draft")


def test_a_drafters_own_mask_embedding_is_written_as_vllm_reads_it_and_reloads(tmp_path, smollm2_drafter, smollm2):
    """mask_embedding.pt beside the weights, read as vLLM 0.33's `_read_mask_embedding` reads it (torch.load with
    weights_only, a dict whose mask_token_id must equal the config's, `embedding` reshaped to one row); never a
    tensor in model.safetensors, whose loader fails on unknown names."""
    import io

    model = new_drafter_for_target(None, num_layers=1, block_size=4, num_features=5, seed=5)
    row = smollm2[0].get_input_embeddings().weight[16].detach().float()
    model.learn_mask_embedding(row + 0.25)
    out = save_drafter(model, tmp_path / "drafter")  # the config's dtype: bfloat16
    assert "mask_embedding" not in load_file(str(out / "model.safetensors"))
    state = torch.load(io.BytesIO((out / "mask_embedding.pt").read_bytes()), weights_only=True)
    cfg = json.loads((out / "config.json").read_text())
    assert set(state) == {"embedding", "mask_token_id"} and state["mask_token_id"] == cfg["mask_token_id"] == 16
    assert state["embedding"].dtype == torch.bfloat16 and state["embedding"].reshape(-1).shape == (576,)
    torch.testing.assert_close(state["embedding"].float(), row + 0.25, rtol=1e-2, atol=1e-2)
    again = load_drafter(out, target_config=smollm2[0].config)
    assert torch.equal(again.mask_embedding.detach(), state["embedding"].float())
    # a bare tensor (the other form vLLM takes) loads too; a drafter without the file has none
    torch.save(torch.ones(1, 576), out / "mask_embedding.pt")
    assert torch.equal(load_drafter(out).mask_embedding.detach(), torch.ones(576))
    assert load_drafter(save_drafter(smollm2_drafter, tmp_path / "plain")).mask_embedding is None
    assert not (tmp_path / "plain" / "mask_embedding.pt").exists()


def test_a_broken_mask_embedding_is_never_written_nor_loaded(tmp_path):
    model = new_drafter_for_target(None, num_layers=1, block_size=4, num_features=5, seed=5)
    model.learn_mask_embedding(torch.full((576,), float("nan")))
    with pytest.raises(CheckpointError, match="mask embedding holds NaN"):
        save_drafter(model, tmp_path / "nan")
    assert not (tmp_path / "nan").exists()
    model.learn_mask_embedding(torch.zeros(576))
    out = save_drafter(model, tmp_path / "drafter")
    torch.save({"embedding": torch.zeros(576), "mask_token_id": 3}, out / "mask_embedding.pt")
    with pytest.raises(CheckpointError, match="mask_token_id 3 != config `mask_token_id` 16"):
        load_drafter(out)
