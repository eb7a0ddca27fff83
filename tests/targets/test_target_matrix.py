"""The target matrix: every architecture in the registry (dflash_train/architectures.py) as a
tiny random target (tests/tiny_targets.py) through the pipeline.

Fast tier, per architecture: features are the decoder layers' outputs (compared with plain forward hooks
written here), online features equal the offline cache, greedy speculative decoding is lossless against
plain decoding, and the default layer ids / drafter config build. Slow tier, per architecture: prepare
with the chat template, train a few steps on online features at explicit ids, eval, convert to both
formats, validate (with the engines' serve support) and `dflash-serve --dry-run`, all in-process (the
installed commands are covered on SmolLM2 by tests/e2e).
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_targets import CONFIGS

from dflash_train.architectures import ARCHITECTURES

ARCHS = sorted(ARCHITECTURES)
CHATS = [[{"role": "user", "content": f"What is {i} plus {i + 3}?"},
          {"role": "assistant", "content": f"{i} plus {i + 3} is {2 * i + 3}, an {'even' if i % 2 else 'odd'} number."}]
         for i in range(12)]


def test_the_matrix_covers_the_registry():
    assert set(CONFIGS) == set(ARCHITECTURES)


def _load(folder):
    from dflash_train.target import load_target

    return load_target(str(folder), dtype=torch.float32)


def _hooked_layer_outputs(model, ids, layer_ids):
    """Independent reference: forward hooks on model.model.layers[t], a full forward, nothing else."""
    seen = {}
    handles = [model.model.layers[t].register_forward_hook(
        lambda _m, _i, out, t=t: seen.__setitem__(t, out[0] if isinstance(out, tuple) else out)) for t in layer_ids]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in handles:
            h.remove()
    return torch.cat([seen[t] for t in layer_ids], dim=-1)


@pytest.mark.parametrize("model_type", ARCHS)
def test_features_are_decoder_layer_outputs_and_online_equals_offline(model_type, tiny_target, tmp_path):
    from dflash_train.data.prepare import write_prepared
    from dflash_train.features.cache import FeatureCache, write_feature_cache
    from dflash_train.features.extract import TargetFeatures
    from dflash_train.features.online import OnlineFeatures

    folder = tiny_target(model_type)
    model, tok = _load(folder)
    n = model.config.get_text_config().num_hidden_layers
    layer_ids = [0, n // 2, n - 1]  # the last layer too: its output before the final norm
    ids = torch.randint(5, 4000, (1, 24), generator=torch.Generator().manual_seed(1))
    ref = _hooked_layer_outputs(model, ids, layer_ids)
    for got in (TargetFeatures(model, layer_ids)(ids).features,
                TargetFeatures(model, layer_ids)(ids, with_next_tokens=True, topk=4).features):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    # the features' last slice is not HF's post-norm hidden state
    post = model(input_ids=ids, output_hidden_states=True).hidden_states[n]
    assert not torch.allclose(ref[..., -post.shape[-1]:], post, atol=1e-3)

    write_prepared(CHATS[:4], tok, tmp_path / "rows", {"command": "test"}, max_length=128)
    cache = write_feature_cache(str(folder), tmp_path / "rows", tmp_path / "cache", target_layer_ids=layer_ids)
    offline = FeatureCache(cache)
    assert offline.manifest["target_layer_ids"] == layer_ids
    online = OnlineFeatures(model, layer_ids, storage_dtype=torch.bfloat16)
    for i in range(2):
        doc = offline.document(i)
        mine = online.document(doc.input_ids, doc.loss_mask)
        torch.testing.assert_close(doc.features.float(), mine.features.float(), rtol=0, atol=1e-2)
        assert torch.equal(doc.greedy_next, mine.greedy_next)


@pytest.mark.parametrize("model_type", ARCHS)
def test_greedy_spec_decoding_is_lossless(model_type, tiny_target, one_thread):
    from dflash_train.eval.spec_decode import plain_generate, speculative_generate
    from dflash_train.features.mask_token import default_mask_token_id
    from dflash_train.model.config import DFlashConfig
    from dflash_train.model.modeling_dflash import DFlashDraftModel

    model, tok = _load(tiny_target(model_type))
    n = model.config.get_text_config().num_hidden_layers
    cfg = DFlashConfig.for_target(model.config, block_size=4, target_layer_ids=[1, n - 2],
                                  mask_token_id=default_mask_token_id(tok, model.config.get_text_config().vocab_size),
                                  dtype="float32")
    draft = DFlashDraftModel(cfg).eval()
    draft.init_weights(seed=0)
    draft.attach_target(model)
    prompt = torch.randint(5, 4000, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    plain = plain_generate(model, prompt, 24)
    spec = speculative_generate(draft, model, prompt, 24)  # a random drafter: every block rejected
    assert spec.tokens == plain.tokens

    # an oracle for the first m slots (m = 0, 1, 2, 3 in turn), wrong after: every accepted length, every rollback
    truth = {len(prompt) + j: t for j, t in enumerate(plain.tokens)}
    where, steps = {}, iter(range(1000))
    forward_block = draft.forward_block

    def remember_position(embeds, start, ctx):
        where["p"] = int(start[0])
        return forward_block(embeds, start, ctx)

    def oracle_logits(hidden):
        m = next(steps) % 4
        logits = torch.zeros(hidden.shape[0], cfg.vocab_size)
        for k in range(hidden.shape[0]):
            right = truth.get(where["p"] + k + 1, 7)
            logits[k, right if k < m else (right + 1) % cfg.vocab_size] = 1.0
        return logits

    draft.forward_block, draft.logits = remember_position, oracle_logits
    spec = speculative_generate(draft, model, prompt, 24)
    assert spec.tokens == plain.tokens
    assert {s.accepted for s in spec.steps} >= {0, 1, 2}  # partial accepts happened, each rolled back


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ARCHS)
def test_whole_pipeline(model_type, tiny_target, tmp_path, one_thread):
    from typer.testing import CliRunner

    from convert.convert import convert_checkpoint
    from convert.validate import validate_folder
    from dflash_train.data.prepare import prepare_dataset
    from dflash_train.eval.spec_decode import evaluate
    from dflash_train.model.checkpoint import load_drafter
    from dflash_train.model.checks import PASS, SKIP, WARN
    from dflash_train.train.loop import train
    from dflash_train.train.recipe import load_recipe
    from serve_shim.cli import app as serve_app

    target = str(tiny_target(model_type))
    raw = json.loads((tiny_target(model_type) / "config.json").read_text())
    layers = raw["num_hidden_layers"]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    summary = prepare_dataset(target, str(data), tmp_path / "rows", max_length=128)
    assert summary["rows"] == len(CHATS)

    ids = [1, layers - 2]
    recipe = load_recipe(None, base={
        "target": target, "data": {"prepared": str(tmp_path / "rows"), "features": "online", "holdout_fraction": 0.25},
        "drafter": {"num_layers": 1, "block_size": 4, "target_layer_ids": ids, "dtype": "float32"},
        "objective": {"anchors_per_document": 8, "logits_chunk": 64}, "optim": {"lr": 1e-3, "max_steps": 3},
        "batch": {"tokens_per_microbatch": 256}, "checkpoint": {"save_every": 3, "keep_last": 1},
        "logging": {"log_every": 1, "eval_every": 3, "progress": False}})
    result = train(recipe, tmp_path / "run")
    assert result["steps"] == 3 and torch.isfinite(torch.tensor(result["train_loss"]))

    model, tok = _load(target)
    draft = load_drafter(tmp_path / "run" / "final", target_config=model.config, tokenizer=tok)
    assert draft.config.target_layer_ids == ids
    if model_type.startswith("qwen"):  # the Qwen tokenizer asset: the first spare row of 151,936
        assert draft.config.vocab_size == 151936 and draft.config.mask_token_id == 151665
    if model_type == "gpt_oss":  # the yarn rope with every parameter (issue 24's KeyError)
        assert draft.config.rope_parameters["rope_type"] == "yarn" and draft.config.rope_parameters["factor"] == 32.0
    report = evaluate(draft, model, tok, [c[:1] for c in CHATS[:2]], max_new_tokens=12, measure_speedup=False,
                      teacher_forced=False)
    assert report["lossless"] is True

    arch = ARCHITECTURES[model_type]
    for fmt in ("speculators", "zlab"):
        out = tmp_path / fmt
        convert_checkpoint(tmp_path / "run" / "final", out, fmt, verifier=target)
        checks = {c.check: c for c in validate_folder(out, target, use_target=True).checks}
        assert all(c.status != "fail" for c in checks.values()), checks
        assert checks["vllm_serves_target"].status == (PASS if arch.vllm else WARN)
        assert checks["sglang_serves_target"].status == {True: PASS, False: WARN, None: SKIP}[arch.sglang]
        res = CliRunner().invoke(serve_app, ["serve", str(out), "--target", target, "--dry-run"])
        assert res.exit_code == 0, res.output
        assert "dflash" in res.output and target in res.output


@pytest.mark.slow
def test_reduced_draft_vocabulary_at_qwen_size(tiny_target, tmp_path, one_thread):
    """The Qwen rows' 151,936-row vocabulary reduced to 1,024 draft ids: trained, lossless, served by vLLM's format."""
    from convert.convert import convert_checkpoint
    from convert.validate import validate_folder
    from dflash_train.data.prepare import write_prepared
    from dflash_train.eval.spec_decode import evaluate
    from dflash_train.model.checkpoint import load_drafter
    from dflash_train.train.loop import train
    from dflash_train.train.recipe import load_recipe

    target = str(tiny_target("qwen3"))
    model, tok = _load(target)
    write_prepared(CHATS, tok, tmp_path / "rows", {"command": "test"}, max_length=128)
    recipe = load_recipe(None, base={
        "target": target, "data": {"prepared": str(tmp_path / "rows"), "features": "online", "holdout_fraction": 0.25},
        "drafter": {"num_layers": 1, "block_size": 4, "target_layer_ids": [1, 2], "draft_vocab_size": 1024,
                    "dtype": "float32"},
        "objective": {"anchors_per_document": 8, "logits_chunk": 64}, "optim": {"lr": 1e-3, "max_steps": 2},
        "batch": {"tokens_per_microbatch": 256}, "checkpoint": {"save_every": 2, "keep_last": 1},
        "logging": {"log_every": 1, "eval_every": 2, "progress": False}})
    train(recipe, tmp_path / "run")
    draft = load_drafter(tmp_path / "run" / "final", target_config=model.config, tokenizer=tok)
    assert (draft.config.vocab_size, draft.config.draft_vocab_size) == (151936, 1024)
    assert draft.t2d.shape == (151936,) and int(draft.t2d.sum()) == 1024
    kept = (torch.arange(1024) + draft.d2t).tolist()
    assert kept == sorted(kept) and kept[-1] < 151665  # draft ids are real tokens, never the spare rows
    report = evaluate(draft, model, tok, [c[:1] for c in CHATS[:2]], max_new_tokens=12, measure_speedup=False,
                      teacher_forced=False)
    assert report["lossless"] is True
    convert_checkpoint(tmp_path / "run" / "final", tmp_path / "spec", "speculators", verifier=target)
    checks = {c.check: c.status for c in validate_folder(tmp_path / "spec", target, use_target=True).checks}
    assert "fail" not in checks.values() and checks["vocab_maps"] == "pass"
