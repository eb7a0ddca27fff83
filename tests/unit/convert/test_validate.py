"""validate: accepts everything the toolkit writes; each broken variant fails with a named reason."""

from __future__ import annotations

import json

import pytest
import torch
from convert_fixtures import edit_tensors, read_config, tiny_cfg, write_config, write_drafter

from convert.convert import convert_checkpoint
from convert.rules import RULES
from convert.validate import validate_folder
from dflash_train.model import formats


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """One folder per way the toolkit writes drafters."""
    root = tmp_path_factory.mktemp("good")
    write_drafter(root / "saved")
    write_drafter(root / "saved-sharded", max_shard_bytes=30_000)
    write_drafter(root / "reduced", tiny_cfg(draft_vocab_size=33))
    for name in formats.FORMATS:
        convert_checkpoint(root / "saved", root / f"conv-{name}", name)
        convert_checkpoint(root / "saved", root / f"conv-{name}-sharded", name, max_shard_bytes=30_000)
    return root


def test_every_toolkit_folder_passes(good):
    folders = sorted(p for p in good.iterdir() if p.is_dir())
    assert len(folders) >= 7
    for folder in folders:
        report = validate_folder(folder)
        assert report.ok, (folder.name, [(c.check, c.reason) for c in report.failures()])
        names = {c.check for c in report.checks}
        assert {r.__name__ for r in RULES[report.format]} <= names
        assert {"finite_weights", "tensor_shapes", "tensor_names", "weights_readable"} <= names


def _cfg(fn):
    def mutate(folder):
        d = read_config(folder)
        fn(d)
        write_config(folder, d)
    return mutate


def _tens(fn):
    return lambda folder: edit_tensors(folder, fn)


def _nan(t):
    t = dict(t)
    w = t["layers.0.mlp.up_proj.weight"].clone()
    w[0, 0] = float("nan")
    t["layers.0.mlp.up_proj.weight"] = w
    return t


