"""push-to-hub against a local HTTP hub (http.server in a thread), through huggingface_hub."""

from __future__ import annotations

import json

import pytest
from convert_fixtures import edit_tensors, write_drafter
from hub_server import LocalHub

from convert.hub import plan_push, push
from dflash_train.errors import CheckpointError, ConfigError

TOKEN = "hf_unit_secret_4f1c9a"


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "run"
    write_drafter(run / "final", max_shard_bytes=30_000)
    (run / "summary.json").write_text(json.dumps({"data": "sharegpt+chitchat regenerated", "target": "org/tiny-target",
                                                  "eval": {"tau": 3.21}, "val_acceptance_length": 2.95}))
    (run / "final" / "optimizer.pt").write_bytes(b"not for upload")
    (run / "final" / "notes.txt").write_text("scratch")
    return run


def test_plan_lists_only_checkpoint_files_and_card_has_the_facts(run):
    plan = plan_push(run / "final", "org/tiny-dflash")
    weights = sorted(p.name for p in (run / "final").glob("*.safetensors"))
    assert plan.files == sorted(["README.md", "config.json", "model.safetensors.index.json", *weights])
    card = plan.card
    for text in ("base_model: org/tiny-target", "block size | 8 (7 speculative tokens)", "[1, 3, 5]", "[2, 4, 6]",
                 "vllm serve org/tiny-dflash", "\"num_speculative_tokens\": 7", "--speculative-algorithm DFLASH",
                 "--speculative-num-draft-tokens 8", "sharegpt+chitchat regenerated", "3.21", "2.95"):
        assert text in card, text


def test_push_uploads_exactly_the_planned_files(run, monkeypatch, capsys):
    monkeypatch.setenv("MY_HUB_TOKEN", TOKEN)
    plan = plan_push(run / "final", "org/tiny-dflash", revision="v1", private=True)
    with LocalHub() as hub:
        url = push(plan, token_env="MY_HUB_TOKEN", endpoint=hub.url)
    rec = hub.rec
    assert sorted(rec.committed) == plan.files
    for name in plan.files:
        expected = plan.card.encode() if name == "README.md" else (run / "final" / name).read_bytes()
        assert rec.committed[name] == expected, name
    assert rec.created[0].get("visibility") == "private" or rec.created[0].get("private") is True
    assert rec.branches == ["v1"] and rec.commit_revisions == ["v1"]
    auth = {r["headers"].get("authorization") or r["headers"].get("Authorization") for r in rec.requests}
    assert auth == {f"Bearer {TOKEN}"}
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err + url


def test_push_refuses_an_invalid_folder(run):
    edit_tensors_target = run / "bad"
    write_drafter(edit_tensors_target)
    edit_tensors(edit_tensors_target, lambda t: {**t, "verifier_norm.weight": t["norm.weight"].clone()})
    with pytest.raises(CheckpointError, match="verifier_norm.weight"):
        plan_push(edit_tensors_target, "org/x")
    with pytest.raises(ConfigError, match="REPO_ID"):
        plan_push(run / "final", "no-org")


def test_missing_token_is_an_error_without_leaking(run, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_TOKEN_PATH", str(tmp_path / "empty-hf-home" / "token"))
    monkeypatch.setattr(c, "HF_STORED_TOKENS_PATH", str(tmp_path / "empty-hf-home" / "stored_tokens"))
    plan = plan_push(run / "final", "org/tiny-dflash")
    with pytest.raises(ConfigError, match=r"\$HF_TOKEN"):
        push(plan, endpoint="http://127.0.0.1:9")


@pytest.mark.parametrize("value", [TOKEN, "hf_" + "a1B2" * 9, "hf_Ab12", "hf_x9", "my token", "$HF_TOKEN", "HF-TOKEN"])
def test_a_token_given_as_the_variable_name_is_refused_unseen(run, value):
    from convert.hub import check_token_env

    with pytest.raises(ConfigError) as info:
        check_token_env(value)
    assert "--token-env takes the NAME" in str(info.value) and value not in str(info.value)
    with pytest.raises(ConfigError) as info:
        push(plan_push(run / "final", "org/tiny-dflash"), token_env=value, endpoint="http://127.0.0.1:9")
    assert value not in str(info.value)
    for name in ("HF_TOKEN", "MY_HUB_TOKEN", "hf_token", "_X1"):
        check_token_env(name)


def test_an_unreachable_hub_is_one_error_without_the_token(run, monkeypatch):
    from convert.hub import HubError

    monkeypatch.setenv("MY_HUB_TOKEN", TOKEN)
    plan = plan_push(run / "final", "org/tiny-dflash")
    with pytest.raises(HubError, match=r"cannot reach the hub at http://127.0.0.1:9 \(ConnectError") as info:
        push(plan, token_env="MY_HUB_TOKEN", endpoint="http://127.0.0.1:9")
    assert TOKEN not in str(info.value) and "\n" not in str(info.value)
