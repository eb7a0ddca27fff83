"""vLLM's CPU build serves a toolkit drafter for a new architecture: a tiny random Qwen3-MoE target.

The drafter (random, 1 layer, B=4) is served through vLLM's explicit DFlash path in-process; its greedy
tokens must equal the target's own, and vLLM's spec-decode counters must equal the steps and accepted drafts
our eval loop counts with the same drafter. (A random drafter accepts little, so this checks that vLLM runs
the architecture with our drafter and counts as we do; test_serve_agreement.py checks acceptance itself on
a trained SmolLM2 drafter.) Measured on this machine's vLLM 0.32 CPU build: gpt-oss decodes only zeros
even without a drafter, Qwen3.5 needs torchvision, MiniMax-M2 wants a config field transformers 5 drops.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

SCRIPT = """
import json, os, sys
from vllm import LLM, SamplingParams
target, draft, prompt, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=256, disable_log_stats=False,
          kv_cache_memory_bytes=64 * 1024**2, distributed_executor_backend="uni",
          speculative_config={"method": "dflash", "model": draft, "num_speculative_tokens": 3})
out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "spec_decode" in m.name}
print("RESULT " + json.dumps({"tokens": list(out[0].outputs[0].token_ids), "metrics": metrics}))
"""


def test_vllm_cpu_serves_a_qwen3_moe_target_with_our_drafter(tmp_path, smollm2_path, vllm_python):
    import torch
    from tiny_targets import make_tiny_target

    from dflash_train.eval.spec_decode import plain_generate, speculative_generate
    from dflash_train.model.checkpoint import load_drafter, save_drafter
    from dflash_train.model.init import new_drafter_for_target
    from dflash_train.target import load_target

    target = make_tiny_target("qwen3_moe", tmp_path / "target", smollm2_path, head_dim=64)
    save_drafter(new_drafter_for_target(str(target), num_layers=1, block_size=4, target_layer_ids=[1, 2],
                                        dtype="float32"), tmp_path / "draft")
    prompt, n = list(range(100, 120)), 16
    model, tok = load_target(str(target), dtype=torch.float32)
    draft = load_drafter(tmp_path / "draft", target_config=model.config, tokenizer=tok).eval()
    draft.attach_target(model)
    plain = plain_generate(model, prompt, n)
    ours = speculative_generate(draft, model, prompt, n)
    assert ours.tokens == plain.tokens

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "TMPDIR": str(tmp_path), "PYTHONPATH": ""}
    proc = subprocess.run([vllm_python, "-c", SCRIPT, str(target), str(tmp_path / "draft"), json.dumps(prompt), str(n)],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    served = json.loads(lines[-1].removeprefix("RESULT "))
    assert served["tokens"] == plain.tokens
    # vLLM counts a draft per verification step after the prefill, as our loop counts steps
    assert served["metrics"]["vllm:spec_decode_num_drafts"] == len(ours.steps)
    assert served["metrics"]["vllm:spec_decode_num_accepted_tokens"] == sum(s.accepted for s in ours.steps)