def _truncate(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _drop_shard(folder):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (folder / shard).unlink()


def _index_lies(folder):
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"]["norm.weight"] = files[0] if index["weight_map"]["norm.weight"] != files[0] else files[1]
    path.write_text(json.dumps(index))


def _bad_d2t(t):
    t = dict(t)
    t["d2t"] = t["d2t"].clone()
    t["d2t"][3] += 1
    return t


def _mask_embedding(folder):
    torch.save(torch.zeros(10), folder / "mask_embedding.pt")


def _spec_cfg(key, value):
    def fn(d):
        if value is DEL:
            del d[key]
        else:
            d[key] = value
    return fn


DEL = object()
S, Z = "conv-speculators", "conv-zlab"
# (variant, folder, mutation, check that must fail, text the reason must contain)
VARIANTS = [
    ("spec-model-type", S, _cfg(_spec_cfg("model_type", "qwen3")), "spec_model_type", "model_type"),
    ("not-a-drafter", S, _cfg(lambda d: d.pop("speculators_config")), "config_json", "speculators_config"),
    ("spec-speculators-model-type", S, _cfg(_spec_cfg("speculators_model_type", "eagle3")),
     "spec_speculators_model_type", "speculators_model_type"),
    ("spec-architectures", S, _cfg(_spec_cfg("architectures", ["Eagle3Speculator"])), "spec_architectures",
     "architectures"),
    ("spec-algorithm", S, _cfg(lambda d: d["speculators_config"].update(algorithm="eagle3")), "spec_algorithm",
     "speculators_config.algorithm"),
    ("spec-speculative-tokens", S, _cfg(lambda d: d["speculators_config"]["proposal_methods"][0].update(
        speculative_tokens=8)), "spec_speculative_tokens", "speculative_tokens"),
    ("spec-verifier", S, _cfg(lambda d: d["speculators_config"]["verifier"].pop("name_or_path")), "spec_verifier",
     "verifier.name_or_path"),
    ("spec-body-head-dim", S, _cfg(lambda d: d["transformer_layer_config"].pop("head_dim")), "spec_body_complete",
     "transformer_layer_config.head_dim"),
    ("spec-rope", S, _cfg(lambda d: d["transformer_layer_config"].pop("rope_parameters")), "spec_rope",
     "rope_parameters"),
    ("spec-draft-vocab", S, _cfg(_spec_cfg("draft_vocab_size", 500)), "spec_vocab", "draft_vocab_size"),
    ("spec-target-hidden", S, _cfg(_spec_cfg("target_hidden_size", DEL)), "spec_target_hidden_size",
     "target_hidden_size"),
    ("spec-aux-missing", S, _cfg(_spec_cfg("aux_hidden_state_layer_ids", DEL)), "spec_aux_ids",
     "aux_hidden_state_layer_ids"),
    ("spec-aux-zero", S, _cfg(_spec_cfg("aux_hidden_state_layer_ids", [0, 4, 6])), "spec_aux_ids",
     "aux_hidden_state_layer_ids"),
    ("spec-aux-past-target", S, _cfg(_spec_cfg("aux_hidden_state_layer_ids", [2, 4, 9])), "spec_aux_ids",
     "num_target_layers"),
    ("spec-mask", S, _cfg(_spec_cfg("mask_token_id", DEL)), "spec_mask_token_id", "mask_token_id"),
    ("spec-mask-range", S, _cfg(_spec_cfg("mask_token_id", 101)), "spec_mask_token_id", "mask_token_id"),
    ("spec-causal", S, _cfg(_spec_cfg("sliding_window_non_causal", False)), "spec_non_causal",
     "sliding_window_non_causal"),
    ("spec-anchor", S, _cfg(_spec_cfg("sample_from_anchor", True)), "spec_sample_from_anchor", "sample_from_anchor"),
    ("spec-tie", S, _cfg(_spec_cfg("tie_word_embeddings", True)), "spec_tie_word_embeddings", "tie_word_embeddings"),
    ("verifier-tensor", S, _tens(lambda t: {**t, "verifier_lm_head.weight": torch.ones(101, 64)}), "tensor_names",
     "verifier_lm_head.weight"),
    ("model-prefix", S, _tens(lambda t: {("model." + k if k == "fc.weight" else k): v for k, v in t.items()}),
     "tensor_names", "model.fc.weight"),
    ("d2t-full-vocab", S, _tens(lambda t: {**t, "d2t": torch.zeros(101, dtype=torch.int64)}), "tensor_names", "`d2t`"),
    ("missing-tensor", S, _tens(lambda t: {k: v for k, v in t.items() if k != "norm.weight"}), "tensors_present",
     "norm.weight"),
    ("wrong-shape", S, _tens(lambda t: {**t, "fc.weight": torch.zeros(64, 128, dtype=torch.bfloat16)}),
     "tensor_shapes", "fc.weight"),
    ("nan", S, _tens(_nan), "finite_weights", "layers.0.mlp.up_proj.weight"),
    ("truncated", S, _truncate, "weights_readable", "truncated"),
    ("missing-shard", "conv-speculators-sharded", _drop_shard, "weights_readable", "missing"),
    ("index-lies", "saved-sharded", _index_lies, "weights_readable", "norm.weight"),
    ("vocab-maps", "reduced", _tens(_bad_d2t), "vocab_maps", "d2t"),
    ("mask-embedding", S, _mask_embedding, "mask_embedding", "mask_embedding.pt"),
    ("zlab-model-type", Z, _cfg(_spec_cfg("model_type", "llama")), "zlab_model_type", "model_type"),
    ("zlab-architectures", Z, _cfg(_spec_cfg("architectures", ["Qwen3ForCausalLM"])), "zlab_architectures",
     "architectures"),
    ("zlab-body-rope", Z, _cfg(_spec_cfg("rope_theta", DEL)), "zlab_body_complete", "rope_theta"),
    ("zlab-block-size", Z, _cfg(lambda d: d["dflash_config"].update(block_size=16)), "zlab_block_size", "block_size"),
    ("zlab-layer-ids", Z, _cfg(lambda d: d["dflash_config"].pop("target_layer_ids")), "zlab_target_layer_ids",
     "target_layer_ids"),
    ("zlab-layer-ids-range", Z, _cfg(lambda d: d["dflash_config"].update(target_layer_ids=[1, 3, 8])),
     "zlab_target_layer_ids", "num_target_layers"),
    ("zlab-mask", Z, _cfg(lambda d: d["dflash_config"].pop("mask_token_id")), "zlab_mask", "mask_token_id"),
    ("zlab-hidden", Z, _cfg(_spec_cfg("target_hidden_size", 32)), "zlab_hidden_matches_target", "target_hidden_size"),
    ("zlab-reduced-head", Z, _tens(lambda t: {**t, "lm_head.weight": torch.zeros(33, 64, dtype=torch.bfloat16)}),
     "sglang_full_vocab", "lm_head.weight"),
]


@pytest.mark.parametrize(("folder", "mutate", "check", "text"), [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_broken_variant_fails_with_named_reason(good, tmp_path, folder, mutate, check, text):
    import shutil

    target = tmp_path / folder
    shutil.copytree(good / folder, target)
    mutate(target)
    report = validate_folder(target)
    assert not report.ok
    failed = {c.check: c.reason for c in report.failures()}
    assert check in failed, failed
    assert text in failed[check]


def test_every_rule_has_a_broken_variant():
    covered = {v[3] for v in VARIANTS}
    assert {r.__name__ for rules in RULES.values() for r in rules} - covered <= {"zlab_num_target_layers"}


# ------------------------------------------------------------------------------------------
# check_drafter: the structural checks every loader runs
def _drafter(tmp_path, name="d", **kw):
    return write_drafter(tmp_path / name, tiny_cfg(**kw))


def _target_config(**kw):
    from transformers import Qwen3Config

    base = dict(hidden_size=64, num_hidden_layers=8, vocab_size=101, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=96)
    return Qwen3Config(**{**base, **kw})


@pytest.mark.parametrize("mutate, message", [
    (_tens(_nan), r"tensor `layers.0.mlp.up_proj.weight` holds NaN or inf"),
    (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:4000]),
     r"model.safetensors: header promises \d+ bytes but the file has 4000; the file is truncated"),
    (_tens(lambda t: {**t, "norm.weight": torch.ones(7)}), r"tensor `norm.weight` has shape \[7\] but the config implies \[64\]"),
    (_tens(lambda t: {k: v for k, v in t.items() if k != "norm.weight"}), "missing tensor `norm.weight`"),
    (_tens(lambda t: {**t, "layers.9.extra": torch.ones(2)}), "unknown tensor `layers.9.extra`"),
])
def test_check_drafter_refuses_with_one_named_reason(tmp_path, mutate, message):
    from dflash_train.errors import CheckpointError
    from dflash_train.model.checks import check_drafter

    folder = _drafter(tmp_path)
    mutate(folder)
    with pytest.raises(CheckpointError, match=message) as info:
        check_drafter(folder, tiny_cfg(), what="--draft")
    text = str(info.value)
    assert text.startswith(f"--draft {folder}: ") and "\n" not in text
    assert f"dflash-convert validate {folder}" in text


def test_check_drafter_accepts_what_loaders_drop(tmp_path):
    """`model.` prefixes and frozen copies other writers store are a loader's business, not a failure."""
    from dflash_train.model.checks import check_drafter

    folder = _drafter(tmp_path)
    edit_tensors(folder, lambda t: {**{f"model.{k}": v for k, v in t.items()},
                                    "embed_tokens.weight": torch.zeros(101, 64), "verifier_lm_head.weight": torch.ones(3)})
    report = check_drafter(folder, tiny_cfg())
    assert report.ok and {"tensor_shapes", "finite_weights"} <= {c.check for c in report.checks}
    assert validate_folder(folder).ok is False  # vLLM itself would refuse the prefix: validate says so


def test_check_drafter_against_a_loaded_target(tmp_path):
    from dflash_train.errors import CheckpointError
    from dflash_train.model.checks import check_drafter

    folder = _drafter(tmp_path)
    assert check_drafter(folder, tiny_cfg(), target_config=_target_config()).ok
    with pytest.raises(CheckpointError, match="target_hidden_size 64 differs from the target's hidden_size 128"):
        check_drafter(folder, tiny_cfg(), target_config=_target_config(hidden_size=128, head_dim=32))
    with pytest.raises(CheckpointError, match=r"do not fit the target's 4 layers .*and 1 more failed"):
        check_drafter(folder, tiny_cfg(), target_config=_target_config(num_hidden_layers=4, vocab_size=202))


def test_check_drafter_mask_id_must_be_spare_in_the_target(tmp_path, smollm2_path, smollm2):
    """Against the real SmolLM2 target: id 16 is an unused special token, id 1 is what the template emits."""
    from convert_fixtures import smollm2_cfg

    from dflash_train.errors import CheckpointError
    from dflash_train.model.checks import check_drafter

    model, tokenizer = smollm2
    folder = write_drafter(tmp_path / "s", smollm2_cfg())
    check_drafter(folder, smollm2_cfg(), target_config=model.config, tokenizer=tokenizer)
    with pytest.raises(CheckpointError, match=r"mask_token_id: 1 .*emitted by the chat template"):
        check_drafter(folder, smollm2_cfg(mask_token_id=1), target_config=model.config, tokenizer=tokenizer)
    # a target named by folder is read from disk, without any network
    with pytest.raises(CheckpointError, match="mask_token_id: 1 "):
        check_drafter(folder, smollm2_cfg(mask_token_id=1), target=str(smollm2_path))


def test_find_local_target_never_uses_the_network(tmp_path, smollm2_path, monkeypatch):
    from dflash_train.model.checks import find_local_target

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert find_local_target(str(smollm2_path)) == str(smollm2_path)
    assert find_local_target("HuggingFaceTB/SmolLM2-135M-Instruct") == str(smollm2_path)  # the cached conversion
    assert find_local_target("org/not-in-any-cache") is None
    assert find_local_target(str(tmp_path)) is None and find_local_target(None) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_all_finite_finds_every_nan_and_inf(dtype):
    from dflash_train.model.checks import all_finite

    t = torch.randn(1031, 17).to(dtype)  # odd sizes: vectorised bodies and scalar tails
    assert all_finite(t) and all_finite(t[:0]) and all_finite(torch.zeros((), dtype=dtype))
    assert all_finite(torch.full((5,), torch.finfo(dtype).max, dtype=dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for index in (0, 7, t.numel() - 1, t.numel() // 2):
            u = t.clone().view(-1)
            u[index] = bad
            assert not all_finite(u.view_as(t)), (bad, index)
    assert all_finite(torch.tensor([1, 2], dtype=torch.int64)) and all_finite(torch.tensor([True]))


def test_a_zlab_copy_of_a_trained_mask_embedding_warns_that_sglang_ignores_it(good, tmp_path):
    """SGLang borrows the target's mask row and never reads mask_embedding.pt: to-zlab says so as it copies the
    file, and validate warns on the z-lab folder (it still loads there); the speculators folder, which vLLM serves
    with the file, gets no warning."""
    from dflash_train.model.weights import SGLANG_MASK_NOTE

    src = write_drafter(tmp_path / "src")
    torch.save({"embedding": torch.ones(64), "mask_token_id": 100}, src / "mask_embedding.pt")
    zlab = convert_checkpoint(src, tmp_path / "zlab", "zlab")
    spec = convert_checkpoint(src, tmp_path / "spec", "speculators")
    assert SGLANG_MASK_NOTE in zlab.notes and "mask_embedding.pt" in zlab.files
    assert SGLANG_MASK_NOTE not in spec.notes and "mask_embedding.pt" in spec.files
    reports = {name: validate_folder(tmp_path / name) for name in ("zlab", "spec", "src")}
    assert all(r.ok for r in reports.values()), {n: r.failures() for n, r in reports.items()}
    warned = {n: {c.check: c.reason for c in r.checks if c.status == "warn"} for n, r in reports.items()}
    assert "SGLang" in warned["zlab"]["sglang_mask_embedding"] and "vLLM reads it" in warned["zlab"]["sglang_mask_embedding"]
    assert "sglang_mask_embedding" not in warned["spec"] and "sglang_mask_embedding" not in warned["src"]
    plain = validate_folder(good / "conv-zlab")
    assert "sglang_mask_embedding" not in {c.check for c in plain.checks if c.status == "warn"}
