"""`dflash-serve` on vLLM's real CPU build: the SmolLM2 target with a drafter saved by this toolkit.

Both launch paths are exercised through the installed command (a subprocess):
- auto: the speculators folder is the model; vLLM swaps in its verifier hub id, which is found in
  a private HF_HOME laid out as the hub cache (models--ORG--NAME/snapshots/HASH + refs/main);
- explicit: `--target <local SmolLM2 folder>`, the drafter inside --speculative-config.
Greedy speculative decoding is lossless, so the served text must equal the target's own greedy
text (transformers, float32), whatever the (random) drafter proposes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

PROMPT = "The capital of France is"
MAX_TOKENS = 24
# small and exact: float32, eager, a short context so a 256 MiB KV cache is enough
ENGINE_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "1024",
               "--kv-cache-memory-bytes", str(256 * 1024**2)]




@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    from dflash_train.model.checkpoint import save_drafter
    from dflash_train.model.init import new_drafter_for_target

    out = tmp_path_factory.mktemp("serve") / "drafter"
    save_drafter(new_drafter_for_target(None, num_layers=1, block_size=4), out)
    return out


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, smollm2_path):
    """A private HF_HOME where the embedded SmolLM2 sits as HuggingFaceTB/SmolLM2-135M-Instruct."""
    from dflash_train.target import DEFAULT_TARGET_NAME

    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / ("models--" + DEFAULT_TARGET_NAME.replace("/", "--"))
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in Path(smollm2_path).iterdir():
        (snapshot / f.name).symlink_to(f.resolve())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return home


@pytest.fixture(scope="module")
def greedy_text(smollm2):
    """The target's own greedy continuation (transformers, float32)."""
    import torch

    model, tokenizer = smollm2
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def stats_json(url: str) -> dict:
    from serve_shim.launch import dflash_serve_argv

    done = subprocess.run([*dflash_serve_argv(), "stats", url, "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("path", ["auto", "explicit"])
def test_serve_vllm_cpu(path, drafter, hf_home, smollm2_path, greedy_text, tmp_path, vllm_python):
    from serve_shim.launch import start_server

    python = vllm_python
    target = str(smollm2_path) if path == "explicit" else None
    started = time.monotonic()
    with start_server(drafter, target=target, python=python, served_model_name="smol", engine_args=ENGINE_ARGS,
                      env={"HF_HOME": str(hf_home)}, timeout=360, log_path=tmp_path / "server.log") as url:
        print(f"{path} path: server up in {time.monotonic() - started:.0f} s", file=sys.stderr)
        before = stats_json(url)
        assert before["engine"] == "vllm" and before["drafts"] == 0
        reply = post(url + "/v1/completions", {"model": "smol", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                               "temperature": 0})
        text = reply["choices"][0]["text"]
        assert text == greedy_text  # speculative decoding changed nothing
        after = stats_json(url)
    assert after["drafts"] > 0
    assert after["draft_tokens"] == 3 * after["drafts"]  # B-1 = 3 draft tokens per draft
    assert after["mean_acceptance_length"] == pytest.approx(1 + after["accepted_tokens"] / after["drafts"])
    assert len(after["per_position_acceptance_rate"]) == 3
    # one draft per decode step, and every step emits at least the target's own token
    assert after["drafts"] <= reply["usage"]["completion_tokens"]
