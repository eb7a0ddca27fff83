"""`dflash-train target-info` and the refusal of architectures the toolkit does not support,
through the installed command (exit 2, one `error:` line, nothing written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _run(*args, cwd=None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([str(BIN / "dflash-train"), *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=cwd)


@pytest.fixture(scope="module")
def gpt2_target(tmp_path_factory, smollm2_path):
    """A tiny GPT-2: a causal LM transformers knows, whose layers the toolkit has never been checked on."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=49152, n_embd=32, n_layer=2, n_head=2, n_positions=256)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(smollm2_path)).save_pretrained(folder)
    return folder


def test_unsupported_architecture_is_refused_before_any_data_work(gpt2_target, tmp_path):
    from dflash_train.architectures import ARCHITECTURES

    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    for args in (["prepare", "--data", data, "--output", tmp_path / "rows", "--target", gpt2_target],
                 ["target-info", "--target", gpt2_target]):
        proc = _run(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, proc.stderr[-2000:]
        assert "architecture 'gpt2'" in errors[0] and ", ".join(sorted(ARCHITECTURES)) in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_target_info_says_what_a_user_needs(tiny_target):
    proc = _run("target-info", "--target", tiny_target("qwen3_moe"), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout)
    assert info["architecture"] == "qwen3_moe" and info["num_hidden_layers"] == 4
    # 4 layers cannot give 5 distinct features: it says so and proposes fewer
    assert info["target_layer_ids"] == [2] and "use num_features 1" in info["note"]
    assert info["aux_hidden_state_layer_ids"] == [3]
    assert info["vllm_serves_dflash"] is True and info["sglang_serves_dflash"] is True
    assert info["mask_token_id"] == 151665  # the Qwen tokenizer's first spare embedding row


def test_target_info_on_a_model_vllm_does_not_serve(tiny_target):
    from dflash_train.features.target_info import describe_target

    info = describe_target(str(tiny_target("gemma3_text")), num_features=3)
    assert info["num_hidden_layers"] == 6 and info["target_layer_ids"] == [1, 2, 3] and "note" not in info
    assert info["vllm_serves_dflash"] is False and "vLLM serves DFlash: no" in info["serve"]
    assert info["layer_types"] == ["full_attention", "sliding_attention"]


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "gpt_oss", "deepseek_v3", "gemma3_text"])
def test_existing_errors_hold_on_the_new_architectures(model_type, tiny_target):
    from dflash_train.errors import ConfigError
    from dflash_train.features.online import OnlineFeatures
    from dflash_train.model.init import drafter_config_for_target
    from dflash_train.target import load_target

    folder = str(tiny_target(model_type))
    model, tok = load_target(folder)
    n = model.config.get_text_config().num_hidden_layers
    with pytest.raises(ConfigError, match=f"layer id {n} is outside the target's layers 0..{n - 1}"):
        OnlineFeatures(model, [1, n])  # linear-attention and sliding layers count as layers, no more
    with pytest.raises(ConfigError, match=f"reach past the target's {n} layers"):
        drafter_config_for_target(folder, target_layer_ids=[1, n], block_size=4)
    text_token = tok("hello", add_special_tokens=False)["input_ids"][0]
    with pytest.raises(ConfigError, match="ordinary token the tokenizer uses for real text"):
        drafter_config_for_target(folder, target_layer_ids=[1], mask_token_id=text_token, block_size=4)
